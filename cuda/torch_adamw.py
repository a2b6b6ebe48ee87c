#!/usr/bin/env python3
"""Times PyTorch's fused AdamW step on one fp32 CUDA tensor of N elements
(the peer of dopt_cuda_bench's "adamw step" row, same N, same defaults:
lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2). Prints one line:
  torch_fused_adamw n=N median_ms=M
Median of REPS CUDA-event timings after warm-up. Exit 77 without CUDA/torch.

usage: torch_adamw.py [--n N] [--reps R]"""
import argparse
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 26)
    ap.add_argument("--reps", type=int, default=25)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_fused_adamw: skipped (no torch)")
        return 77
    if not torch.cuda.is_available():
        print("torch_fused_adamw: skipped (no CUDA device)")
        return 77
    p = torch.nn.Parameter(torch.randn(a.n, device="cuda", dtype=torch.float32) * 0.02)
    p.grad = torch.randn(a.n, device="cuda", dtype=torch.float32) * 1e-3
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, fused=True)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(a.reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        opt.step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    print(f"torch_fused_adamw n={a.n} median_ms={times[len(times) // 2]:.4f} torch={torch.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
