"""DeepSpeed as a distopt.record client (docs/verify.md, "DeepSpeed"): record(engine, path) or record(engine.optimizer,
path, names=model) on every rank, the training unchanged.

What is recorded: DeepSpeed's inner torch optimizer (the one its config names, e.g. "AdamW" with torch_adam) on the
rank's flat fp32 partitions, each partition's pieces from DeepSpeed's own map of them:

  ZeRO 1 and 2 (DeepSpeedZeroOptimizer): single_partition_of_fp32_groups[g], each model parameter's fragment
      p._hp_mapping: its elements [lp.start, lp.start + numel) at hp.start in the partition
  ZeRO 3 (DeepSpeedZeroOptimizer_Stage3): fp32_partitioned_groups_flat[sub group], each parameter's partition
      (grad_position: its offset in the sub group; partition_numel() elements of which the rank's share of the
      parameter, [rank * n, rank * n + n) clipped to its size, is the piece; the rest is padding)
  bf16 (BF16_Optimizer, ZeRO 0 and 1 with bf16): fp32_groups_flat_partition[g], p._hp_mapping as ZeRO 1-2

The step is DeepSpeed's (engine.step() at the accumulation boundary calls it once, whatever the number of inner
steps over groups or sub groups); the gradient of each partition is taken inside it where DeepSpeed clips
(unscale_and_clip_grads: before, the gradient recorded; after, each clipped piece's digest) with the norm DeepSpeed
computed and the coefficient it applied, 1 / max(1, (norm + 1e-6) / gradient_clipping). A loss scale other than 1
(fp16) is refused: the recorded gradient would be the scaled one.
"""
import torch

from .record import Recorder, _is_dtensor  # noqa: F401

_ZERO12, _ZERO3, _BF16 = "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer"
_UNFUSED = "FP16_UnfusedOptimizer"  # ZeRO 0 with bf16: an fp32 copy of each parameter


def is_deepspeed(obj):
    return type(obj).__module__.startswith("deepspeed.")


def _loss_scale(ds):
    cfg = getattr(ds, "loss_scale_config", None)
    return float(cfg.cur_scale if cfg is not None and hasattr(cfg, "cur_scale") else getattr(ds, "loss_scale", 1.0))


def _engine(obj):
    """obj if it is a DeepSpeed engine (ZeRO 3's optimizer has module, optimizer and backward too), else None."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    return obj if isinstance(obj, DeepSpeedEngine) else None


def recorder(obj, path, every, params, states, **kw):
    """record()'s DeepSpeed branch: ZeRO 0 in fp32 (the engine's optimizer is the torch optimizer: every rank records
    every parameter, DeepSpeed's clip_grad_norm_ in engine.clip_fp32_gradients recorded), else the partitions."""
    engine = _engine(obj)
    if engine is not None and not is_deepspeed(engine.optimizer):
        return ZeroZeroRecorder(engine, path, every, params, states, **kw)
    return DeepSpeedRecorder(obj, path, every, params, states, **kw)


class ZeroZeroRecorder(Recorder):
    """ZeRO 0, fp32: the torch optimizer recorded on every rank (replicas), the engine's clipping through
    Recorder.clip_grad_norm_ with DeepSpeed's own clip_grad_norm_ (norm averaged over the data-parallel group)."""

    def __init__(self, engine, path, every=1, params=True, states=True, *, names=None, **kw):
        self.engine = engine
        super().__init__(engine.optimizer, path, every, params, states, names=names or engine.module, **kw)

    def _install(self):
        super()._install()
        eng, rec = self.engine, self
        from deepspeed.runtime.utils import clip_grad_norm_ as ds_clip
        self._had_clip = "clip_fp32_gradients" in eng.__dict__
        self._orig_eclip = eng.clip_fp32_gradients

        def clip_fp32_gradients():
            rec.clip_grad_norm_(list(eng.module.parameters()), eng.gradient_clipping(),
                                clip=lambda ps, mn: ds_clip(parameters=ps, max_norm=mn, mpu=eng.mpu))

        eng.clip_fp32_gradients = clip_fp32_gradients

    def _restore(self):
        super()._restore()
        if self._had_clip:
            self.engine.clip_fp32_gradients = self._orig_eclip
        else:
            self.engine.__dict__.pop("clip_fp32_gradients", None)


class _Partitions:
    """The inner torch optimizer seen with the rank's flat fp32 partitions as its parameters (ZeRO 3 empties the
    inner param_groups outside its step): what Recorder reads, hyperparameters from the inner groups."""

    def __init__(self, inner, flats, under):
        self._distopt_inner, self._flats, self._distopt_under = inner, flats, under
        self.state = inner.state

    @property
    def param_groups(self):
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": list(self._flats[i])}
                for i, g in enumerate(self._distopt_inner.param_groups)]


def _adapter(obj, names):
    """(the DeepSpeed optimizer, the model, the view, layout=, kind) of an engine or a DeepSpeed optimizer."""
    engine = _engine(obj)
    ds = engine.optimizer if engine is not None else obj
    model = names if names is not None else (engine.module if engine is not None else None)
    kind = type(ds).__name__
    if kind not in (_ZERO12, _ZERO3, _BF16, _UNFUSED):
        raise ValueError(f"distopt.record: DeepSpeed optimizer {type(ds).__module__}.{kind}: recorded are "
                         f"{_ZERO12} (ZeRO 1, 2), {_ZERO3} (ZeRO 3), {_BF16} and {_UNFUSED} (bf16); with ZeRO 0 in "
                         f"fp32 the engine's optimizer is the torch optimizer itself (record(engine, path))")
    if model is None:
        raise ValueError("distopt.record: a DeepSpeed optimizer without its engine needs names= (the model)")
    scale = _loss_scale(ds)
    if scale != 1.0 or getattr(ds, "dynamic_loss_scale", False):
        raise ValueError(f"distopt.record: DeepSpeed loss scale {scale!r} (fp16): the gradients it clips are "
                         f"scaled; record fp32 or bf16 training")
    naming = {id(p): n for n, p in model.named_parameters()}
    inner = ds.optimizer
    layout, flats = {}, []
    if kind in (_ZERO12, _BF16):
        groups = ds.bit16_groups if kind == _ZERO12 else ds.bf16_groups
        parts = ds.single_partition_of_fp32_groups if kind == _ZERO12 else ds.fp32_groups_flat_partition
        for g, (lps, flat) in enumerate(zip(groups, parts)):
            specs = []
            for lp in lps:
                m = getattr(lp, "_hp_mapping", None)
                if m is None or m.lp_fragment_address.numel == 0:
                    continue  # another rank's
                if id(lp) not in naming:
                    raise ValueError(f"distopt.record: a DeepSpeed parameter of shape {list(lp.shape)} is not in the "
                                     f"model's named_parameters")
                specs.append({"param": naming[id(lp)], "shape": list(lp.shape), "lo": int(m.lp_fragment_address.start),
                              "len": int(m.lp_fragment_address.numel), "at": int(m.hp_fragment_address.start)})
            layout[flat] = specs or None
            flats.append([flat])
    elif kind == _UNFUSED:  # an fp32 copy of each parameter, whole
        for lps, fps in zip(ds.fp16_groups, ds.fp32_groups):
            for lp, fp in zip(lps, fps):
                layout[fp] = {"param": naming[id(lp)], "shape": list(lp.shape)}
            flats.append(list(fps))
    else:  # ZeRO 3: each sub group's flat partition, its parameters' shares at their grad_position offsets
        rank = torch.distributed.get_rank(ds.dp_process_group)
        by_group = {}
        for sg, (lps, flat) in enumerate(zip(ds.fp16_groups, ds.fp32_partitioned_groups_flat)):
            specs = []
            for lp in lps:
                _, at, n = ds.grad_position[ds.get_param_id(lp)]
                full = int(lp.ds_numel)
                lo = rank * int(n)
                ln = max(0, min(int(n), full - lo))
                if ln == 0:
                    continue
                specs.append({"param": naming[id(lp)], "shape": list(lp.ds_shape), "lo": lo, "len": ln,
                              "at": int(at)})
            layout[flat] = specs or None
            by_group.setdefault(ds.sub_group_to_group_id[sg], []).append(flat)
        flats = [by_group.get(g, []) for g in range(len(inner.param_groups))]
    under = f" under deepspeed {kind}"
    return ds, model, _Partitions(inner, flats, under), layout, kind


class DeepSpeedRecorder(Recorder):
    """Recorder of a DeepSpeed engine or optimizer (module docstring); record() returns it."""

    def __init__(self, obj, path, every=1, params=True, states=True, *, names=None, **kw):
        if "layout" in kw:
            raise ValueError("distopt.record: a DeepSpeed engine's layout comes from DeepSpeed's own map (no layout=)")
        self.ds, model, view, layout, self.kind = _adapter(obj, names)
        if getattr(self.ds, "_distopt_recorder", None) is not None:
            raise RuntimeError("distopt.record: this DeepSpeed optimizer is already being recorded (close the other "
                               "recorder)")
        steps = [int(v["step"].item() if torch.is_tensor(v["step"]) else v["step"])
                 for v in view.state.values() if "step" in v]
        if kw.get("start_step") is None and kw.get("construction_steps") is None and self.kind in (_BF16, _UNFUSED) \
                and steps and max(steps) == 1:
            # DeepSpeed's bf16 optimizers step once on zero gradients at construction: recorded as such (the window
            # starts after it; verify's report and the twin name it unless it is told construction_steps=1). Any
            # other state already there is a run under way: Recorder refuses it without start_step=
            kw["construction_steps"] = 1
        self._ds_pre, self._ds_post, self._ds_clip = [], [], None
        super().__init__(view, path, every, params, states, layout=layout, **kw)

    def _install(self):
        ds, rec = self.ds, self
        self._orig_step, self._orig_clip = ds.step, ds.unscale_and_clip_grads
        self._had_own = ("step" in ds.__dict__, "unscale_and_clip_grads" in ds.__dict__)

        def step(*args, **kwargs):
            return rec._step(args, kwargs)

        def clip(*args, **kwargs):
            return rec._clip_hook(args, kwargs)

        ds.step, ds.unscale_and_clip_grads = step, clip
        self.optimizer._distopt_recorder = ds._distopt_recorder = self

    def _restore(self):
        ds = self.ds
        for attr, orig, had in (("step", self._orig_step, self._had_own[0]),
                                ("unscale_and_clip_grads", self._orig_clip, self._had_own[1])):
            if had:
                setattr(ds, attr, orig)
            else:
                ds.__dict__.pop(attr, None)
        self.optimizer.__dict__.pop("_distopt_recorder", None)
        ds.__dict__.pop("_distopt_recorder", None)

    def _clip_hook(self, args, kwargs):
        """DeepSpeed's unscale_and_clip_grads(partition(s) or sub group, total_norm): the gradients of the
        partitions that have one now, before and after; the norm and DeepSpeed's coefficient."""
        if self.closed:
            return self._orig_clip(*args, **kwargs)
        pre = self._grads()[0]
        out = self._orig_clip(*args, **kwargs)
        post = self._grads()[0]
        self._ds_pre.append(pre)
        self._ds_post.append(post)
        ds = self.ds
        # the norm: ZeRO's (partitions, total_norm) / (sub group, total_norm), the unfused (total_norm, apply_scale)
        total = kwargs.get("total_norm", args[0] if self.kind == _UNFUSED else args[-1] if args else None)
        if float(ds.clip_grad) > 0 and total is not None:
            # DeepSpeed's 1 / max(1, (norm + 1e-6) / clip) in the norm's own dtype (fp32 in ZeRO 1-2, fp64 in ZeRO 3
            # on the CPU, a Python float in the unfused optimizer) or in fp64 (Recorder._clip_tensors chooses)
            cands = []
            if torch.is_tensor(total):
                for dt in (None, torch.float64):
                    norm = total.detach().to("cpu") if dt is None else total.detach().to("cpu", dt)
                    c = torch.clamp((norm + 1e-6) / ds.clip_grad, min=1.0)
                    cands.append((1. / c).to(torch.float32).reshape(()))
            c = max(1.0, (float(total) + 1e-6) / float(ds.clip_grad))  # Python floats (the unfused optimizer)
            cands.append(torch.tensor(1. / c, dtype=torch.float32))
            norm = torch.as_tensor(total).detach().to("cpu", torch.float32).reshape(())
            self._ds_clip = (float(ds.clip_grad), norm, cands)
        return out

    def _run_step(self, args, kwargs):
        self._ds_pre, self._ds_post, self._ds_clip = [], [], None
        out = self._orig_step(*args, **kwargs)
        pre = [x for part in self._ds_pre for x in part]
        post = [x for part in self._ds_post for x in part]
        if self._ds_clip is not None:
            max_norm, norm, cands = self._ds_clip
            if self.clip_max is not None and max_norm != self.clip_max:
                raise ValueError(f"distopt.record: DeepSpeed's gradient_clipping changed from {self.clip_max!r} to "
                                 f"{max_norm!r} (one max_norm a recording)")
            self.clip_max, self.clip_rec, self.pre = max_norm, (norm, cands), (pre, [])
        return out, (post, [])
