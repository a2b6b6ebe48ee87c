"""AdamW's step: torch.optim.AdamW (default single-tensor loop, foreach, fused) against distopt's adamw, and the
memory floor, steps interleaved in one process, medians (issue 71 item 2; docs/optimizers.md "Speed").

    python bench/adamw_speed.py [--threads N] [--steps S] [--n ROWS]

A [ROWS, 4096] weight and a [4096] bias (ROWS 4096: 16.8 M elements), fp32, lr 1e-3, weight decay 0.01. The
floor: AdamW reads the parameter, gradient and both moments and writes the parameter and both moments, 7 floats
per element; STREAM's triad (a = b + s·c: 3 floats per element) timed here with torch at the same thread count
gives the bandwidth, floor = 28 bytes · n / bandwidth. OMP_WAIT_POLICY=PASSIVE (torch's OpenMP threads sleep
after torch's step rather than spin on the cores distopt's step needs). Needs torch and distopt's Python
package."""
import argparse
import os
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args()
    os.environ["DOPT_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import distopt
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    shapes = [(a.n, 4096), (4096,)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    base = [torch.randn(s) * 0.02 for s in shapes]
    kinds = {"torch default": dict(foreach=False), "torch foreach": dict(foreach=True), "torch fused": dict(fused=True)}
    opts, params = {}, {}
    for k, kw in kinds.items():
        params[k] = [torch.nn.Parameter(b.clone()) for b in base]
        opts[k] = torch.optim.AdamW(params[k], lr=1e-3, weight_decay=0.01, **kw)
    params["distopt"] = [torch.nn.Parameter(b.clone()) for b in base]
    opts["distopt"] = distopt.Optimizer("adamw", params["distopt"], lr=1e-3, weight_decay=0.01)
    x, y, z = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    times = {k: [] for k in list(opts) + ["triad"]}
    for s in range(a.steps + 1):
        grads = [torch.randn(sh) for sh in shapes]
        for k, o in opts.items():
            for p, g in zip(params[k], grads):
                p.grad = g.clone()
            t0 = time.perf_counter()
            o.step()
            if s:
                times[k].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.add(y, z, alpha=0.5, out=x)
        if s:
            times["triad"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    bw = 12.0 * numel / med["triad"]
    floor = 28.0 * numel / bw
    print(f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, {a.threads} thread(s), "
          f"{numel / 1e6:.1f} M elements, {a.steps} steps after a warm-up, medians; triad {bw / 1e9:.1f} GB/s, "
          f"floor (28 B/element) {floor * 1e3:.1f} ms")
    print("| step | ms | GB/s (28 B/element) | / floor | distopt / it |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for k in opts:
        print(f"| {k} | {med[k] * 1e3:.1f} | {28.0 * numel / med[k] / 1e9:.1f} | {med[k] / floor:.2f} | "
              f"{med['distopt'] / med[k]:.2f}x |")


if __name__ == "__main__":
    main()
