"""Muon's orthogonalised update: torch.optim.Muon's Newton-Schulz (torch 2.15, on this CPU) against distopt's
muon with flavor=torch (docs/precision.md, "Muon's Newton-Schulz"), per matrix.

    python bench/muon_ns_margins.py [--count N] [--seed S]

For each of N matrices (random shapes 2..160 a side, three kinds: Gaussian, low rank plus noise, heavy tailed;
and the LLM-like shapes listed below), O_torch = torch.optim._muon._zeropower_via_newtonschulz(G) and O_ours
from one distopt muon step (momentum 0: the update is G; lr 1, weight decay 0, the parameter starts at 0, so
the parameter after the step is -O exactly). Prints the elements that differ, the normwise relative error
max|O_ours - O_torch| / max|O_torch| (verify's metric) and that error in bf16 ulps of max|O_torch| (2^-8), the
worst over all, and the margin to verify's declared update bound (2^-4). Run it under
ONEDNN_MAX_CPU_ISA=AVX2 / AVX512_CORE and ATEN_CPU_CAPABILITY=avx2 to force other kernels. Needs torch >= 2.9
and distopt's Python package on the path."""
import argparse
import os

import numpy as np
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

import distopt

BOUND = 2.0 ** -1  # verify/stats.c MUON_UPDATE


def ours(g):
    p = torch.nn.Parameter(torch.zeros_like(g))
    opt = distopt.Optimizer("muon", [p], lr=1.0, momentum=0.0, weight_decay=0.0, use_muon=True, flavor="torch")
    p.grad = g.clone()
    opt.step()
    return -p.detach()


def matrices(rng, count):
    for (h, w) in ((64, 256), (128, 512), (256, 1024)):  # LLM-like (wide; a tall one is iterated transposed)
        yield "llm", rng.standard_normal((h, w)).astype(np.float32)
    for i in range(count):
        h, w = sorted(int(x) for x in rng.integers(2, 161, size=2))
        g = rng.standard_normal((h, w)).astype(np.float32)
        kind = ("gauss", "lowrank", "heavy")[i % 3]
        if kind == "lowrank":
            r = max(1, h // 8)
            g = (rng.standard_normal((h, r)) @ rng.standard_normal((r, w)) + 0.01 * g).astype(np.float32)
        elif kind == "heavy":
            g = (g * np.exp(2 * rng.standard_normal((h, w)))).astype(np.float32)
        yield kind, g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(a.seed)
    worst, n, exact, per_kind = 0.0, 0, 0, {}
    for kind, g in matrices(rng, a.count):
        G = torch.from_numpy(g)
        t = torch_ns(G, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
        o = ours(G)
        d = (o - t).abs()
        rel = float(d.max() / t.abs().max())
        n += 1
        exact += int(rel == 0.0)
        k = per_kind.setdefault(kind, [0, 0.0])
        k[0] += 1
        k[1] = max(k[1], rel)
        worst = max(worst, rel)
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"| torch {torch.__version__} | ATen {cap} | oneDNN max ISA {isa} | matrices {n} | bitwise {exact} | "
          f"worst rel {worst:.3g} ({worst / 2 ** -8:.2f} bf16 ulps) | margin to {BOUND:g}: {BOUND / worst if worst else float('inf'):.1f} |")
    for kind, (cnt, w) in sorted(per_kind.items()):
        print(f"|   {kind}: {cnt} matrices, worst {w:.3g} |")


if __name__ == "__main__":
    main()
