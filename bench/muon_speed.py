"""Muon's step: torch.optim.Muon against distopt's muon with flavor=torch (the same arithmetic, docs/muon.md),
steps interleaved in one process, medians, one row per shape (docs/muon.md "Speed").

    python bench/muon_speed.py [--threads N] [--steps S] [--big]

Shapes: [1024, 1024]; an expert stack [8, 1024, 1024] (torch.optim.Muon takes 2-D parameters only: eight
[1024, 1024] matrices there, one [8, 1024, 1024] parameter in distopt, the same eight Newton-Schulz runs);
--big adds [4096, 4096] (minutes). Threads: torch.set_num_threads(N) and DOPT_NUM_THREADS=N (set before distopt
creates its pool). Force torch's kernels with ONEDNN_MAX_CPU_ISA (AVX2, AVX512_CORE, ...) and
ATEN_CPU_CAPABILITY, distopt's with DOPT_NS_KERNEL=fmaf (a CPU without AVX512-BF16); the kernel is printed. Needs torch >= 2.9 and
distopt's Python package."""
import argparse
import os
import statistics
import sys
import time


def _kernel():
    """distopt's product kernel on this CPU: vdpbf16ps pairs where the CPU has AVX512-BF16 (and the library's
    check of the instruction passes, ref/ns.c), else fmaf."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return "unknown"
    if os.environ.get("DOPT_NS_KERNEL") == "fmaf":
        return "fmaf (DOPT_NS_KERNEL=fmaf)"
    return "vdpbf16ps pairs (AVX512-BF16)" if " avx512_bf16" in flags else "fmaf (no AVX512-BF16)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--no-stack", action="store_true", help="skip the [8, 1024, 1024] stack")
    ap.add_argument("--omp-wait", default="PASSIVE", help="OMP_WAIT_POLICY for torch's OpenMP threads (PASSIVE: "
                    "they sleep after torch's step instead of spinning on the cores distopt's step then needs; torch's "
                    "own time is the same; ACTIVE or '' to see the other)")
    a = ap.parse_args()
    os.environ["DOPT_NUM_THREADS"] = str(a.threads)
    if a.omp_wait:
        os.environ["OMP_WAIT_POLICY"] = a.omp_wait
    import torch
    import distopt
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = [(1, 1024, 1024)] + ([] if a.no_stack else [(8, 1024, 1024)]) + ([(1, 4096, 4096)] if a.big else [])
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "default")
    print(f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, oneDNN max ISA {isa}, "
          f"OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}, {a.threads} thread(s), {a.steps} steps "
          f"each after one warm-up, medians; distopt's products: {_kernel()}")
    print("| shape | torch.optim.Muon ms | distopt muon (flavor=torch) ms | distopt / torch |")
    print("| --- | ---: | ---: | ---: |")
    for (e, h, w) in shapes:
        steps = 1 if h >= 4096 else a.steps
        tp = [torch.nn.Parameter(torch.randn(h, w) * 0.02) for _ in range(e)]
        dp = torch.nn.Parameter(torch.stack([p.detach().clone() for p in tp]) if e > 1 else tp[0].detach().clone())
        topt = torch.optim.Muon(tp, lr=0.02, weight_decay=0.1)
        dopt = distopt.Optimizer("muon", [dp], lr=0.02, weight_decay=0.1, use_muon=True, flavor="torch")
        tt, dt = [], []
        for s in range(steps + 1):
            g = torch.randn(e, h, w)
            for i, p in enumerate(tp):
                p.grad = g[i].clone()
            dp.grad = g.clone() if e > 1 else g[0].clone()
            t0 = time.perf_counter()
            topt.step()
            t1 = time.perf_counter()
            dopt.step()
            t2 = time.perf_counter()
            if s:  # the first is a warm-up
                tt.append(t1 - t0), dt.append(t2 - t1)
        mt, md = statistics.median(tt), statistics.median(dt)
        name = f"[{e}, {h}, {w}]" if e > 1 else f"[{h}, {w}]"
        print(f"| {name} | {mt * 1e3:.1f} | {md * 1e3:.1f} | {md / mt:.2f}x |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
