"""A bf16 training step: distopt.Optimizer("adamw") against torch.optim.AdamW(foreach=True) on the same bf16
model, steps interleaved in one process, medians (issue 71 item 3; docs/optimizers.md "Speed").

    python bench/bf16_step.py [--threads N] [--steps S] [--width W] [--batch B]

The model: 4 bf16 Linear layers of [W, W] (W 2048: 16.8 M parameters) with GELUs, a batch of B tokens (default
256), mean-squared loss in fp32; a whole step is zero_grad, forward, backward and step; the optimizer part is
step() alone. distopt keeps an fp32 master per bf16 parameter (its states are fp32: AdamW's exp_avg and
exp_avg_sq), torch's foreach AdamW steps the bf16 parameters with bf16 states: the two do not compute the same
numbers (torch rounds every intermediate to bf16), so this times, it does not compare. OMP_WAIT_POLICY=PASSIVE
(torch's OpenMP threads sleep after torch's work rather than spin on the cores distopt's step needs). Needs
torch and distopt's Python package."""
import argparse
import os
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    os.environ["DOPT_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    import distopt
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)

    def model():
        torch.manual_seed(1)
        layers = []
        for k in range(4):
            layers += [torch.nn.Linear(a.width, a.width, bias=True)] + ([torch.nn.GELU()] if k < 3 else [])
        return torch.nn.Sequential(*layers).to(torch.bfloat16)

    models = {"torch foreach": model(), "distopt": model()}
    opts = {"torch foreach": torch.optim.AdamW(models["torch foreach"].parameters(), lr=1e-4, weight_decay=0.01,
                                               foreach=True),
            "distopt": distopt.Optimizer("adamw", models["distopt"].parameters(), lr=1e-4, weight_decay=0.01)}
    n = sum(p.numel() for p in models["distopt"].parameters())
    whole = {k: [] for k in opts}
    part = {k: [] for k in opts}
    for s in range(a.steps + 1):
        x = torch.randn(a.batch, a.width).to(torch.bfloat16)
        y = torch.randn(a.batch, a.width)
        for k, o in opts.items():
            t0 = time.perf_counter()
            o.zero_grad(set_to_none=True)
            loss = (models[k](x).float() - y).pow(2).mean()
            loss.backward()
            t1 = time.perf_counter()
            o.step()
            t2 = time.perf_counter()
            if s:
                whole[k].append(t2 - t0)
                part[k].append(t2 - t1)
    mw = {k: statistics.median(v) for k, v in whole.items()}
    mp = {k: statistics.median(v) for k, v in part.items()}
    print(f"torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()}, {a.threads} thread(s), "
          f"{n / 1e6:.1f} M bf16 parameters, batch {a.batch}, {a.steps} steps after a warm-up, medians")
    print("| optimizer | whole step ms | step() ms | whole / torch | step() / torch |")
    print("| --- | ---: | ---: | ---: | ---: |")
    t = "torch foreach"
    for k in opts:
        print(f"| {k} | {mw[k] * 1e3:.1f} | {mp[k] * 1e3:.1f} | {mw[k] / mw[t]:.2f}x | {mp[k] / mp[t]:.2f}x |")


if __name__ == "__main__":
    main()
