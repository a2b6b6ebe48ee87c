"""Distributed trainings checked end to end against their single-process twins (distopt.twin; run_client.py twin
and twin_fsdp2). One spawned job per framework runs the correct training and every planted gradient-side bug,
each recorded with distopt.record (clipping through Recorder.clip_grad_norm_); the parent process runs the twins.

The data-parallel training (2 gloo ranks, accumulation 2, torch AdamW, clipping at max_norm 1.0) is written by
hand as frameworks do it: each micro-batch's loss divided by gas, backward, the gradients all-reduced (SUM) and
divided by the world size. The planted bugs are the field's published ones (docs/verify.md):

  drop_micro     rank 1 drops its second micro-batch's gradient at step 3 (zero_grad inside the accumulation)
  twice          the first layer's gradient counted twice at step 2 (a submodule run twice, counted wrong)
  loss_scale     every gradient divided by a loss scale of 65536 that the loss never got (DeepSpeed #7837)
  warmup         a zero-gradient warm-up step before training that advanced Adam's step (Megatron-LM #5974),
                 the recording told construction_steps=1 (the twin names the counter unless told it too)
  warmup_rec     the same warm-up recorded as the first step (every gradient zero)
  local_norm     the clip norm over the parameters this rank owns (a ZeRO shard), not all-reduced (pytorch #170862)
  replicated     the norm's squares all-reduced over ranks holding replicas: every gradient counted world times
                 (NeMo RL #3788's TP-replicated gradients)
  not_applied    the norm computed, the coefficient never applied (transformers #46113)
  expert         the last layer (the "experts") all-reduced but not divided by the world size (Megatron-LM #5956)
  dp_power       1/dp applied to the accumulated gradient at every micro-step: micro-batch i scaled by
                 dp^(i - gas - 1) (Megatron-LM #3023)
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as H  # noqa: E402

STEPS, GAS, MAX_NORM = 5, 2, 0.1  # max_norm below every step's norm: each step clips
BUGS = ("drop_micro", "twice", "loss_scale", "warmup", "warmup_rec", "local_norm", "replicated", "not_applied",
        "expert", "dp_power")


def make_model():
    H.seeded()
    return H.mlp()


def loss_fn(model, b):
    x, y = b
    dt = next(model.parameters()).dtype  # a bf16 model (DeepSpeed's bf16) takes bf16 batches
    return ((model(x.to(dt)).float() - y) ** 2).mean()


def batches(step, rank, micro):
    return H.batch(1000 * step + micro, rank, n=8)


def _norm_owned(params, max_norm, rank, world):
    """The bug local_norm: the norm over this rank's own parameters (index % world), not all-reduced."""
    own = [p for i, p in enumerate(params) if i % world == rank and p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in own]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def _norm_replicated(params, max_norm):
    """The bug replicated: every rank's squares summed over the ranks, each replica counted."""
    sq = torch.stack([torch.linalg.vector_norm(p.grad) ** 2 for p in params]).sum()
    dist.all_reduce(sq)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total


def _norm_not_applied(params, max_norm):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def dp_training(rank, world, out, bug=None):
    from distopt.record import record
    model = make_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
    warm = bug in ("warmup", "warmup_rec")

    def warmup():  # a zero-gradient step that creates the states (and advances the step)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()

    if bug == "warmup":
        warmup()
    rec = record(opt, out, names=model, flush_every=4, **({"construction_steps": 1} if bug == "warmup" else {}))
    with rec:
        if warm and bug == "warmup_rec":
            warmup()
        for j in range(1, STEPS + 1):
            opt.zero_grad()
            for m in range(GAS):
                if bug == "drop_micro" and rank == 1 and j == 3 and m == 1:
                    opt.zero_grad()  # the first micro-batch's gradient lost
                loss = loss_fn(model, batches(j, rank, m)) / GAS
                loss.backward()
                if bug == "dp_power":
                    for p in params:
                        p.grad.div_(world)
            for i, p in enumerate(params):
                if bug == "twice" and j == 2 and i < 2:
                    p.grad.mul_(2)
                dist.all_reduce(p.grad)
                expert = i >= len(params) - 2
                if bug != "dp_power" and not (bug == "expert" and expert):
                    p.grad.div_(world)
                if bug == "loss_scale":
                    p.grad.div_(65536.0)
            clip = {"local_norm": lambda ps, mn: _norm_owned(ps, mn, rank, world),
                    "replicated": _norm_replicated, "not_applied": _norm_not_applied}.get(bug)
            rec.clip_grad_norm_(params, MAX_NORM, clip=clip)
            opt.step()


def dp_worker(rank, world, work):
    dp_training(rank, world, os.path.join(work, "dp_good.rec"))
    for bug in BUGS:
        dp_training(rank, world, os.path.join(work, f"dp_{bug}.rec"), bug)


# ---- FSDP2 (torch >= 2.4): fully_shard over 2 gloo ranks, clip_grad_norm_ of its DTensor gradients ---------------

def fsdp2_training(rank, world, out, bug=None):
    from torch.distributed.fsdp import fully_shard
    from distopt.record import record
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)

    def local_norm(ps, mn):  # pytorch #170862: the norm of the local shards only
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.to_local()) for p in ps]))
        coef = torch.clamp(mn / (total + 1e-6), max=1.0)
        for p in ps:
            p.grad.to_local().mul_(coef)
        return total

    with record(opt, out, names=model, flush_every=4) as rec:
        for j in range(1, STEPS + 1):
            opt.zero_grad()
            for m in range(GAS):
                model.set_requires_gradient_sync(m == GAS - 1)
                loss = loss_fn(model, batches(j, rank, m)) / GAS
                if bug == "drop_micro" and rank == 1 and j == 3 and m == 0:
                    loss = loss * 0  # this rank's first micro-batch's gradient lost (its collectives still run)
                loss.backward()
            rec.clip_grad_norm_(params, MAX_NORM, clip=local_norm if bug == "local_norm" else None)
            opt.step()


def fsdp2_worker(rank, world, work):
    fsdp2_training(rank, world, os.path.join(work, "fsdp2_good.rec"))
    for bug in ("drop_micro", "local_norm"):
        fsdp2_training(rank, world, os.path.join(work, f"fsdp2_{bug}.rec"), bug)


# ---- DeepSpeed (pinned in cmake/torch2.txt): the engine's ZeRO optimizer recorded unchanged --------------------

def deepspeed_training(rank, world, out, stage, bug=None, bf16=False):
    """deepspeed.initialize over the job's gloo group: ZeRO `stage`, torch's AdamW (torch_adam), accumulation GAS,
    gradient_clipping MAX_NORM; record(engine) unchanged. bug "drop_micro": rank 1's first micro-batch at step 3
    contributes nothing (its loss times 0); "default_clip": no gradient_clipping in the config (DeepSpeed's default,
    1.0 since 0.19: the recording must say so, the twin pass)."""
    import logging
    import deepspeed
    from distopt.record import record
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": GAS,
           **({} if bug == "default_clip" else {"gradient_clipping": MAX_NORM}),
           "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 9, "bf16": {"enabled": bf16},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.99], "weight_decay": 0.01,
                                                     "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with record(engine, out, flush_every=4):
        try:  # one recorder at a time (refused on every rank before any collective)
            record(engine.optimizer, out + ".second", names=model)
            raise AssertionError("a second recorder of the same DeepSpeed optimizer was accepted")
        except RuntimeError as e:
            assert "already being recorded" in str(e), e
        for j in range(1, STEPS + 1):
            for m in range(GAS):
                loss = loss_fn(engine, batches(j, rank, m))
                if bug == "drop_micro" and rank == 1 and j == 3 and m == 0:
                    loss = loss * 0
                engine.backward(loss)
                engine.step()
    engine.destroy()


def deepspeed_configs():
    """(tag, stage, bug, bf16): ZeRO 0-3 in fp32 and in bf16, a dropped micro-batch under ZeRO 2 and 3 (all of it
    about 10 s: the issue's budget put bf16 and ZeRO 0 under --long; they fit the regular run)."""
    out = [(f"ds_zero{s}", s, None, False) for s in (0, 1, 2, 3)]
    out += [(f"ds_bf16_zero{s}", s, None, True) for s in (0, 1, 2, 3)]
    out += [(f"ds_zero{s}_drop_micro", s, "drop_micro", False) for s in (2, 3)]
    out += [("ds_zero2_default_clip", 2, "default_clip", False)]  # no gradient_clipping: DeepSpeed's default
    return out


def deepspeed_worker(rank, world, work):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    for tag, stage, bug, bf16 in deepspeed_configs():
        deepspeed_training(rank, world, os.path.join(work, f"{tag}.rec"), stage, bug, bf16)
