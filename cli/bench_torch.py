#!/usr/bin/env python3
"""PyTorch CPU eager timings for `distopt bench --torch PYTHON`.

Times optimizer.step() of torch AdamW, HF transformers Adafactor and
came_pytorch CAME on one fp32 [H, W] parameter with 2 threads, with the same
hyperparameters as the C bench (defaults; CAME lr=2e-4). Prints one line
"RESULT <name> <median ms>" per optimizer, "SKIP <why>" for what is not
available. Exit status 0 if at least one optimizer was timed.
"""
import argparse
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4096x4096")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--optimizers", default="adamw,adafactor,came")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    h, w = (int(x) for x in a.size.lower().split("x"))
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"SKIP import torch failed: {e}")
        return 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    def make_adamw(p):
        return torch.optim.AdamW([p])  # lr=1e-3, weight_decay=1e-2 as distopt's defaults

    def make_adafactor(p):
        from transformers.optimization import Adafactor
        return Adafactor([p])  # HF defaults: relative_step, scale_parameter, no beta1

    def make_came(p):
        from came_pytorch import CAME
        return CAME([p], lr=2e-4)

    makers = {"adamw": make_adamw, "adafactor": make_adafactor, "came": make_came}
    timed = 0
    for name in a.optimizers.split(","):
        if name not in makers:
            print(f"SKIP {name}: no PyTorch counterpart in this script")
            continue
        p = torch.nn.Parameter(torch.randn(h, w) * 0.02)
        p.grad = torch.randn(h, w) * 1e-3
        try:
            opt = makers[name](p)
        except Exception as e:  # noqa: BLE001
            print(f"SKIP {name}: {type(e).__name__}: {e}")
            continue
        ts = []
        with torch.no_grad():
            for k in range(a.warmup + a.iters):
                t0 = time.perf_counter()
                opt.step()
                dt = time.perf_counter() - t0
                if k >= a.warmup:
                    ts.append(dt)
        print(f"RESULT {name} {1e3 * statistics.median(ts):.3f}")
        sys.stdout.flush()
        timed += 1
        del opt, p
    return 0 if timed else 1


if __name__ == "__main__":
    sys.exit(main())
