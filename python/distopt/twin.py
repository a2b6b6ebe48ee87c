"""distopt.twin: check a distributed training's recording against a single-process twin of the same training.

    res = distopt.twin("run.rec", make_model, loss_fn, batches, world=2, gas=2)   # a VerifyResult
    res.report["verdict"]   # {"kind": "gradient" | "clip" | "step_counter" | "diverged" | ..., "step", "tensor", "rank"}

The recording (distopt.record on every rank, parameters recorded after every step; clipping through
Recorder.clip_grad_norm_ when the training clips) says what the distributed run did; the twin says what the
training should have done at the same point. At every recorded step t the twin

  - sets a model from make_model() to the run's recorded parameters before step t (teacher-forced: the gradient
    is compared where the run computed it, so a difference is this step's, not an accumulation),
  - computes each micro-batch's gradient, loss_fn(model, batches(j, rank, micro)).backward() for every rank of
    `world` and every micro-step of `gas` (j: the training step, t less the recording's construction steps),
  - sums them in float64 times `scale` (default 1 / (world * gas): each rank's loss the mean of its micro-batch,
    gradients averaged over the ranks, the loss divided by gas) and records the sum rounded once to fp32 and the
    sum of the terms' magnitudes (grad_abs/, the bound's scale),

then `distopt verify RUN --twin TWIN` replays the run through the C reference as always and also checks, step by
step, in this order: each parameter's gradient as the run reduced it against the twin's within (world * gas + 1)
u times the magnitudes (fp32's rounding of a sum of that many terms in any order: a dropped micro-batch, a
gradient counted twice, an unapplied loss scale or a 1/dp applied to the accumulated shard are far outside); with
record.clip, every rank's total norm against the exact norm of the gradient, its coefficient and each clipped
piece; every recorded step count against the twin's (training step + construction_steps: a warm-up step that
advanced the counter); then the update. The verdict names the first step, the category, the tensor and the rank.

A framework that steps the optimizer before training by design (DeepSpeed's bf16 optimizer, at construction):
record with construction_steps=k and pass construction_steps=k here (the twin then expects the counter k ahead);
without it the twin names the counter. What the twin assumes: every rank's forward and backward of a micro-batch
is the one make_model's model computes on the same parameters (data parallel, ZeRO, FSDP: not tensor parallel,
whose split matmuls round otherwise); scale a power of two or applied to the gradient (docs/verify.md).
"""
import os
import tempfile

from .record import KIND, SCHEMA_VERSION, _torch_info, _write_json_atomic
from .replay import _Recording, _Writer
from .verify import run_verify

__all__ = ["twin"]


def twin(recording, make_model, loss_fn, batches, *, world, gas=1, scale=None, construction_steps=0, dtype=None,
         stepwise=False, rtol=None, json_path=None, plot=None, cli=None, work=None, timeout=None):
    """Runs the single-process twin of the recorded training and verifies the recording against it and the C
    reference (`distopt verify RUN --twin TWIN`); returns a VerifyResult (returncode 0, 1 diverged, 2 bad input).

    make_model():               a fresh model with the recording's parameter names (named_parameters)
    loss_fn(model, batch):      the loss of one micro-batch, as each rank computes it (before any scaling)
    batches(step, rank, micro): training step `step`'s micro-batch `micro` on rank `rank`
    world, gas:                 the ranks whose batches make one step, and the micro-steps of each
    scale:                      what each micro-batch's gradient counts in the step's (default 1 / (world * gas))
    construction_steps:         optimizer steps the framework takes before training by design
    dtype:                      torch.bfloat16: the run's model is bf16 (DeepSpeed's bf16): the twin's model too,
                                its parameters the recorded fp32 ones rounded, the gradients summed in bf16 by the
                                run (the bound's unit 2^-8)
    work:                       a folder for the twin's recording (default: a temporary one, removed)"""
    import torch
    for k, v in (("world", world), ("gas", gas), ("construction_steps", construction_steps)):
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "construction_steps" else 1):
            raise ValueError(f"distopt.twin: {k}={v!r} must be an integer >= {0 if k == 'construction_steps' else 1}")
    rec = _Recording(recording)
    ix = rec.ix
    if ix["optimizer"].get("name") is None:
        raise ValueError("distopt.twin: the recording's optimizer is not a distopt optimizer (recorded as it is): "
                         "the twin's check runs beside the C reference's replay")
    if rec.every != 1 or not ix["record"].get("params"):
        raise ValueError(f"distopt.twin: the twin computes each step's gradient at the run's parameters before it: "
                         f"record them after every step (every=1, params=True; this recording: every={rec.every}, "
                         f"params={ix['record'].get('params')})")
    scale = 1.0 / (world * gas) if scale is None else float(scale)
    if dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"distopt.twin: dtype={dtype!r}: torch.float32 or torch.bfloat16")
    model = make_model()
    if dtype is not None:
        model = model.to(dtype)
    named = dict(model.named_parameters())
    for p in rec.params:
        q = named.get(p["name"])
        if q is None:
            raise ValueError(f"distopt.twin: make_model()'s model has no parameter {p['name']!r} (its names: "
                             f"{', '.join(list(named)[:8])}{', ...' if len(named) > 8 else ''})")
        if list(q.shape) != [int(d) for d in p["shape"]]:
            raise ValueError(f"distopt.twin: parameter {p['name']!r} is {list(q.shape)} in make_model()'s model, "
                             f"{p['shape']} in the recording")
    names = [p["name"] for p in rec.params]
    cs_run = int(ix.get("construction_steps", 0))
    tmp = tempfile.TemporaryDirectory(prefix="distopt-twin-") if work is None else None
    out = os.path.join(tmp.name if tmp else os.fspath(work), "twin.rec")
    flush = int(ix["record"].get("flush_every", 16))
    wr = _Writer(out, rec.start + 1, flush)

    try:
        with torch.no_grad():
            for n in names:
                x = rec.assemble(n, rec.start + 1, f"init/{n}")
                if x is None:
                    raise ValueError(f"distopt.twin: no init/{n} in the recording")
                named[n].copy_(x.reshape(named[n].shape))
                wr.add(f"init/{n}", x.clone())  # (as recorded: fp32)
        for t in range(rec.start + 1, rec.steps + 1):
            if t - 1 > rec.start:
                with torch.no_grad():
                    for n in names:
                        x = rec.assemble(n, t - 1, f"param/{t - 1}/{n}")
                        if x is None:
                            raise ValueError(f"distopt.twin: no param/{t - 1}/{n}: the run's parameters before step "
                                             f"{t}")
                        named[n].copy_(x.reshape(named[n].shape))
            j = t - cs_run  # the training step
            total = {n: None for n in names}
            mag = {n: None for n in names}
            for r in range(world):
                for m in range(gas):
                    for q in named.values():
                        q.grad = None
                    loss_fn(model, batches(j, r, m)).backward()
                    for n in names:
                        g = named[n].grad
                        if g is None:
                            continue
                        g = g.detach().to(torch.float64).reshape(-1)
                        total[n] = g.clone() if total[n] is None else total[n] + g
                        mag[n] = g.abs() if mag[n] is None else mag[n] + g.abs()
            for n in names:
                if total[n] is not None:
                    wr.add(f"grad/{t}/{n}", (total[n] * scale).to(torch.float32))
                    wr.add(f"grad_abs/{t}/{n}", (mag[n] * abs(scale)).to(torch.float32))
            wr.after_step(t)
        wr.flush(rec.steps)
        for q in named.values():
            q.grad = None
        index = {
            "schema_version": SCHEMA_VERSION, "kind": KIND, "generator": "distopt.twin (python)",
            "optimizer": ix["optimizer"], "groups": ix["groups"], "params": ix["params"], "torch": _torch_info(torch),
            "world_size": 1, "record": {"every": 1, "params": False, "states": False, "flush_every": flush},
            "ranks": [{"rank": 0, "pieces": [{"param": n} for n in names], "files": wr.files}],
            "start_step": rec.start, "steps": rec.steps, "complete": True,
            "twin": {"terms": world * gas, "construction_steps": construction_steps,
                     "grad_dtype": "BF16" if dtype == torch.bfloat16 else "F32"},
        }
        _write_json_atomic(os.path.join(out, "index.json"), index)
        extra = ["--twin", out] + (["--stepwise"] if stepwise else [])
        return run_verify(recording, extra, cli, rtol, json_path, plot, timeout)
    finally:
        if tmp:
            tmp.cleanup()
