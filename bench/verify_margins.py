"""Margins of `distopt verify`'s declared tolerances on the torch this interpreter has (docs/verify.md "Margins on
torch 2"): each upstream optimizer class trains a seeded MLP (12-32-24-5, tanh) for 30 steps, recorded with
distopt.record and verified by the distopt CLI; prints, per class and CPU kernel (ATEN_CPU_CAPABILITY as torch
reports it: the default, and avx2 forced), the worst normwise relative error of parameters and of states, the
declared bound and the margin (bound / error). A margin under 3 is flagged.

    python3 bench/verify_margins.py [--cli build/cli/distopt]      (PYTHONPATH=python, DISTOPT_LIBRARY set)
"""
import json
import os
import subprocess
import sys
import tempfile

CASES = ["adamw_default", "adamw_foreach", "adamw_fused", "hf_adafactor", "came", "lamb", "adamw_fused_long"]
LONG = 1000  # adamw_fused_long: a 32-128-128-8 MLP, 1 000 steps recorded every 10 (near convergence |g| >> |m|)


def one(case, out):
    """Runs in a child (its ATEN_CPU_CAPABILITY fixed before torch loads): records `case` into out."""
    import torch
    from distopt.record import record
    torch.manual_seed(20240611)
    torch.set_num_threads(1)
    long = case == "adamw_fused_long"
    model = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                                torch.nn.Linear(24, 5))
    if long:
        model = torch.nn.Sequential(torch.nn.Linear(12, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128),
                                    torch.nn.Tanh(), torch.nn.Linear(128, 5))
    if case.startswith("adamw"):
        kw = {"foreach": True} if case.endswith("foreach") else {"fused": True} if case.endswith("fused") else \
            {"foreach": False}
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.05, **kw)
    elif case == "hf_adafactor":
        from transformers.optimization import Adafactor
        opt = Adafactor(model.parameters(), lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False)
    elif case == "came":
        from came_pytorch import CAME
        opt = CAME(model.parameters(), lr=2e-4, weight_decay=0.01)
    else:
        import torch_optimizer
        opt = torch_optimizer.Lamb(model.parameters(), lr=1e-2, weight_decay=0.01)
    with record(opt, out, names=model, flush_every=10, every=10 if long else 1):
        for t in range(1, (LONG if long else 30) + 1):
            g = torch.Generator().manual_seed(7919 * (t if not long else 1))  # long: one batch, to convergence
            x, y = torch.randn(16, 12, generator=g), torch.randn(16, 5, generator=g)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
    print(torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        one(sys.argv[2], sys.argv[3])
        return
    cli = sys.argv[sys.argv.index("--cli") + 1] if "--cli" in sys.argv else os.environ.get("DISTOPT_CLI",
                                                                                              "build/cli/distopt")
    import torch
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; declared bounds: parameters / states")
    print(f"{'class':<16} {'kernel':<8} {'params':>9} {'states':>9} {'bounds':>13} {'margins':>13}")
    for cap, mode in ((None, ""), ("avx2", ""), (None, "--stepwise")):
        if mode:
            print("--stepwise (declared per-step bounds):")
        for case in CASES:
            with tempfile.TemporaryDirectory() as d:
                rec = os.path.join(d, "r.rec")
                env = dict(os.environ)
                if cap:
                    env["ATEN_CPU_CAPABILITY"] = cap
                p = subprocess.run([sys.executable, __file__, "--child", case, rec], capture_output=True, text=True,
                                   env=env)
                if p.returncode != 0:
                    print(f"{case:<16} {cap or 'default':<8} not run: {p.stderr.strip().splitlines()[-1][:80]}")
                    continue
                kernel = p.stdout.strip().splitlines()[-1]
                jp = os.path.join(d, "v.json")
                v = subprocess.run([cli, "verify", rec, "--json", jp, "--quiet"] + ([mode] if mode else []),
                                   capture_output=True, text=True)
                rep = json.load(open(jp)) if os.path.exists(jp) else None
                if rep is None:
                    print(f"{case:<16} {kernel:<8} verify exit {v.returncode}: {v.stderr.strip()[:80]}")
                    continue
                wp = max([t["max_rel"] for t in rep["tensors"] if t["state"] is None] or [0])
                ws = max([t["max_rel"] for t in rep["tensors"] if t["state"] not in (None, "step")] or [0])
                tp, ts = rep["tolerance"]["param"], rep["tolerance"]["state"]
                mp, ms = (tp / wp if wp else float("inf")), (ts / ws if ws else float("inf"))
                flag = "  < 3" if min(mp, ms) < 3 else ""
                print(f"{case:<16} {kernel:<8} {wp:9.2e} {ws:9.2e} {tp:6.0e}/{ts:6.0e} {mp:6.1f}/{ms:6.1f}{flag}"
                      f"{'' if v.returncode == 0 else f'  exit {v.returncode}'}")


if __name__ == "__main__":
    main()
