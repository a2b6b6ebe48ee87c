"""Real PyTorch clients recorded with distopt.record and checked with `distopt verify` (docs/verify.md).

    run_client.py adamw          torch.optim.AdamW on a small MLP (two groups, an lr schedule): exit 0; also
                                 every=5 without states, an interrupted run's prefix, and a wrong lr: exit 1
    run_client.py zero           ZeroRedundancyOptimizer(AdamW) under DDP, 2 gloo processes, every rank records
                                 its own parameters: exit 0, both ranks compared; a plain AdamW under DDP
                                 (replicas on both ranks): exit 0
    run_client.py sharded        a hand-written sharded Adafactor on 2 gloo ranks: with the column means over
                                 the local rows (the bug) exit 1 naming step 1, w/exp_avg_sq_col and rank 0;
                                 with global statistics (all_reduce) exit 0
    run_client.py hf_adafactor   transformers' Adafactor: exit 0; needs transformers (this interpreter, else
                                 $DISTOPT_TRANSFORMERS_PYTHON, else the golden generator's venv
                                 .golden-venv/adafactor, else skipped with the reason: exit 77)

Exit 77 (skipped, with the reason) when this interpreter lacks torch."""
import os
import shutil
import subprocess
import sys

try:
    import torch
except ImportError as e:
    print(f"skipped: {sys.executable} cannot import torch ({e}); Debian: apt-get install python3-torch")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402


def summary(report):
    worst = {}
    for t in report["tensors"]:
        if not t["compared"] or t["state"] == "step":
            continue
        k = "states" if t["state"] else "params"
        worst[k] = max(worst.get(k, 0.0), t["max_rel"] or 0.0)
        worst[k + "_ulp"] = max(worst.get(k + "_ulp", 0), t["max_ulp"])
    print("measured: worst normwise relative error params %.3g states %.3g; worst ULP params %d states %d"
          % (worst.get("params", 0), worst.get("states", 0), worst.get("params_ulp", 0), worst.get("states_ulp", 0)))
    return worst


def case_adamw():
    from distopt.record import record, verify  # (not `import distopt.record as`: see docs/verify.md)
    d = H.work_dir("adamw")
    H.seeded()
    model = H.mlp()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.98), eps=1e-8)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)  # wraps opt.step itself
    before = opt.__dict__.get("step")
    trace = os.path.join(d, "full.rec")
    with record(opt, trace, names=model, flush_every=7) as r:
        H.check(opt.__dict__.get("step") is not before, "record() wraps the optimizer's step")
        for t in range(1, 31):
            H.train_step(model, opt, t)
            sched.step()
    H.check(opt.__dict__.get("step") is before, "the with-block restores the step it found (the scheduler's)")
    H.check(r.t == 30, f"recorded {r.t} steps")
    out, rep = H.run_verify(trace, expect=0)
    H.check("WITHIN TOLERANCE" in out, "verdict line")
    H.check(rep["verdict"]["kind"] == "within_tolerance", "JSON verdict")
    H.check(len(rep["hparams"]) == 2, "two parameter groups replayed")
    import json
    with open(os.path.join(trace, "index.json")) as f:
        index = json.load(f)
    H.check(index["complete"] and index["steps"] == 30 and len(index["ranks"][0]["files"]) == 5,
            "index: complete, 30 steps in 5 files of 7")
    H.check([c["step"] for c in index["hparam_changes"]] == [11, 11, 21, 21], "the lr schedule is recorded")
    w = summary(rep)
    H.check(w["params"] > 0, "torch's AdamW is not bitwise the reference (add_(alpha=) fused): errors seen")

    # parameters only, every 5th step
    H.seeded()
    model = H.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace2 = os.path.join(d, "every5.rec")
    with record(opt, trace2, every=5, states=False, names=model, flush_every=4):
        for t in range(1, 21):
            H.train_step(model, opt, t)
    out, rep = H.run_verify(trace2, expect=0)
    H.check(all(t["state"] is None for t in rep["tensors"]), "states=False records no state")
    H.check(all(t["steps"] == [5, 10, 15, 20] for t in rep["tensors"]), "every=5: steps 5, 10, 15, 20 compared")

    # an interrupted run: the index covers the blocks written before the exception
    H.seeded()
    model = H.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    trace3 = os.path.join(d, "interrupted.rec")
    try:
        with record(opt, trace3, names=model, flush_every=5):
            for t in range(1, 31):
                H.train_step(model, opt, t)
                if t == 13:
                    raise KeyboardInterrupt("simulated")
    except KeyboardInterrupt:
        pass
    H.check("step" not in opt.__dict__, "an exception restores the optimizer's step")
    with open(os.path.join(trace3, "index.json")) as f:
        index = json.load(f)
    H.check(index["steps"] == 13 and not index["complete"], f"interrupted index: steps {index['steps']}")
    out, rep = H.run_verify(trace3, expect=0)
    H.check("interrupted" in out, "the table says the recording is a prefix")

    # the verifier is not blind: the same recording with a 1% larger lr in the index diverges at step 1
    bad = os.path.join(d, "wrong_lr.rec")
    shutil.copytree(trace, bad)
    ip = os.path.join(bad, "index.json")
    with open(ip) as f:
        index = json.load(f)
    index["groups"][0]["hparams"] = index["groups"][0]["hparams"].replace("lr=0.003", "lr=0.00303")
    with open(ip, "w") as f:
        json.dump(index, f)
    out, rep = H.run_verify(bad, expect=1)
    H.check(rep["verdict"]["step"] == 1 and rep["verdict"]["rank"] == 0, "a wrong lr diverges at step 1")

    # distopt.verify's result object, and what record() refuses
    res = verify(trace)
    H.check(res.ok and res.returncode == 0 and res.verdict["kind"] == "within_tolerance", f"verify(): {res!r}")
    res = verify(bad)
    H.check(res.diverged and not res and res.verdict["step"] == 1, f"verify() of the wrong lr: {res!r}")
    res = verify(os.path.join(d, "missing.rec"))
    H.check(res.returncode == 2 and res.report is None and "missing.rec" in res.stderr, f"verify() bad input: {res!r}")
    refusals = [
        (lambda: record(torch.optim.SGD(model.parameters(), lr=0.1), os.path.join(d, "sgd.rec")), ValueError,
         "no distopt mapping for torch.optim.sgd.SGD: pass name="),
        (lambda: record(opt, os.path.join(d, "late.rec")), ValueError, "the optimizer has stepped already"),
        (lambda: record(torch.optim.AdamW(model.parameters()), trace), FileExistsError, "already holds a recording"),
        (lambda: record(torch.optim.AdamW(model.parameters()), os.path.join(d, "x.rec"), every=0), ValueError,
         "every=0 must be an integer >= 1"),
    ]
    for fn, exc, text in refusals:
        try:
            fn()
            H.check(False, f"record() accepted what it must refuse ({text})")
        except exc as e:
            H.check(text in str(e), f"record() refusal says '{text}': {e}")
            print(f"refused as expected: {e}")
    H.check("step" not in opt.__dict__, "a refused record() leaves the optimizer alone")


def case_zero():
    d = H.work_dir("zero")
    trace = os.path.join(d, "zero.rec")
    H.launch(H.zero_worker, 2, trace, 20)
    out, rep = H.run_verify(trace, expect=0)
    by_rank = H.tensors_by_rank(rep)
    H.check(sorted(by_rank) == [0, 1], f"both ranks recorded and compared (ranks {sorted(by_rank)})")
    owners = {}
    for t in rep["tensors"]:
        if t["state"] is None:
            H.check(t["param"] not in owners, f"{t['param']} recorded by one owner rank")
            owners[t["param"]] = t["rank"]
    H.check(len(owners) == 6, f"every parameter owned once ({owners})")
    H.check(any(t["state"] == "exp_avg_sq" for t in by_rank[1]), "rank 1's inner AdamW states compared")
    summary(rep)
    # ZeroRedundancyOptimizer around distopt.Optimizer: its states (opt.state) recorded on both ranks, verified
    dz = os.path.join(d, "zero_distopt.rec")
    H.launch(H.zero_worker, 2, dz, 8, "distopt")
    out, rep = H.run_verify(dz, expect=0)
    by_rank = H.tensors_by_rank(rep)
    H.check(all(any(t["state"] == "exp_avg" for t in by_rank.get(r, [])) for r in (0, 1)),
            "ZeRO(distopt.Optimizer): both ranks' inner states recorded and compared")
    summary(rep)
    # a plain AdamW under DDP: replicas, every rank's copy of every parameter compared
    ddp = os.path.join(d, "ddp.rec")
    H.launch(H.ddp_worker, 2, ddp, 10)
    out, rep = H.run_verify(ddp, expect=0)
    by_rank = H.tensors_by_rank(rep)
    H.check(all(len([t for t in by_rank.get(r, []) if t["state"] is None]) == 6 for r in (0, 1)),
            "DDP: both ranks' replicas of all 6 parameters compared")


def case_sharded():
    d = H.work_dir("sharded")
    buggy = os.path.join(d, "local_stats.rec")
    H.launch(H.sharded_worker, 2, buggy, 12, True)
    out, rep = H.run_verify(buggy, expect=1)
    want = "DIVERGED at step 1 (tensor w/exp_avg_sq_col, rank 0"
    H.check(want in out, f"the verdict names the step, tensor and rank: '{want}'")
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["tensor"], v["rank"]) == ("diverged", 1, "w/exp_avg_sq_col", 0), f"JSON {v}")
    good = os.path.join(d, "global_stats.rec")
    H.launch(H.sharded_worker, 2, good, 12, False)
    out, rep = H.run_verify(good, expect=0)
    H.check(sorted(H.tensors_by_rank(rep)) == [0, 1], "both ranks' pieces compared")
    summary(rep)


def transformers_python():
    """An interpreter that imports transformers.optimization: this one, $DISTOPT_TRANSFORMERS_PYTHON, or the
    golden generator's venv for Adafactor (transformers 4.36.2 over Debian's torch, docs/golden.md)."""
    try:
        import transformers.optimization  # noqa: F401
        return sys.executable, None
    except Exception as e:  # noqa: BLE001 (any import failure means: not here)
        why = f"{sys.executable}: import transformers.optimization failed ({type(e).__name__}: {e})"
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cands = [os.environ.get("DISTOPT_TRANSFORMERS_PYTHON"), os.path.join(src, ".golden-venv", "adafactor", "bin", "python")]
    for c in cands:
        if c and os.path.isfile(c) and os.path.abspath(c) != os.path.abspath(sys.executable):  # a venv links the same binary
            p = subprocess.run([c, "-c", "import torch, transformers.optimization"], capture_output=True, text=True)
            if p.returncode == 0:
                return c, why
            why += f"; {c}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else 'failed'}"
    return None, why


def case_hf_adafactor():
    try:
        from transformers.optimization import Adafactor
    except Exception:  # noqa: BLE001
        py, why = transformers_python()
        if py is None:
            print(f"skipped: transformers' Adafactor cannot be imported: {why}")
            sys.exit(77)
        print(f"note: {why}; running under {py}")
        sys.stdout.flush()
        os.execv(py, [py, os.path.abspath(__file__), "hf_adafactor"])
    import transformers
    from distopt.record import record  # (not `import distopt.record as`: see docs/verify.md)
    print(f"transformers {transformers.__version__} from {os.path.dirname(transformers.__file__)}")
    d = H.work_dir("hf_adafactor")
    H.seeded()
    model = H.mlp()
    extra = torch.nn.Parameter(torch.randn(2, 3, 5) * 0.3)  # a batch dimension: factored over the last two
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")] + [extra]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = Adafactor([{"params": weights}, {"params": biases, "beta1": 0.9, "weight_decay": 0.01}])
    names = dict(model.named_parameters())
    names["extra"] = extra
    trace = os.path.join(d, "adafactor.rec")
    with record(opt, trace, names=names, flush_every=8):
        for t in range(1, 31):
            x, y = H.batch(t)
            g = torch.Generator().manual_seed(H.SEED + t)
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean() + (extra * torch.randn(2, 3, 5, generator=g)).sum()
            loss.backward()
            opt.step()
    out, rep = H.run_verify(trace, expect=0)
    keys = {t["state"] for t in rep["tensors"]}
    H.check({"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg", "RMS"} <= keys,
            f"factored, unfactored and momentum states compared ({sorted(k for k in keys if k)})")
    summary(rep)


CASES = {"adamw": case_adamw, "zero": case_zero, "sharded": case_sharded, "hf_adafactor": case_hf_adafactor}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: run_client.py {'|'.join(CASES)}")
    CASES[sys.argv[1]]()
    print(f"PASS {sys.argv[1]}")
