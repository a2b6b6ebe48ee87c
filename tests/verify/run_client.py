"""Real PyTorch clients recorded with distopt.record and checked with `distopt verify` (docs/verify.md).

    run_client.py adamw          torch.optim.AdamW on a small MLP (two groups, an lr schedule): exit 0; also
                                 every=5 without states, an interrupted run's prefix, and a wrong lr: exit 1
    run_client.py zero           ZeroRedundancyOptimizer(AdamW) under DDP, 2 gloo processes, every rank records
                                 its own parameters: exit 0, both ranks compared; a plain AdamW under DDP
                                 (replicas on both ranks): exit 0
    run_client.py sharded        a hand-written sharded Adafactor on 2 gloo ranks: with the column means over
                                 the local rows (the bug) exit 1 naming step 1, w/exp_avg_sq_col and rank 0;
                                 with global statistics (all_reduce) exit 0
    run_client.py tp             a column- and a row-parallel Linear (Megatron-style) with a TP Adafactor on 2 gloo
                                 ranks, block layouts: exit 0; row means over the local columns: exit 1 (step 1,
                                 w2/exp_avg_sq_row, rank 0)
    run_client.py pipeline       a 2-stage pipeline (send/recv) on 2 gloo ranks, each stage its AdamW and lr
                                 schedule: exit 0; stage 1's schedule one step behind: exit 1 at step 4, rank 1
    run_client.py fsdp           FSDP-style flat shards spanning tensors with a flat LAMB on 2 gloo ranks: exit 0;
                                 its trust ratios from the local shard only: exit 1 at step 1
    run_client.py hf_adafactor   transformers' Adafactor: exit 0; needs transformers (this interpreter, else
                                 $DISTOPT_TRANSFORMERS_PYTHON, else the golden generator's venv
                                 .golden-venv/adafactor, else skipped with the reason: exit 77)

Exit 77 (skipped, with the reason) when this interpreter lacks torch."""
import json
import math
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


def copy_with_hparams(src, dst, group, old, new):
    """A copy of recording src at dst whose index says `new` where group `group`'s hyperparameters say `old`
    (what the recorded run did stays as it was)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    ip = os.path.join(dst, "index.json")
    with open(ip) as f:
        index = json.load(f)
    H.check(old in index["groups"][group]["hparams"], f"{old} in {index['groups'][group]['hparams']}")
    index["groups"][group]["hparams"] = index["groups"][group]["hparams"].replace(old, new)
    with open(ip, "w") as f:
        json.dump(index, f)
    return dst


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
    bad = copy_with_hparams(trace, os.path.join(d, "wrong_lr.rec"), 0, "lr=0.003", "lr=0.00303")
    out, rep = H.run_verify(bad, expect=1)
    H.check(rep["verdict"]["step"] == 1 and rep["verdict"]["rank"] == 0, "a wrong lr diverges at step 1")

    # a run resumed from a checkpoint and recorded as a window: `verify --continues` holds the values it starts
    # from against the recording it continues, bit for bit. A resume that zeroed the moments or reset the step
    # counter is consistent on its own (the window alone verifies: it replays from what it recorded) and is
    # named at the window's start
    import copy
    H.seeded()
    model = H.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    first = os.path.join(d, "resume_first.rec")
    with record(opt, first, names=model, flush_every=5):
        for t in range(1, 6):
            H.train_step(model, opt, t)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for how in ("exact", "moments_zeroed", "step_reset"):
        H.seeded()
        m2 = H.mlp()
        m2.load_state_dict(ckpt["model"])
        o2 = torch.optim.AdamW(m2.parameters(), lr=1e-3, weight_decay=0.01)
        o2.load_state_dict(copy.deepcopy(ckpt["opt"]))
        for st in o2.state.values():
            if how == "moments_zeroed":
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
            elif how == "step_reset":
                st["step"] = torch.zeros_like(st["step"]) if torch.is_tensor(st["step"]) else 0
        second = os.path.join(d, f"resume_{how}.rec")
        with record(o2, second, names=m2, start_step=5):
            for t in range(6, 11):
                H.train_step(m2, o2, t)
        H.run_verify(second, expect=0)
        out, rep = H.run_verify(second, "--continues", first, expect=0 if how == "exact" else 1)
        cont, v = rep["continues"], rep["verdict"]
        # the MLP's 1333 elements x 3 (the parameter, exp_avg, exp_avg_sq) and its 6 step counts
        H.check(cont["step"] == 5 and cont["compared"] == 1333 * 3 + 6 and cont["equal"] == (how == "exact"),
                f"{how}: --continues compared every value the window starts from: {cont}")
        want = {"exact": None, "moments_zeroed": ("0.weight/exp_avg", "0.weight/exp_avg_sq"),
                "step_reset": ("0.weight/step",)}[how]
        H.check(want is None or (v["kind"] == "resume" and v["step"] == 5 and v["tensor"] in want),
                f"{how}: named at the window's start: {v}")
    H.run_verify(first, "--continues", first, expect=2)  # a recording from step 0 continues nothing

    # distopt.verify's result object, and what record() refuses
    res = verify(trace)
    H.check(res.ok and res.returncode == 0 and res.verdict["kind"] == "within_tolerance", f"verify(): {res!r}")
    res = verify(bad)
    H.check(res.diverged and not res and res.verdict["step"] == 1, f"verify() of the wrong lr: {res!r}")
    res = verify(os.path.join(d, "missing.rec"))
    H.check(res.returncode == 2 and res.report is None and "missing.rec" in res.stderr, f"verify() bad input: {res!r}")
    # a class distopt does not implement is recorded as it is (for distopt.replay); verify says so
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with record(sgd, os.path.join(d, "sgd.rec"), names=model):
        H.train_step(model, sgd, 1)
    res = verify(os.path.join(d, "sgd.rec"))
    H.check(res.returncode == 2 and "optimizer.name is null: torch.optim.sgd.SGD has no distopt optimizer" in
            res.stderr, f"an as-is recording: {res.stderr}")
    refusals = [
        (lambda: record(opt, os.path.join(d, "late.rec")), ValueError, "the optimizer has stepped already (it "
         "holds state): pass start_step="),
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
    with open(os.path.join(trace, "index.json")) as f:
        H.check(json.load(f)["record"]["grad_agree"] is True, "a distributed recording carries the gradients' digests")
    # ZeRO without gradient synchronisation: each owner's arithmetic is right on its own gradient, so the
    # values alone pass (shown with grad_agree=False); the ranks' gradients disagree, named at step 1
    blind = os.path.join(d, "zero_nosync_values_only.rec")
    H.launch(H.zero_worker, 2, blind, 6, "torch", False, False)
    H.run_verify(blind, expect=0)
    unsync = os.path.join(d, "zero_nosync.rec")
    H.launch(H.zero_worker, 2, unsync, 6, "torch", False)
    out, rep = H.run_verify(unsync, expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["rank"]) == ("gradients", 1, 1)
            and "verdict: DIVERGED at step 1 (gradient of 0.weight: rank 1 differs from rank 0)" in out,
            f"unsynchronised ZeRO named by its gradients: {v}")
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


def case_tp():
    """Megatron-style tensor parallelism recorded with block layouts: a column-parallel Linear (split on dim 0)
    and a row-parallel one (split on dim 1, the layout a flat range cannot describe) under a TP Adafactor."""
    d = H.work_dir("tp")
    good = os.path.join(d, "tp.rec")
    H.launch(H.tp_worker, 2, good, 10, False)
    out, rep = H.run_verify(good, expect=0)
    blocks = {(t["param"], t["rank"]): t.get("block") for t in rep["tensors"] if t["state"] is None}
    H.check(blocks.get(("w2", 1)) == {"dim": 1, "lo": 4, "len": 4} and blocks.get(("w1", 0)) == {"dim": 0, "lo": 0, "len": 4},
            f"both ranks' blocks compared ({blocks})")
    summary(rep)
    # distopt.replay assembles logical tensors from blocks as verify does: the initial w2 is the seeded one
    from distopt.replay import _Recording
    rec = _Recording(good)
    H.seeded()
    W1, B1, W2 = torch.randn(H.H_TP, H.D_TP) * 0.5, torch.randn(H.H_TP) * 0.5, torch.randn(H.O_TP, H.H_TP) * 0.5
    H.check(torch.equal(rec.assemble("w2", 1, "init/w2"), W2.reshape(-1)), "replay assembles a dim-1 block layout")
    # record refuses a layout whose pieces overlap, in one line naming the parameter and the ranges
    from distopt.record import _check_cover
    params = [{"name": "w2", "shape": [H.O_TP, H.H_TP]}]
    piece = lambda lo, ln: {"param": "w2", "lo": 0, "len": H.O_TP * ln, "block": {"dim": 1, "lo": lo, "len": ln}}  # noqa: E731
    try:
        _check_cover(params, [{"rank": 0, "pieces": [piece(0, 4)]}, {"rank": 1, "pieces": [piece(3, 5)]}])
        H.check(False, "overlapping blocks refused")
    except ValueError as e:
        H.check("parameter w2: rank 1's elements dim 1 [3, 8) [0, 25) overlap rank 0's dim 1 [0, 4) [0, 20) partially"
                in str(e) and "\n" not in str(e), f"overlapping blocks refused in one line: {e}")
    _check_cover(params, [{"rank": 0, "pieces": [piece(0, 4)]}, {"rank": 1, "pieces": [piece(4, 4)]}])
    bad = os.path.join(d, "tp_local_rows.rec")
    H.launch(H.tp_worker, 2, bad, 10, True)
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["tensor"], v["rank"]) == ("diverged", 1, "w2/exp_avg_sq_row", 0),
            f"a row-parallel shard's local row means named at step 1: {v}")
    # the same layers under a TP LAMB: the trust ratios of the split tensors from all_reduced norms verify; from
    # the local block only they are named at step 1 on a split tensor
    good = os.path.join(d, "tp_lamb.rec")
    H.launch(H.tp_worker, 2, good, 8, False, "lamb")
    out, rep = H.run_verify(good, expect=0)
    summary(rep)
    bad = os.path.join(d, "tp_lamb_local.rec")
    H.launch(H.tp_worker, 2, bad, 8, True, "lamb")
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 1 and v["tensor"].split("/")[0] in ("w1", "b1", "w2"),
            f"a TP LAMB's block-local trust ratio named at step 1 on a split tensor: {v}")


def case_pipeline():
    """A 2-stage pipeline on 2 gloo ranks, each stage its own AdamW and lr schedule, each parameter recorded whole
    on its stage's rank with its stage (schema 4): exit 0, every tensor reported with its stage; stage 1's
    schedule one step behind from step 4: the recorder warns on every rank and keeps the disagreement in the
    index, and verify exits 1 at step 4 naming rank 1's lr (without that field: the values, at step 4 on rank 1,
    the lr schedule replayed being the recording's, stage 0's)."""
    d = H.work_dir("pipeline")
    good = os.path.join(d, "pipeline.rec")
    H.launch(H.pipeline_worker, 2, good, 8, False)
    with open(os.path.join(good, "index.json")) as f:
        H.check(json.load(f)["stages"] == 2, "the index says 2 stages")
    out, rep = H.run_verify(good, expect=0)
    owner = {t["param"]: t["rank"] for t in rep["tensors"] if t["state"] is None}
    H.check(owner == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": 1, "4.weight": 1, "4.bias": 1},
            f"each parameter recorded by its stage's rank ({owner})")
    H.check(all(t.get("stage") == t["rank"] for t in rep["tensors"]), "every tensor reported with its stage")
    for r in (0, 1):
        with open(f"{good}.warnings{r}") as f:
            H.check(f.read() == "", f"no hyperparameter warning on rank {r} when the stages agree")
    summary(rep)
    bad = os.path.join(d, "pipeline_lagging.rec")
    H.launch(H.pipeline_worker, 2, bad, 8, True)
    for r in (0, 1):
        with open(f"{bad}.warnings{r}") as f:
            said = f.read()
        H.check("distopt.record: rank 1's hyperparameters differ from rank 0's at step 4: group 0 lr = "
                in said and said.count("\n") == 1, f"rank {r} warned once, naming rank 1's lr at step 4: {said!r}")
    with open(os.path.join(bad, "index.json")) as f:
        dis = json.load(f)["hparam_disagreement"]
    H.check((dis["step"], dis["rank"], dis["group"], dis["key"]) == (4, 1, 0, "lr") and dis["value"] > dis["rank0_value"],
            f"the index keeps the first disagreement: {dis}")
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["rank"], v["tensor"]) == ("hparams", 4, 1, "lr"),
            f"stage 1's lagging schedule named at step 4 on rank 1 by its lr: {v}")
    H.check("verdict: DIVERGED at step 4 (hyperparameters: rank 1's lr of group 0 is " in out, out[-300:])
    # without the disagreement in the index, the values name the same step and rank
    with open(os.path.join(bad, "index.json")) as f:
        ix = json.load(f)
    del ix["hparam_disagreement"]
    with open(os.path.join(bad, "index.json"), "w") as f:
        json.dump(ix, f)
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["rank"]) == ("diverged", 4, 1) and owner.get(v["tensor"].split("/")[0]) == 1,
            f"the lagging schedule's values diverge at step 4 on rank 1: {v}")
    # record refuses, in one line: a stage outside stages=, a pipelined layout with a piece that names no stage,
    # and a layout that changes mid-recording (a parameter resharded after step 1)
    from distopt.record import _total, record
    one = lambda st: {"rank": 1, "pieces": [{"param": "b"} if st is None else {"param": "b", "stage": st}]}  # noqa: E731
    first = {"rank": 0, "pieces": [{"param": "a", "stage": 0}]}
    for parts, want in (([first, one(2)], "distopt.record: layout of b on rank 1: stage 2 is outside [0, 2) (stages=2)"),
                        ([first, one(None)], "distopt.record: rank 1's piece of b names no stage but rank 0's piece "
                                             "of a is on stage 0")):
        try:
            _total(parts, "stage", "stages", 2, every_piece=True)
            H.check(False, f"refused: {want}")
        except ValueError as e:
            H.check(str(e).startswith(want) and "\n" not in str(e), f"one line: {e}")
    w = torch.nn.Parameter(torch.ones(4, 3))
    opt = torch.optim.AdamW([w], lr=1e-3)
    try:
        with record(opt, os.path.join(d, "resharded.rec"), names={"w": w}):
            w.grad = torch.ones(4, 3)
            opt.step()
            w.data, w.grad = torch.ones(2, 3), torch.ones(2, 3)
            opt.step()
        H.check(False, "a resharded parameter refused")
    except ValueError as e:
        H.check(str(e).startswith("distopt.record: step 2: the local tensor of w has shape [2, 3], [4, 3] when the "
                                  "recording began"), f"a layout change named at its step: {e}")


def case_moe():
    """Expert parallelism (a top-1 MoE block, 4 experts over 2 gloo ranks, dense layers data-parallel) with an
    expert-parallel Adafactor, recorded with expert ids (separate expert tensors) and a dim-0 block of the expert
    stack: exit 0, every expert tensor on its rank with its id. The stack's RMS over the local experts only:
    exit 1 at step 1 naming experts.w2. Dense gradients not averaged over the ranks: the values verify (each
    rank's arithmetic is right on its own gradient) but the gradient digests name router or w0 at step 1."""
    d = H.work_dir("moe")
    good = os.path.join(d, "moe.rec")
    H.launch(H.moe_worker, 2, good, 8, None)
    with open(os.path.join(good, "index.json")) as f:
        H.check(json.load(f)["experts"] == 4, "the index says 4 experts")
    out, rep = H.run_verify(good, expect=0)
    experts = {(t["param"], t["rank"]): t.get("expert") for t in rep["tensors"] if t["state"] is None}
    H.check(all(experts.get((f"experts.{e}.w1", e // 2)) == e for e in range(4)), f"each expert on its rank ({experts})")
    H.check(experts.get(("router", 0)) is None and ("router", 1) in experts, "the dense router on both ranks, no expert")
    H.check({r for (p, r) in experts if p == "experts.w2"} == {0, 1}, "the stack's blocks on both ranks")
    summary(rep)
    bad = os.path.join(d, "moe_local_rms.rec")
    H.launch(H.moe_worker, 2, bad, 8, "local_rms")
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 1 and v["tensor"].split("/")[0] == "experts.w2", f"the stack's local RMS named at step 1: {v}")
    bad = os.path.join(d, "moe_unsynced.rec")
    H.launch(H.moe_worker, 2, bad, 4, "unsynced")
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"], v["rank"]) == ("gradients", 1, 1) and v["tensor"] in ("w0", "router"),
            f"dense gradients not averaged named at step 1 on rank 1: {v}")


# What torch >= 2's compute_local_shape_and_global_offset reports for a DTensor, transcribed (torch 1.13 has no
# DTensor: this table is the test's only contact with it). (global shape, mesh shape, placements, {coordinate:
# (local shape, global offset)}). Shard(d) cuts as torch.chunk (chunks of ceil(n/k)); an empty chunk's offset is
# the dimension's size.
DTENSOR_CASES = [
    ([10, 4], [4], ["S(0)"], {(0,): ([3, 4], [0, 0]), (1,): ([3, 4], [3, 0]), (2,): ([3, 4], [6, 0]),
                              (3,): ([1, 4], [9, 0])}),
    ([5, 3], [4], ["Shard(0)"], {(0,): ([2, 3], [0, 0]), (1,): ([2, 3], [2, 0]), (2,): ([1, 3], [4, 0]),
                                 (3,): ([0, 3], [5, 0])}),
    # FSDP2 over dp (dim 0) of a row-parallel weight (TP Shard(1)): a 2-D mesh (dp 2, tp 2)
    ([6, 8], [2, 2], ["S(0)", "S(1)"], {(i, j): ([3, 4], [3 * i, 4 * j]) for i in range(2) for j in range(2)}),
    # two mesh dimensions sharding dimension 0 (nested chunks)
    ([8, 6], [2, 2], ["S(0)", "S(0)"], {(i, j): ([2, 6], [4 * i + 2 * j, 0]) for i in range(2) for j in range(2)}),
    ([4, 6], [2, 3], ["R", "S(1)"], {(i, j): ([4, 2], [0, 2 * j]) for i in range(2) for j in range(3)}),
    ([3, 4, 5], [2], ["S(2)"], {(0,): ([3, 4, 3], [0, 0, 0]), (1,): ([3, 4, 2], [0, 0, 3])}),
    ([7, 2, 5], [3, 2], ["S(0)", "S(-1)"], {(i, j): ([3 if i < 2 else 1, 2, 3 if j == 0 else 2],
                                                   [3 * i, 0, 3 * j]) for i in range(3) for j in range(2)}),
    # the 2-D recipe (ColwiseParallel over tp, then fully_shard over dp): the tp chunk, then its dp sub-chunk
    ([8, 8], [2, 2], ["_S(0, 2)", "S(0)"], {(i, j): ([2, 8], [4 * j + 2 * i, 0]) for i in range(2) for j in range(2)}),
    ([7, 3], [2, 2], ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
     {(0, 0): ([2, 3], [0, 0]), (0, 1): ([2, 3], [4, 0]), (1, 0): ([2, 3], [2, 0]), (1, 1): ([1, 3], [6, 0])}),
]


def case_dtensor():
    """distopt.dtensor_layout against the transcribed DTensor metadata: for every case and coordinate the
    piece's elements are exactly the box [offset, offset + local shape) of the global tensor, in the local
    tensor's order; the pieces of all coordinates cover the tensor (record's rule); refusals are one line."""
    from distopt import dtensor_layout
    from distopt.record import _check_cover, _layout_piece
    from distopt.replay import _piece_index
    for shape, mesh, places, want in DTENSOR_CASES:
        glob = torch.arange(math.prod(shape)).reshape(shape)
        parts = []
        for coord, (lshape, off) in want.items():
            spec = dtensor_layout("w", shape, mesh, places, coord)
            box = glob[tuple(slice(o, o + n) for o, n in zip(off, lshape))].reshape(-1)
            if box.numel() == 0:
                H.check(spec is None, f"{shape} {places} {coord}: an empty chunk holds no piece ({spec})")
                continue
            lp, _ = _layout_piece(shape, spec.get("block"), spec.get("lo", 0), box.numel())
            idx = _piece_index(shape, lp.lo, lp.len, spec.get("block"))
            H.check(torch.equal(glob.reshape(-1)[idx], box), f"{shape} {places} {coord}: {spec} is the box {off} "
                    f"{lshape}")
            parts.append({"rank": len(parts), "pieces": [{"param": "w", "lo": lp.lo, "len": lp.len,
                                                          "block": spec.get("block")}]})
        _check_cover([{"name": "w", "shape": shape}], parts)
    for places, shape, needle in ((["S(1)", "S(2)"], [2, 4, 6], "dimensions [1, 2] are split"),
                                  (["P", "R"], [4, 4], "is a partial sum, not a layout"),
                                  (["_S(0, 2)", "R"], [8, 4], "not one contiguous range")):
        try:
            dtensor_layout("w", shape, [2, 2], places, (1, 1))
            H.check(False, f"{places} refused")
        except ValueError as e:
            H.check(needle in str(e) and "\n" not in str(e), f"{places} refused in one line: {e}")


def _need_fsdp2():
    """Exit 77 (skipped, with the reason) where this torch has no DTensor or FSDP2 (torch 1.13)."""
    import importlib
    try:
        importlib.import_module("torch.distributed.tensor")
        getattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard")
    except Exception as e:  # noqa: BLE001
        print(f"skipped: torch {torch.__version__} at {sys.executable} has no DTensor/FSDP2 ({type(e).__name__}: {e});"
              f" cmake/torch2.sh installs torch 2 where the CUDA 13 runtime is (docs/python.md)")
        sys.exit(77)


def case_dtensor_torch2():
    """torch >= 2 (skipped, 77, with the reason on torch 1.13): one job of 4 gloo ranks (tests/verify/torch2.py):
    dtensor_layout held against the local tensors torch places for every mesh, shape and placements of the sweep
    (uneven and empty shards, _StridedShard) and against compute_local_shape_and_global_offset; FSDP2 + AdamW
    (default, foreach, fused; a layer with 3 rows: an empty shard on rank 3) and the 2-D recipe (ColwiseParallel,
    RowwiseParallel, then fully_shard over dp) recorded with distopt.record unchanged: each verifies (exit 0)."""
    _need_fsdp2()
    import torch2
    d = H.work_dir("dtensor_torch2")
    H.launch(torch2.worker, 4, d)
    results = []
    for r in range(4):
        with open(os.path.join(d, f"result{r}.json")) as f:
            results.append(json.load(f))
    for r, res in enumerate(results):
        for line in res["fails"][:5]:
            print(f"rank {r}: {line}")
    H.check(not any(res["fails"] for res in results), "every rank's layouts and recordings as expected")
    H.check(all(res["layout_cases"] >= 400 for res in results), f"cases per rank {[r['layout_cases'] for r in results]}")
    H.check(all(res["strided_cases"] >= 60 for res in results), f"strided cases {[r['strided_cases'] for r in results]}")
    print(f"layouts: {results[0]['layout_cases']} (mesh, shape, placements) cases per rank ({results[0]['strided_cases']} "
          f"with _StridedShard), each rank's local tensor the piece's elements")
    strided = results[0]["placements_2d"]["up.weight"]
    H.check(strided[0].startswith("_S(0"), f"the 2-D recipe's column-parallel weight is strided: {strided}")
    H.check([r["empty_entries"] for r in results] == [0, 0, 0, 4], f"rank 3's empty shards (b.weight, b.bias, "
            f"c.weight, c.bias) are None entries ({[r['empty_entries'] for r in results]})")
    msgs = {r["refusal"] for r in results}
    H.check(len(msgs) == 1 and "layout= has no entry" in next(iter(msgs)) and "(rank 3;" in next(iter(msgs)),
            f"a layout= refused on rank 3 only: every rank raises the same line ({msgs})")
    print(f"refused on every rank alike: {next(iter(msgs))}")
    H.check(results[0]["mixed"] == ["DTensor"] * 4 + ["Parameter"] * 2, f"DTensors and plain: {results[0]['mixed']}")
    H.check("Partial" in results[0]["partial"], f"the gradient given was Partial: {results[0]['partial']}")
    # schema 5's digests (written once verify reads them): every piece digested; ranks holding the same piece
    # (the tp pair of one dp rank: norm, down.bias) equal, different pieces (the strided up.weight) not
    ag = [r["agree"] for r in results]
    H.check(all(a["grad_agree"] for a in ag), "grad_agree on with piece digests")
    same = diff = 0
    for name in ag[0]["pieces"]:
        for r1 in range(4):
            for r2 in range(r1 + 1, 4):
                a, b = ag[r1]["pieces"].get(name), ag[r2]["pieces"].get(name)
                if a is None or b is None:
                    continue
                H.check(a[3] is not None and b[3] is not None, f"{name}: every piece digested ({a}, {b})")
                if a[:3] == b[:3]:
                    same += 1
                    H.check(a[3] == b[3], f"{name}: ranks {r1} and {r2} hold the same piece, equal digests")
                else:
                    diff += 1
                    H.check(a[3] != b[3], f"{name}: ranks {r1} and {r2} hold different pieces, different digests")
    H.check(same >= 4 and diff >= 4, f"replica pairs {same}, distinct pairs {diff}")
    print(f"schema 5 piece digests: {same} rank pairs holding the same piece agree, {diff} holding different ones "
          f"differ")
    H.check(results[0]["hsdp"] == ["R", "S(0)"], f"HSDP's placements: {results[0]['hsdp']}")
    H.check("Partial" in results[0]["experts"][1], f"the router's gradient came Partial: {results[0]['experts']}")
    for tag in ("fsdp2_default", "fsdp2_foreach", "fsdp2_fused", "tp_fsdp2", "fsdp2_layout", "fsdp2_mixed", "partial",
                "hsdp", "experts"):
        out, rep = H.run_verify(os.path.join(d, f"{tag}.rec"), expect=0)
        ranks = {t["rank"] for t in rep["tensors"]}
        H.check(ranks == {0, 1, 2, 3}, f"{tag}: every rank's pieces compared ({sorted(ranks)})")
        summary(rep)
    # planted: rank 3's gradients from step 2 not those of its replica (rank 1, the same shard): named at step 2
    out, rep = H.run_verify(os.path.join(d, "hsdp_planted.rec"), expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 2 and v["rank"] == 3, f"HSDP replica rank 3's unreduced gradient named at step 2: {v}")
    # a 2-stage pipeline (torch.distributed.pipelining) x FSDP2 over dp
    out, rep = H.run_verify(os.path.join(d, "pipeline.rec"), expect=0)
    H.check({t["rank"] for t in rep["tensors"]} == {0, 1, 2, 3} and {t.get("stage") for t in rep["tensors"]} == {0, 1},
            "pipeline: every rank's pieces compared, both stages")
    summary(rep)
    # Muon by hand on FSDP2 shards against torch.optim.Muon itself (distopt.replay): the same torch operations on
    # the same values, so bitwise (replay's default: exact; every tensor's max ULP must be 0);
    # the rows taken at rank x local rows are wrong where a short shard precedes nothing but ends the tensor:
    # rank 3's row of 0.weight ([10, 12]: 3, 3, 3, 1) and rank 2's of 4.weight ([5, 6]: 2, 2, 1, 0), at step 1
    from distopt.replay import replay
    for stepwise in (False, True):
        res = replay(os.path.join(d, "muon_0.rec"), torch2.make_muon, stepwise=stepwise)  # exact by default
        H.check(res.ok, f"Muon on FSDP2 shards replays as torch.optim.Muon (stepwise={stepwise}): {res!r} {res.stderr}")
        ulp = max(t["max_ulp"] for t in res.report["tensors"])
        H.check(ulp == 0 and {t["rank"] for t in res.report["tensors"]} == {0, 1, 2, 3},
                f"bitwise, every rank (max ULP {ulp})")
        H.check({t["state"] for t in res.report["tensors"]} == {None, "momentum_buffer"}, "parameters and momentum")
        bad = replay(os.path.join(d, "muon_1.rec"), torch2.make_muon, stepwise=stepwise)
        at1 = sorted((t["param"], t["rank"]) for t in bad.report["tensors"] if t["first_beyond"] == 1)
        H.check(bad.diverged and bad.verdict["step"] == 1 and at1 == [("0.weight", 3), ("4.weight", 2)],
                f"Muon rows at the wrong offset named at step 1 on the short shards' ranks: {bad!r}, at step 1 {at1}")
    print(f"Muon on FSDP2 shards: bitwise with torch.optim.Muon over 20 steps (both modes); wrong offset: "
          f"{bad.verdict}")
    # the same recordings against distopt's muon (flavor torch), declared bounds (no --rtol), both modes: the
    # correct one within them on every rank, the wrong offset named at step 1 on the short shards' ranks
    for mode in ((), ("--stepwise",)):
        out, rep = H.run_verify(os.path.join(d, "muon_0.rec"), *mode, expect=0)
        H.check({t["rank"] for t in rep["tensors"]} == {0, 1, 2, 3} and rep["tolerance"]["update"] > 0,
                f"Muon on FSDP2 shards within the declared bounds {mode}: {rep['tolerance']}")
        summary(rep)
        out, rep = H.run_verify(os.path.join(d, "muon_1.rec"), *mode, expect=1)
        at1 = sorted((t["param"], t["rank"]) for t in rep["tensors"] if t["first_beyond"] == 1)
        H.check(rep["verdict"]["step"] == 1 and at1 == [("0.weight", 3), ("4.weight", 2)],
                f"the wrong offset named at step 1 under the declared bounds {mode}: {rep['verdict']}, {at1}")
    # torch.optim.Muon recorded by its class (one process): distopt's muon with flavor torch (torch's addmm-form
    # bf16 Newton-Schulz), 20 steps, both modes under the declared bounds (no --rtol): the parameters within
    # 1e-6 plus 2^-1 of the steps' updates, the momentum (declared exact) bitwise at every step; the momentum
    # corrupted by one part in 1e4 of one element after step 8 is named at step 9 in both modes
    from distopt.record import record
    for corrupt in (False, True):
        H.seeded()
        tm = torch2.muon_model()
        topt = torch.optim.Muon(tm.parameters(), lr=0.02, weight_decay=0.1)
        trec = os.path.join(d, f"torch_muon_{int(corrupt)}.rec")
        with record(topt, trec, names=tm, flush_every=10):
            for t in range(1, 21):
                H.train_step(tm, topt, t)
                if corrupt and t == 8:
                    with torch.no_grad():
                        topt.state[tm[2].weight]["momentum_buffer"][1, 3] *= 1.0001
        for mode in ((), ("--stepwise",)):
            out, rep = H.run_verify(trec, *mode, expect=int(corrupt))
            if corrupt:
                v = rep["verdict"]
                H.check(v["step"] == 9 and v["tensor"] == "2.weight/momentum_buffer",
                        f"the corrupted momentum named at step 9 {mode}: {v}")
                continue
            H.check(rep["optimizer"] == "muon" and rep["upstream"] == "torch.optim.Muon" and
                    "flavor=torch" in rep["hparams"][0], f"torch.optim.Muon recorded by class: {rep['hparams']}")
            moms = [t for t in rep["tensors"] if t["state"] == "momentum_buffer"]
            H.check(len(moms) == 3 and all(t["max_ulp"] == 0 and t["compared"] for t in moms),
                    f"the momentum exact at every step: {[(t['name'], t['max_ulp']) for t in moms]}")
            worst = max(t['max_rel'] for t in rep['tensors'] if t['state'] is None)
            # the flavour's arithmetic, not only the bound: muon-optimizer's separate-operations form is 5.1e-3
            # off here per step, torch's addmm form 2.2e-4 (accumulation order only)
            H.check(worst < 2e-3, f"torch.optim.Muon {mode}: parameters within {worst:.3g} (flavor torch's form)")
            print(f"torch.optim.Muon {mode or '(accumulated)'}: parameters within {worst:.3g}, the momentum bitwise")
    # torch.optim.Muon's other settings mapped and computed: ns_coefficients, its eps, spectral_unclamped and
    # match_rms_adamw (10 steps each, declared bounds); an lr rule mapped wrongly would be off by sqrt(A/B)
    for fn in ("spectral_unclamped", "match_rms_adamw"):
        H.seeded()
        tm = torch2.muon_model()
        topt = torch.optim.Muon(tm.parameters(), lr=0.01, weight_decay=0.05, ns_coefficients=(3.0, -3.2, 1.2),
                                eps=1e-6, ns_steps=4, adjust_lr_fn=fn, nesterov=False)
        trec = os.path.join(d, f"torch_muon_{fn}.rec")
        with record(topt, trec, names=tm, flush_every=10):
            for t in range(1, 11):
                H.train_step(tm, topt, t)
        out, rep = H.run_verify(trec, "--stepwise", expect=0)
        hp = rep["hparams"][0]
        H.check(all(k in hp for k in ("ns_a=3.0", "ns_b=-3.2", "ns_c=1.2", "ns_eps=1e-06", "ns_steps=4",
                                      f"adjust_lr_fn={fn}", "nesterov=false")), f"torch.optim.Muon's keys: {hp}")
        worst = max(t['max_rel'] for t in rep['tensors'] if t['state'] is None)
        H.check(worst < 2e-3, f"torch.optim.Muon {fn}: parameters within {worst:.3g}")
        print(f"torch.optim.Muon ns_coefficients (3.0, -3.2, 1.2), eps 1e-6, {fn}: parameters within {worst:.3g}")
    # LAMB by hand on FSDP2 shards: trust ratios over the whole parameter; over the local shard named at step 1
    out, rep = H.run_verify(os.path.join(d, "lamb_0.rec"), expect=0)
    summary(rep)
    out, rep = H.run_verify(os.path.join(d, "lamb_1.rec"), expect=1)
    H.check(rep["verdict"]["step"] == 1, f"LAMB's shard-local trust ratio named at step 1: {rep['verdict']}")
    # resumed on another layout (FSDP2 over 4 -> HSDP 2 x 2): the window alone is consistent either way; against
    # the recording it continues, every value it starts from must be bitwise that one's
    for bad in (0, 1):
        a, b = os.path.join(d, f"reshard_{bad}_a.rec"), os.path.join(d, f"reshard_{bad}_b.rec")
        H.run_verify(a, expect=0)
        H.run_verify(b, expect=0)
        out, rep = H.run_verify(b, "--continues", a, expect=bad)
        cont, v = rep["continues"], rep["verdict"]
        # Two's 183 elements x 3 values (the parameter, exp_avg, exp_avg_sq) x 2 replicas, and the 4 ranks' step
        # counts of their 6 pieces: every value the window starts from
        H.check(cont["step"] == 3 and cont["compared"] == 183 * 3 * 2 + 4 * 6 and cont["equal"] == (not bad),
                f"--continues compared the window's start: {cont}")
        if bad:
            H.check(v["kind"] == "resume" and v["step"] == 3 and v["tensor"].endswith("/exp_avg_sq"),
                    f"the state resharded in the wrong order named at the window's start: {v}")
            print(f"resharded wrongly: {v}")


def case_fsdp():
    """FSDP-style flat parameters: one padded flat buffer, a contiguous shard per rank spanning tensors, a
    hand-written LAMB with per-tensor trust ratios on 2 gloo ranks: exit 0; its norms over the local shard only
    (the bug): exit 1 at step 1 naming a tensor the shards split."""
    d = H.work_dir("fsdp")
    good = os.path.join(d, "fsdp.rec")
    H.launch(H.fsdp_worker, 2, good, 8, False)
    out, rep = H.run_verify(good, expect=0)
    ranks = {t["param"]: sorted({u["rank"] for u in rep["tensors"] if u["param"] == t["param"]}) for t in rep["tensors"]}
    H.check(any(r == [0, 1] for r in ranks.values()), f"a tensor split over both ranks' shards ({ranks})")
    summary(rep)
    bad = os.path.join(d, "fsdp_local_norms.rec")
    H.launch(H.fsdp_worker, 2, bad, 8, True)
    out, rep = H.run_verify(bad, expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 1 and ranks.get(v["tensor"].split("/")[0]) == [0, 1],
            f"the shard-local trust ratio named at step 1 on a split tensor: {v}")


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


def case_replay():
    """distopt.replay: a custom optimizer distopt does not implement (harness.NormalizedMomentum), sharded by hand
    on 2 gloo ranks and recorded as it is, replayed through its own single-device version. Tolerance 1e-5: the
    shards' sums of squares reach the rms state through an all_reduce of two fp32 partial sums where the single
    device sums 48 (or 8) squares at once; an fp32 sum of n terms is within (n-1)·u of the exact one, 47·2^-24 =
    2.8e-6 relative, halved by the square root; the momentum is elementwise (the same operations, bitwise) and
    the update divides by rms: 1.4e-6 relative to one update, < 1e-6 of the parameter. Margin 3.6 on the rms."""
    from distopt.record import verify
    from distopt.replay import replay
    d = H.work_dir("replay")
    good, bad = os.path.join(d, "good.rec"), os.path.join(d, "local.rec")
    H.launch(H.normalized_worker, 2, good, 12, None)
    H.launch(H.normalized_worker, 2, bad, 12, 5)
    with open(os.path.join(good, "index.json")) as f:
        index = json.load(f)
    H.check(index["optimizer"]["name"] is None and index["schema_version"] == 6, "an unknown class is recorded as is")
    res = verify(good)
    H.check(res.returncode == 2 and "optimizer.name is null" in res.stderr, f"verify without a reference: {res!r}")
    for stepwise in (False, True):
        res = replay(good, H.make_normalized, stepwise=stepwise, rtol=1e-5)
        print(res.stdout)
        H.check(res.ok, f"the correct sharding replays within tolerance (stepwise={stepwise}): {res!r} {res.stderr}")
        H.check(res.report["mode"] == ("stepwise" if stepwise else "accumulated") and
                res.report["reference"] == "recording", "the JSON names the mode and the reference")
        keys = {t["state"] for t in res.report["tensors"]}
        H.check({"momentum_buffer", "rms", "step"} <= keys, f"its states compared by their own names ({keys})")
        H.check(sorted(H.tensors_by_rank(res.report)) == [0, 1], "both ranks' pieces compared")
        summary(res.report)
    for stepwise in (False, True):
        res = replay(bad, H.make_normalized, stepwise=stepwise, rtol=1e-5)
        print(res.stdout)
        v = res.verdict
        H.check(res.diverged and (v["step"], v["tensor"]) == (5, "w/rms"),
                f"the shard-local statistic planted at step 5 is named at step 5 (stepwise={stepwise}): {v}")
    # a reference that is not of the same computation is refused (exit 2, one line): another optimizer, other
    # hyperparameters, a transposed shape (the same element count: values alone would be compared)
    import shutil
    wref = os.path.join(d, "ref_work")
    os.makedirs(wref)
    res = replay(good, H.make_normalized, rtol=1e-5, work=wref)
    H.check(res.ok, f"the reference kept in work=: {res!r}")
    src = os.path.join(wref, "reference.rec")

    def tampered(tag, fn):
        dst = os.path.join(d, f"ref_{tag}.rec")
        shutil.copytree(src, dst)
        with open(os.path.join(dst, "index.json")) as f:
            ix = json.load(f)
        fn(ix)
        with open(os.path.join(dst, "index.json"), "w") as f:
            json.dump(ix, f)
        return dst

    def set_name(ix):
        ix["optimizer"]["name"] = "adamw"

    def set_hp(ix):
        ix["groups"][0]["hparams"] = "lr=0.5"

    def transpose(ix):
        ix["params"][0]["shape"] = ix["params"][0]["shape"][::-1]

    for tag, fn, needle in (("name", set_name, "optimizer 'adamw', the recording's is 'null'"),
                            ("hparams", set_hp, "group 0's hyperparameters 'lr=0.5'"),
                            ("shape", transpose, f"parameter 'w' is [{H.COLS},{H.ROWS}] in group 0, the recording's "
                                                 f"[{H.ROWS},{H.COLS}]")):
        p = subprocess.run([H.cli(), "verify", good, "--rtol", "1e-5", "--reference", tampered(tag, fn)],
                           capture_output=True, text=True)
        H.check(p.returncode == 2 and needle in p.stderr and p.stderr.count("\n") == 1,
                f"a reference with another {tag} refused: {p.returncode} {p.stderr}")
    # the command-line form (Python: python3 -m distopt.replay)
    p = subprocess.run([sys.executable, "-m", "distopt.replay", bad, "harness:make_normalized", "--stepwise",
                        "--rtol", "1e-5"], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    print(p.stdout[-400:], p.stderr[-400:])
    H.check(p.returncode == 1 and "DIVERGED at step 5 (tensor w/rms, rank 0" in p.stdout, "python3 -m distopt.replay")
    H.check("Warning" not in p.stderr, f"python3 -m distopt.replay warns: {p.stderr[-300:]}")  # runpy's, once


def _adamw_bug_at(params, bug_at, **kw):
    """torch AdamW whose step, at step bug_at, applies the weight decay twice: a one-step bug that param_groups do
    not show (the class stays torch.optim.AdamW, so record() maps it; record() wraps the step it finds)."""
    opt = torch.optim.AdamW(params, **kw)
    inner, count = opt.step, [0]

    def step(closure=None):
        out = inner(closure)
        count[0] += 1
        if count[0] == bug_at:
            with torch.no_grad():
                for g in opt.param_groups:
                    for p in g["params"]:
                        p.mul_(1 - g["lr"] * g["weight_decay"])
        return out

    opt.step = step
    return opt


def _small_model():
    torch.manual_seed(H.SEED)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))  # 808 parameters


def _train(model, opt, steps, first=1):
    for t in range(first, first + steps):
        g = torch.Generator().manual_seed(H.SEED + t)
        x, y = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def case_stepwise():
    """--stepwise on a 3 000-step torch AdamW recording (808 parameters): within the per-step tolerance; a bug at
    step 2 500 named at 2 500. Also: a window (start_step), bf16 gradients, digest-only steps."""
    import time
    from distopt.record import record
    d = H.work_dir("stepwise")
    H.seeded()
    traces = {}
    for tag, bug in (("clean", None), ("bug2500", 2500)):
        model = _small_model()
        opt = _adamw_bug_at(model.parameters(), bug, lr=1e-3, weight_decay=0.1)
        traces[tag] = os.path.join(d, tag + ".rec")
        t0 = time.time()
        with record(opt, traces[tag], names=model, flush_every=100):
            _train(model, opt, 3000)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(traces[tag]) for f in fs)
        print(f"recorded {tag}: 3000 steps in {time.time() - t0:.1f} s, {size / 1e6:.1f} MB")
        H.check(size <= 100e6, f"the recording is {size / 1e6:.1f} MB (<= 100 MB)")
    t0 = time.time()
    out, rep = H.run_verify(traces["clean"], "--stepwise", "--quiet", expect=0)
    print(f"verify --stepwise: {time.time() - t0:.1f} s")
    H.check(rep["mode"] == "stepwise" and rep["tolerance"]["source"] == "declared per step", "per-step tolerance")
    w = summary(rep)
    H.check(0 < w["params"] < 1e-6 and w["states"] < 1e-6, "one step's rounding: nonzero, within the bound")
    # the accumulated mode on the same run (measured, not asserted: it grows with the steps, docs/verify.md)
    p = subprocess.run([H.cli(), "verify", traces["clean"], "--quiet"], capture_output=True, text=True)
    print("accumulated:", p.stdout.strip(), f"(exit {p.returncode})")
    out, rep = H.run_verify(traces["bug2500"], "--stepwise", "--quiet", expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 2500, f"the bug at step 2500 is named at 2500: {v}")
    H.check(all(t["first_beyond"] in (None, 2500) for t in rep["tensors"]) and
            all(r <= 1e-6 for t in rep["tensors"] for s, r in zip(t["steps"], t["rel_per_step"]) if s > 2500),
            "steps after the bug start from the recorded state again: within tolerance")
    # a window: 30 steps recorded after 20 unrecorded ones, its start states recorded first
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, opt, 20)
    win = os.path.join(d, "window.rec")
    with record(opt, win, names=model, start_step=20, flush_every=8):
        _train(model, opt, 30, first=21)
    for extra in ([], ["--stepwise"]):
        out, rep = H.run_verify(win, *extra, expect=0)
        H.check(rep["start_step"] == 20 and rep["tensors"][0]["steps"][0] == 21, "the window starts at step 21")
        H.check("window: steps 21..50" in out, "the table names the window")
    # the same window replayed through torch's own AdamW (distopt.replay loads its start states into it)
    from distopt.replay import replay
    for stepwise in (False, True):
        res = replay(win, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1), stepwise=stepwise)
        H.check(res.ok and res.report["start_step"] == 20, f"replay of a window (stepwise={stepwise}): {res!r} "
                f"{res.stderr}")
        summary(res.report)
    # bf16 gradients: lossy, so the declared tolerance does not apply (exit 2 without --rtol)
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    bf = os.path.join(d, "bf16.rec")
    with record(opt, bf, names=model, grads="bf16", flush_every=8):
        _train(model, opt, 20)
    H.run_verify(bf, expect=2)
    out, rep = H.run_verify(bf, "--stepwise", "--rtol", "0.05", expect=0)
    summary(rep)
    # digests: only every 4th step's gradient kept; the accumulated replay refuses, --stepwise skips the others
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    dg = os.path.join(d, "digest.rec")
    with record(opt, dg, names=model, grad_steps=lambda t: t % 4 == 0, flush_every=8):
        _train(model, opt, 20)
    H.run_verify(dg, expect=2)
    out, rep = H.run_verify(dg, "--stepwise", expect=0)
    H.check(rep["not_replayed"] == 15 and rep["tensors"][0]["steps"] == [4, 8, 12, 16, 20], "digest steps skipped")


class _CAMEStandIn(__import__("distopt").Optimizer):
    """distopt's CAME under came_pytorch's class name and constructor: record() maps it as the real class."""

    def __init__(self, params, lr=None, eps=(1e-30, 1e-16), clip_threshold=1.0, betas=(0.9, 0.999, 0.9999),
                 weight_decay=0.0):
        super().__init__("came", params, lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas,
                         weight_decay=weight_decay)


class _LambStandIn(__import__("distopt").Optimizer):
    """distopt's LAMB under torch_optimizer's class name, its debias, adam and clamp_value attributes (not group
    keys, as torch_optimizer keeps them) and its groups without bias_correction and adam."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, clamp_value=10,
                 adam=False, debias=False):
        super().__init__("lamb", params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam=adam,
                         bias_correction=debias)
        self.clamp_value, self.adam, self.debias = clamp_value, adam, debias
        for g in self.param_groups:
            g.pop("bias_correction", None)
            g.pop("adam", None)


class _MuonStandIn(__import__("distopt").Optimizer):
    """distopt's Muon under muon-optimizer's SingleDeviceMuonWithAuxAdam: upstream's group dicts (use_muon a bool
    per group, betas for the aux Adam)."""

    def __init__(self, param_groups):
        super().__init__("muon", param_groups)


class _DistLambStandIn(__import__("distopt").Optimizer):
    """distopt's LAMB under ColossalAI 0.5.0's DistributedLamb: its constructor (eps 1e-6, bias_correction True by
    default, a group key) and its groups without an adam key (it has no adam mode)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0, bias_correction=True):
        super().__init__("lamb", params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam=False)
        for g in self.param_groups:
            g.pop("adam", None)


class _DistCAMEStandIn(_CAMEStandIn):
    """distopt's CAME under ColossalAI's DistributedCAME (came_pytorch's constructor)."""


class _TorchAdafactor(torch.optim.Optimizer):
    """transformers' Adafactor written in torch (relative step, factored second moment, update clipping), and with
    colossal=True ColossalAI 0.5.0's (Distributed)AdaFactor: its state RMS an int 0 never updated, so the relative
    step's parameter scale is eps[1]."""
    colossal = False

    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                 weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False):
        super().__init__(params, dict(lr=lr, eps=eps, clip_threshold=clip_threshold, decay_rate=decay_rate,
                                      beta1=beta1, weight_decay=weight_decay, scale_parameter=scale_parameter,
                                      relative_step=relative_step, warmup_init=warmup_init))

    @staticmethod
    def _rms(t):
        return t.norm(2) / (t.numel() ** 0.5)

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad, st = p.grad, self.state[p]
                factored = grad.dim() >= 2
                if not st:
                    st["step"] = 0
                    if factored:
                        st["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1])
                        st["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:])
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(grad)
                    st["RMS"] = 0
                st["step"] += 1
                if not self.colossal:
                    st["RMS"] = self._rms(p)
                lr = max(g["eps"][1], st["RMS"]) * min(1e-2, 1.0 / math.sqrt(st["step"]))
                beta2t = 1.0 - math.pow(st["step"], g["decay_rate"])
                update = grad ** 2 + g["eps"][0]
                if factored:
                    row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                    update = torch.mul(r, col.unsqueeze(-2).rsqrt()).mul_(grad)
                else:
                    v = st["exp_avg_sq"]
                    v.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = v.rsqrt().mul_(grad)
                update.div_((self._rms(update) / g["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                if g["weight_decay"] != 0:
                    p.add_(p, alpha=-g["weight_decay"] * lr)
                p.add_(-update)


class _HFAdafactorStandIn(_TorchAdafactor):
    pass


class _DistAdaFactorStandIn(_TorchAdafactor):
    colossal = True


_CAMEStandIn.__module__, _CAMEStandIn.__name__, _CAMEStandIn.__qualname__ = "came_pytorch.CAME", "CAME", "CAME"
for _cls, _mod, _nm in ((_DistLambStandIn, "colossalai.nn.optimizer.distributed_lamb", "DistributedLamb"),
                        (_DistCAMEStandIn, "colossalai.nn.optimizer.distributed_came", "DistributedCAME"),
                        (_HFAdafactorStandIn, "transformers.optimization", "Adafactor"),
                        (_DistAdaFactorStandIn, "colossalai.nn.optimizer.distributed_adafactor", "DistributedAdaFactor")):
    _cls.__module__, _cls.__name__, _cls.__qualname__ = _mod, _nm, _nm
_MuonStandIn.__module__ = "muon"
_MuonStandIn.__name__ = _MuonStandIn.__qualname__ = "SingleDeviceMuonWithAuxAdam"
_LambStandIn.__module__, _LambStandIn.__name__, _LambStandIn.__qualname__ = "torch_optimizer.lamb", "Lamb", "Lamb"


def _upstream_runs(d, classes, rtol=None, steps=12):
    """Records each (tag, make(model) -> optimizer) for `steps` steps with no name= and verifies it."""
    from distopt.record import record
    for tag, make, extra in classes:
        model = _small_model()
        opt = make(model)
        trace = os.path.join(d, tag + ".rec")
        with record(opt, trace, names=model, flush_every=5):
            _train(model, opt, steps)
        out, rep = H.run_verify(trace, *extra, expect=0)
        print(f"{tag}: recorded as {rep['optimizer']} from {rep['upstream']}")
        summary(rep)
        yield tag, rep


def galore_groups(model, cls, **kw):
    mats = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return cls([{"params": rest}, {"params": mats, "rank": 4, "update_proj_gap": 5, "scale": 0.25,
                                   "proj_type": "std"}], **kw)


def exact_momentum(good, bad):
    """Muon's momentum is declared exact (one fp32 lerp per element everywhere): a copy of a clean recording with
    one element of one momentum_buffer moved by one ULP after step 5 is named at step 5 even under --rtol 1e-2,
    and --rtol-param / --rtol-state judge each kind by its own bound."""
    from distopt._safetensors import read, read_torch, write
    shutil.copytree(good, bad)
    with open(os.path.join(bad, "index.json")) as f:
        index = json.load(f)
    done = False
    for e in index["ranks"][0]["files"]:
        path = os.path.join(bad, e["path"])
        tensors = read_torch(path)
        for name, x in tensors.items():
            if not done and name.startswith("state/5/") and name.endswith("/momentum_buffer"):
                flat = x.view(-1)
                k = int(flat.abs().argmax())
                flat[k] = torch.nextafter(flat[k], torch.tensor(math.inf))
                done = name
        write(path, tensors, read(path, ("kind", "rank", "first_step", "last_step"))[1])
    H.check(done, "a momentum_buffer at step 5 to move")
    out, rep = H.run_verify(bad, "--rtol", "1e-2", expect=1)
    v = rep["verdict"]
    H.check(v["step"] == 5 and v["tensor"].endswith("/momentum_buffer"), f"one ULP of momentum named at step 5: {v}")
    print(f"exact momentum: {done} one ULP off, named under --rtol 1e-2: {v}")
    out, rep = H.run_verify(good, "--rtol-param", "1e-6", "--rtol-state", "1e-5", expect=0)
    H.check((rep["tolerance"]["param"], rep["tolerance"]["state"]) == (1e-6, 1e-5), f"per kind: {rep['tolerance']}")
    # one kind given: the other keeps muon's declared bound, and the update allowance goes with the declared ones
    out, rep = H.run_verify(good, "--rtol-param", "1e-6", expect=0)
    H.check((rep["tolerance"]["param"], rep["tolerance"]["state"], rep["tolerance"]["update"]) == (1e-6, 1e-5, 0),
            f"--rtol-param alone: states by the declared bound, no update allowance: {rep['tolerance']}")


def case_upstream():
    """Upstream classes recorded with no hand-written names, through stand-ins written here (CI has none of the
    packages): came_pytorch.CAME, torch_optimizer.Lamb and muon's SingleDeviceMuonWithAuxAdam as distopt's own
    under the upstream names (error 0:
    the mapping of names, hyperparameters and states is what is tested), galore_torch's AdamW as a torch GaLore
    (its own SVD signs: the recorded projectors are checked and adopted), and a projector out of the gradient's
    subspace (named)."""
    d = H.work_dir("upstream")
    runs = [("came", lambda m: _CAMEStandIn(m.parameters(), lr=1e-3, weight_decay=0.01), []),
            ("lamb", lambda m: _LambStandIn(m.parameters(), lr=1e-2, weight_decay=0.01, debias=True), []),
            # muon: exact here (the stand-in is distopt's: error 0), not its declared bf16 bound
            ("muon", lambda m: _MuonStandIn(
                [dict(params=[q for q in m.parameters() if q.ndim >= 2], use_muon=True, lr=0.02, weight_decay=0.01),
                 dict(params=[q for q in m.parameters() if q.ndim < 2], use_muon=False, lr=3e-4, betas=(0.9, 0.95))]),
             ["--rtol", "1e-6"]),
            # galore_adamw has no declared tolerance; 1e-5: the golden bound of galore_adamw (docs/galore.md)
            ("galore", lambda m: galore_groups(m, H.GaLoreAdamWStandIn, lr=1e-3), ["--rtol", "1e-5"])]
    for tag, rep in _upstream_runs(d, runs):
        if tag in ("came", "lamb", "muon"):
            H.check(all(t["max_abs"] == 0 for t in rep["tensors"] if t["compared"]), f"{tag}: bitwise (error 0)")
            H.check(rep["upstream"].startswith({"came": "came_pytorch.", "lamb": "torch_optimizer.",
                                                "muon": "muon."}[tag]), f"{tag}: the upstream class is recorded")
            if tag == "muon":  # both kinds: momentum_buffer for the matrices, aux Adam's moments for the biases
                keys = {t["state"] for t in rep["tensors"] if t["compared"]}
                H.check({"momentum_buffer", "exp_avg", "exp_avg_sq"} <= keys, f"muon: the states of both kinds {keys}")
                H.check(rep["tolerance"]["exact_states"] == ["momentum_buffer"], f"muon's exact states declared: "
                        f"{rep['tolerance']}")
                exact_momentum(os.path.join(d, "muon.rec"), os.path.join(d, "muon_momentum_ulp.rec"))
        else:
            H.check(rep["optimizer"] == "galore_adamw" and rep["projectors_adopted"] >= 6,
                    f"galore: projectors adopted ({rep['projectors_adopted']})")
            # an optimizer with no declared bound and one kind given: the other kind is refused, naming the option
            p = subprocess.run([H.cli(), "verify", os.path.join(d, "galore.rec"), "--rtol-param", "1e-5"],
                               capture_output=True, text=True)
            H.check(p.returncode == 2 and "no declared tolerance for states (give --rtol-state or --rtol)" in p.stderr,
                    f"a kind without a bound: {p.stderr}")
            H.check(any(t["state"] == "sin_theta(projector)" for t in rep["tensors"]), "the sin theta rows")
    colossal_classes(d)
    from distopt.record import record
    model = _small_model()
    opt = galore_groups(model, H.GaLoreAdamWStandIn, lr=1e-3, bad_refresh=6)
    trace = os.path.join(d, "galore_bad.rec")
    with record(opt, trace, names=model, flush_every=5):
        _train(model, opt, 12)
    out, rep = H.run_verify(trace, "--rtol", "1e-5", expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"]) == ("projector", 6) and v["tensor"].endswith("/sin_theta(projector)"),
            f"a projector out of the gradient's subspace is named at its refresh: {v}")
    # the counters: a recording whose refreshes fall elsewhere than ours (its index says gap 4, the run used 5:
    # ours refresh at steps 1, 5, 9, the recorded projectors are at 1, 6, 11) is named at the first such step
    moved = copy_with_hparams(os.path.join(d, "galore.rec"), os.path.join(d, "galore_gap.rec"), 1,
                              "update_proj_gap=5,", "update_proj_gap=4,")
    out, rep = H.run_verify(moved, "--rtol", "1e-5", expect=1)
    v = rep["verdict"]
    H.check((v["kind"], v["step"]) == ("events", 5) and v["tensor"].endswith("/events(galore.refreshes)")
            and "(events: galore.refreshes of 0.weight: reference 1, recorded 0)" in out,
            f"a refresh the recording does not have is named by the counters at its step: {v}")


def colossal_classes(d):
    """ColossalAI 0.5.0's distributed optimizers recognised by class (stand-ins: ColossalAI pins torch <= 2.5.1 and
    does not import on torch 2.15): DistributedLamb and DistributedCAME as distopt's own under their names and
    constructors (error exactly 0: names, hyperparameters and states mapped; DistributedCAME warned as differing);
    DistributedAdaFactor as its own arithmetic written in torch (an int RMS never updated), recorded with its float
    states: verify names the difference at step 1, while the same code with RMS updated, recorded as transformers'
    Adafactor, verifies within Adafactor's declared tolerance."""
    import warnings as w
    from distopt.record import record
    runs = [("colossal_lamb", lambda m: _DistLambStandIn(m.parameters(), lr=1e-2, weight_decay=0.01), []),
            ("colossal_came", lambda m: _DistCAMEStandIn(m.parameters(), lr=1e-3, weight_decay=0.01), [])]
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        for tag, rep in _upstream_runs(d, runs):
            H.check(all(t["max_abs"] == 0 for t in rep["tensors"] if t["compared"]), f"{tag}: bitwise (error 0)")
            H.check(rep["upstream"].startswith("colossalai.nn.optimizer.distributed_"), f"{tag}: {rep['upstream']}")
    lamb_hp = json.load(open(os.path.join(d, "colossal_lamb.rec", "index.json")))["groups"][0]["hparams"]
    H.check("bias_correction=true" in lamb_hp and "adam=false" in lamb_hp and "eps=1e-06" in lamb_hp,
            f"DistributedLamb's defaults recorded: {lamb_hp}")
    said = [str(x.message) for x in caught if "differs from" in str(x.message)]
    H.check(len(said) == 1 and "DistributedCAME" in said[0] and "exp_avg_res_row" in said[0],
            f"DistributedCAME named as differing, once: {said}")
    print(f"record warned: {said[0]}")
    for tag, cls, expect in (("hf_adafactor_torch", _HFAdafactorStandIn, 0),
                             ("colossal_adafactor", _DistAdaFactorStandIn, 1)):
        model = _small_model()
        opt = cls(model.parameters())
        trace = os.path.join(d, tag + ".rec")
        with w.catch_warnings():
            w.simplefilter("ignore")
            with record(opt, trace, names=model, flush_every=5):
                _train(model, opt, 12)
        out, rep = H.run_verify(trace, expect=expect)
        rms = [t for t in rep["tensors"] if t["state"] == "RMS"]
        H.check(rms and all(t["compared"] for t in rms), f"{tag}: the RMS states recorded and compared")
        if expect:
            v = rep["verdict"]
            H.check(v["step"] == 1, f"{tag}: the difference named at step 1: {v}")
            print(f"{tag}: named at step {v['step']} ({v['tensor']}), RMS recorded {rms[0]['max_abs']:.3g} from ours")
        else:
            summary(rep)


def upstream_python():
    """An interpreter with came_pytorch, torch_optimizer, galore_torch (and transformers): this one, or
    $DISTOPT_UPSTREAM_PYTHON (a venv over Debian's torch, docs/verify.md)."""
    probe = "import came_pytorch, torch_optimizer, transformers.optimization"
    try:
        exec(probe)
        return sys.executable, None
    except Exception as e:  # noqa: BLE001 (any import failure means: not here)
        why = f"{sys.executable}: {probe} failed ({type(e).__name__}: {e})"
    c = os.environ.get("DISTOPT_UPSTREAM_PYTHON")
    if c and os.path.isfile(c) and os.path.realpath(c) != os.path.realpath(sys.executable):
        p = subprocess.run([c, "-c", probe], capture_output=True, text=True)
        if p.returncode == 0:
            return c, why
        why += f"; {c}: failed"
    elif c and os.path.isfile(c):
        p = subprocess.run([c, "-c", probe], capture_output=True, text=True)
        if p.returncode == 0:
            return c, why
    return None, why


def _galore_torch():
    """galore_torch's modules without its __init__ (which imports bitsandbytes, CUDA-only here)."""
    import importlib.util
    import types
    spec = importlib.util.find_spec("galore_torch")
    if spec is None:
        return None
    pkg = types.ModuleType("galore_torch")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["galore_torch"] = pkg
    import galore_torch.adafactor as gf
    import galore_torch.adamw as ga
    return ga, gf


def case_upstream_real():
    """The real classes: came_pytorch 0.1.3 CAME, torch_optimizer 0.3.0 Lamb, galore_torch 1.0's AdamW and
    Adafactor (skipped, with the reason, where they cannot be imported)."""
    py, why = upstream_python()
    if py is None:
        print(f"skipped: the upstream packages cannot be imported: {why}")
        sys.exit(77)
    if py != sys.executable:
        print(f"note: {why}; running under {py}")
        sys.stdout.flush()
        os.execv(py, [py, os.path.abspath(__file__), "upstream_real"])
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    from came_pytorch import CAME
    from torch_optimizer import Lamb
    ga, gf = _galore_torch()
    d = H.work_dir("upstream_real")
    runs = [("came", lambda m: CAME(m.parameters(), lr=1e-3, weight_decay=0.01), []),
            ("lamb", lambda m: Lamb(m.parameters(), lr=1e-2, weight_decay=0.01, debias=True), []),
            ("galore_adamw", lambda m: galore_groups(m, ga.AdamW, lr=1e-3, no_deprecation_warning=True),
             ["--rtol", "1e-5"]),
            ("galore_adafactor", lambda m: galore_groups(m, gf.Adafactor, lr=1e-2, relative_step=False,
                                                         scale_parameter=False), ["--rtol", "1e-5"])]
    for tag, rep in _upstream_runs(d, runs):
        if tag.startswith("galore"):
            H.check(rep["projectors_adopted"] >= 6, f"{tag}: projectors adopted ({rep['projectors_adopted']})")

def _twins(d, tags, world, expected, **kw):
    """distopt.twin on each recording d/<tag>.rec; expected[tag]: None (passes) or (category, step). Prints the
    verdicts and the measured margins; fails on any miss or false alarm."""
    import distopt
    import frameworks as F
    misses = []
    for tag in tags:
        extra = kw.get(tag, {})
        res = distopt.twin(os.path.join(d, f"{tag}.rec"), F.make_model, F.loss_fn, F.batches, world=world,
                           gas=F.GAS, **extra)
        rep = res.report or {}
        v = rep.get("verdict", {})
        side = rep.get("gradient_side") or {}
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("verdict:")), res.stderr.strip())
        print(f"{tag:>18}{' ' + str(extra) if extra else ''}: exit {res.returncode}; {line}")
        want = expected[tag]
        if want is None:
            print(f"{'':>18}  gradients at most {side.get('gradient_worst_of_bound', float('nan')):.3g} of their bound "
                  f"({side.get('gradient_elements')} elements), norms at most "
                  f"{side.get('clip_norm_worst_of_bound', float('nan')):.3g} of theirs, {side.get('clipped_pieces')} "
                  f"clipped pieces, {side.get('step_counts')} step counts")
            if res.returncode != 0:
                misses.append(f"{tag}: a false alarm (exit {res.returncode})")
        elif res.returncode != 1 or (v.get("kind"), v.get("step")) != want:
            misses.append(f"{tag}: expected {want}, got exit {res.returncode} {v.get('kind')} at {v.get('step')}")
    H.check(not misses, "; ".join(misses))


def case_twin():
    """A hand-written data-parallel training (2 gloo ranks, accumulation 2, clipping, torch AdamW) and ten planted
    gradient-side bugs (tests/verify/frameworks.py), one spawned job; each checked with distopt.twin: the correct run
    passes, each bug is named at its step with its category (gradient, clip, step_counter)."""
    import frameworks as F
    d = H.work_dir("twin")
    H.launch(F.dp_worker, 2, d)
    expected = {"dp_good": None, "dp_drop_micro": ("gradient", 3), "dp_twice": ("gradient", 2),
                "dp_loss_scale": ("gradient", 1), "dp_warmup": ("step_counter", 2),
                "dp_warmup_rec": ("step_counter", 1), "dp_local_norm": ("clip", 1), "dp_replicated": ("clip", 1),
                "dp_not_applied": ("clip", 1), "dp_expert": ("gradient", 1), "dp_dp_power": ("gradient", 1)}
    tags = ["dp_good"] + [f"dp_{b}" for b in F.BUGS]
    _twins(d, tags, 2, expected)
    # the warm-up by design (a framework's construction step): the twin told, it passes
    import distopt
    res = distopt.twin(os.path.join(d, "dp_warmup.rec"), F.make_model, F.loss_fn, F.batches, world=2, gas=F.GAS,
                       construction_steps=1)
    print(f"dp_warmup, construction_steps=1: exit {res.returncode}; "
          f"{next((ln for ln in res.stdout.splitlines() if ln.startswith('verdict:')), res.stderr.strip())}")
    H.check(res.returncode == 0, "the declared construction step passes")
    # refusals, one line each (exit 2): a recording that is no twin's, a twin with --reference
    good = os.path.join(d, "dp_good.rec")
    out, _ = H.run_verify(good, "--twin", os.path.join(d, "dp_twice.rec"), expect=2)
    out, _ = H.run_verify(good, "--twin", good, "--reference", good, expect=2)
    # plain verify (no twin) is blind to the gradient-side bugs whose gradients are consistent: it passes them
    blind = [b for b in ("drop_micro", "loss_scale", "expert", "dp_power")
             if distopt.verify(os.path.join(d, f"dp_{b}.rec")).returncode == 0]
    print(f"plain verify (no twin) passes {len(blind)} of 4 gradient bugs: {', '.join(blind)}")


def case_twin_fsdp2():
    """FSDP2 (fully_shard, 2 gloo ranks, accumulation 2 without sync, clip_grad_norm_ on DTensor gradients) against
    its twin: passes; a rank's micro-batch dropped (gradient, step 3) and the local shard's clip norm (clip, step 1)
    named. Skipped (77) on torch without FSDP2."""
    _need_fsdp2()
    import frameworks as F
    d = H.work_dir("twin_fsdp2")
    H.launch(F.fsdp2_worker, 2, d)
    _twins(d, ["fsdp2_good", "fsdp2_drop_micro", "fsdp2_local_norm"], 2,
           {"fsdp2_good": None, "fsdp2_drop_micro": ("gradient", 3), "fsdp2_local_norm": ("clip", 1)})

def case_deepspeed():
    """DeepSpeed (pinned in cmake/torch2.txt; skipped, 77, where this python lacks it): deepspeed.initialize on 2 gloo
    ranks (its CPU accelerator), torch's AdamW, accumulation 2, gradient_clipping, recorded with record(engine)
    unchanged: ZeRO 0-3 in fp32 and in bf16 verify and pass against their twins (bf16 against the bf16 twin; ZeRO
    0's bf16 optimizer steps at construction: recorded as construction_steps=1, the twin told so); a rank's dropped
    micro-batch under ZeRO 2 and 3 is named (gradient, step 3) while plain verify passes it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        print(f"skipped: {sys.executable} cannot import deepspeed ({type(e).__name__}: {e}); cmake/torch2.sh installs "
              f"it with torch 2 (docs/python.md)")
        sys.exit(77)
    import logging
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    import distopt
    import frameworks as F
    d = H.work_dir("deepspeed")
    H.launch(F.deepspeed_worker, 2, d)
    expected, kw = {}, {}
    for tag, stage, bug, bf16 in F.deepspeed_configs():
        expected[tag] = ("gradient", 3) if bug == "drop_micro" else None
        kw[tag] = {"dtype": torch.bfloat16} if bf16 else {}
        if tag == "ds_bf16_zero0":
            kw[tag]["construction_steps"] = 1
    tags = list(expected)
    for tag in tags:  # the C reference alone: every configuration verifies (the dropped micro-batch too: blind)
        res = distopt.verify(os.path.join(d, f"{tag}.rec"))
        line = next((ln for ln in res.stdout.splitlines() if ln.startswith("verdict:")), res.stderr.strip())
        print(f"{tag:>22} plain verify: exit {res.returncode}; {line}")
        H.check(res.returncode == 0, f"{tag}: plain verify")
    _twins(d, tags, 2, expected, **kw)
    with open(os.path.join(d, "ds_zero3.rec", "index.json")) as f:
        ix = json.load(f)
    H.check(ix["record"].get("clip", {}).get("max_norm") == F.MAX_NORM and "DeepSpeedZeroOptimizer_Stage3" in
            ix["optimizer"]["upstream"], f"ZeRO 3 recorded with its clipping: {ix['record']}, {ix['optimizer']}")
    with open(os.path.join(d, "ds_bf16_zero0.rec", "index.json")) as f:
        ix = json.load(f)
    H.check(ix.get("construction_steps") == 1, f"the bf16 optimizer's construction step: {ix.get('construction_steps')}")
    # a config without gradient_clipping clips at DeepSpeed's default (0 before 0.19, 1.0 since): recorded as such
    with open(os.path.join(d, "ds_zero2_default_clip.rec", "index.json")) as f:
        clip = json.load(f)["record"].get("clip")
    print(f"no gradient_clipping in the config: record.clip {clip} (DeepSpeed {deepspeed.__version__}'s default)")
    H.check(clip == {"max_norm": 1.0, "norm_type": 2}, f"DeepSpeed's default clipping recorded: {clip}")
    # ... named by a twin not told of it
    res = distopt.twin(os.path.join(d, "ds_bf16_zero0.rec"), F.make_model, F.loss_fn, F.batches, world=2, gas=F.GAS,
                       dtype=torch.bfloat16)
    v = (res.report or {}).get("verdict", {})
    print(f"ds_bf16_zero0, twin not told: exit {res.returncode}; "
          f"{next((ln for ln in res.stdout.splitlines() if ln.startswith('verdict:')), res.stderr.strip())}")
    H.check(res.returncode == 1 and (v.get("kind"), v.get("step")) == ("step_counter", 2), "construction step named")


CASES = {"adamw": case_adamw, "zero": case_zero, "sharded": case_sharded, "tp": case_tp, "fsdp": case_fsdp, "moe": case_moe, "dtensor": case_dtensor, "dtensor_torch2": case_dtensor_torch2, "pipeline": case_pipeline, "hf_adafactor": case_hf_adafactor,
         "replay": case_replay, "stepwise": case_stepwise, "upstream": case_upstream,
         "upstream_real": case_upstream_real, "twin": case_twin, "twin_fsdp2": case_twin_fsdp2,
         "deepspeed": case_deepspeed}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: run_client.py {'|'.join(CASES)}")
    CASES[sys.argv[1]]()
    print(f"PASS {sys.argv[1]}")
