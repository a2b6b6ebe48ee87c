"""distopt.record: record a PyTorch optimizer's run so that `distopt verify` can replay it through the C reference.

    with distopt.record(opt, "run.rec", names=model) as rec:      # every rank of a torch.distributed job too
        for batch in data:
            loss(model(batch)).backward()
            opt.step()
            opt.zero_grad()
    distopt.verify("run.rec")                                      # the `distopt verify` CLI: exit 0, 1 or 2

The recording (docs/verify.md, schema_version 2) is a directory: `index.json` and safetensors files, each a
contiguous block of `flush_every` steps of one rank (`rank<R>/<first>-<last>.safetensors`) holding
`init/<param>` (first file), `grad/<t>/<param>` (every step: the replay needs them all), and every `every`
steps `param/<t>/<param>` and `state/<t>/<param>/<key>` (upstream's state keys; `step` as I64). A file is
written when its block is full; the index last, atomically (a temporary file renamed over it), after every
rank has written its file, so an interrupted run leaves a readable prefix (`"complete": false`).

torch 1.13 has no optimizer step hooks: the optimizer's `step` is wrapped (an instance attribute) and restored
by close() / the end of the with-block. Gradients are taken just before the wrapped step (with a closure:
right after it returns, inside the step), parameters and states right after.

Distributed: in a torch.distributed job (initialised when record() is called) every rank records its own
layout and the ranks meet in a collective at construction and at every flush, so record(), the steps and
close() must run on every rank in the same order. ZeroRedundancyOptimizer: each rank records the parameters it
owns (whole; their gradients, values and its inner optimizer's states), the verifier assembles the full
gradient from the owners. A plain optimizer in a distributed job (DDP): every rank records every parameter
(replicas; rank 0's gradients drive the replay, every rank's values are compared). A hand-written sharded
optimizer passes `layout=`: for each local tensor the global parameter it is a piece of and which flat elements
(and which state elements) it holds.

Optimizers known by class (distopt._upstream.CLASSES: torch AdamW, Adafactor and Muon, HF Adafactor, schedulefree's
AdamWScheduleFree, adam-mini's Adam_mini, came_pytorch CAME, ColossalAI's distributed optimizers,
torch_optimizer Lamb, galore_torch's AdamW, Adafactor and AdamW8bit with their projectors, bitsandbytes'
AdamW8bit) and distopt.Optimizer are recorded with no names to write; ZeroRedundancyOptimizer -> its inner
optimizer. Any other class is recorded as it is (optimizer.name null: distopt.replay verifies it against your
own optimizer), or under `name=` with `hparams=` (distopt keys, `distopt list`). start_step= records a window
of a run under way (its states at the start first); grads="bf16" and grad_steps= shrink the gradients.
"""
import collections
import ctypes
import hashlib
import json
import os
import warnings

from . import _core, _upstream
from ._safetensors import write as _write_safetensors
from ._safetensors import write_bytes as _write_bytes
from .verify import verify  # noqa: F401 (distopt.record and distopt.verify are one pair)

SCHEMA_VERSION = 6  # 6: record.clip (clip/, clipped_digest/), construction_steps, a twin's twin and grad_abs/; 2: start_step, init_state/, record.grads (BF16), grad_digest/, proj/; 3: grad_agree/, blocks;
#                    4: stages, experts (docs/verify.md)
# schema 5: grad_agree/<t>/<p> is the digest of the rank's pieces of p (in its pieces' order), for every piece
# form, compared among the ranks whose pieces of p are the same; a rank without a piece of p records its whole
# gradient's (ZeRO). Schema 4's verifier compared every rank's digest of p with the lowest rank's, so a 4
# recording holds only whole gradients' digests (and still reads).
_AGREE_PIECES = SCHEMA_VERSION >= 5
KIND = "distopt-record"

__all__ = ["record", "Recorder", "verify", "dtensor_layout"]


def _write_json_atomic(path, obj):
    """index.json through the library's atomic write (the one rule for outputs, docs/files.md)."""
    _write_bytes(path, (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode())


# ---- what to call the optimizer ---------------------------------------------------------------------

def _torch_info(torch):
    cap = None
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    if get is not None:
        cap = get()
    else:
        for line in torch.__config__.show().splitlines():
            if "CPU capability usage:" in line:
                cap = line.split(":", 1)[1].strip()
    return {"version": str(torch.__version__), "cpu_capability": cap or "unknown",
            "num_threads": int(torch.get_num_threads())}


def _unwrap(inner):
    """The optimizer a framework's view stands for (distopt._deepspeed's flat partitions of a torch optimizer)."""
    return getattr(inner, "_distopt_inner", inner)


def _known_name(inner):
    """The distopt optimizer of an upstream class (distopt._upstream.CLASSES) or of distopt.Optimizer, else None."""
    inner = _unwrap(inner)
    entry = _upstream.upstream_class(type(inner))
    if entry:
        return entry["name"]
    from ._torch_api import Optimizer
    if isinstance(inner, Optimizer):  # distopt's own: its name; param_groups hold upstream's keys
        return inner.name
    return None


def _qualname(obj):
    cls = type(_unwrap(obj))
    return f"{cls.__module__}.{cls.__qualname__}"


class _Groups:
    """The distopt hyperparameters of each param group, as read before every step."""

    def __init__(self, name, hparams, outer, inner):
        self.name, self.fixed, self.outer, self.inner = name, hparams, outer, _unwrap(inner)
        self.entry = _upstream.upstream_class(type(self.inner)) if name is not None else None
        self.keys = set(_core.Spec(name).kinds) if name is not None else set()
        if name is not None and self.fixed is None:  # a wrapper's (galore's) inner keys are its keys too
            inner_name = self._adapt(dict(outer.param_groups[0])).get("inner")
            if isinstance(inner_name, str) and inner_name in _core.names():
                self.keys |= set(_core.Spec(inner_name).kinds)

    def _adapt(self, group):
        fn = self.entry.get("group") if self.entry else None
        fo = self.entry.get("group_opt") if self.entry else None
        out = fo(group, self.inner) if fo else fn(group) if fn else dict(group)
        for attr, key in (self.entry or {}).get("attrs", {}).items():
            if hasattr(self.inner, attr):
                out[key] = getattr(self.inner, attr)
        return out

    def read_raw(self):
        """An as-is recording's groups: the upstream keys with a number or bool value (what a schedule changes)."""
        out = []
        for group in self.outer.param_groups:
            merged = dict(self.inner.param_groups[len(out)]) if self.inner is not self.outer else {}
            merged.update(group)
            out.append({k: v for k, v in merged.items() if k != "params" and isinstance(v, (int, float))
                        and isinstance(k, str) and 0 < len(k) <= 63})
        return out

    def read(self):
        out = []
        for g, group in enumerate(self.outer.param_groups):
            if self.fixed is not None:
                hp = dict(self.fixed[g] if isinstance(self.fixed, (list, tuple)) else self.fixed)
                lr = group.get("lr")  # an lr schedule on a hand-written optimizer still reaches the replay
                if "lr" in self.keys and "lr" in hp and isinstance(lr, (int, float)) and not isinstance(lr, bool):
                    hp["lr"] = lr
            else:
                merged = dict(self.inner.param_groups[g]) if self.inner is not self.outer else {}
                merged.update(group)
                merged = self._adapt({k: v for k, v in merged.items() if k != "params"})
                hp, _rest = _upstream.to_distopt(self.name, merged, known=self.keys)
            out.append(hp)
        return out


# ---- the recorder --------------------------------------------------------------------------------------

def _f32(t, what):
    import torch
    if t.is_sparse:
        raise ValueError(f"distopt.record: {what} is sparse; only dense float32 tensors can be recorded")
    if t.dtype != torch.float32:
        raise ValueError(f"distopt.record: {what} is {t.dtype}; only float32 parameters can be verified")
    return t.detach().to("cpu", copy=True).contiguous()


# One local tensor's piece of a parameter: a flat range [lo, lo + len) of the parameter (block None) or of its
# tensor-parallel block; extent: the elements of either; at: where its len elements start in the local tensor (None:
# the local tensor is the piece); stage, expert: -1 for none (docs/layout.md).
_Piece = collections.namedtuple("_Piece", "tensor name lo len states extent block at stage expert")


def _local(pc, x):
    """A piece's elements of x, a tensor shaped as its local tensor (the value, the gradient, an elementwise
    state): x itself, or its flat elements [at, at + len) when the local tensor is a flat buffer. A DTensor
    parameter's value: its local tensor (gradients and states are made local before, _plain)."""
    if _is_dtensor(x):
        x = x.to_local()
    return x if pc.at is None else x.reshape(-1)[pc.at:pc.at + pc.len]


_DTENSOR = []  # [class or None], found on first use (torch 1.13 has none)


def _is_dtensor(x):
    if not _DTENSOR:
        cls = None
        for mod in ("torch.distributed.tensor", "torch.distributed._tensor"):
            try:
                cls = getattr(__import__(mod, fromlist=["DTensor"]), "DTensor", None)
            except Exception:  # noqa: BLE001 (no DTensor in this torch, or torch.distributed unusable)
                cls = None
            if cls is not None:
                break
        _DTENSOR.append(cls)
    return _DTENSOR[0] is not None and isinstance(x, _DTENSOR[0])


def _local_shape(t):
    """The shape of the tensor this rank holds of t (a DTensor's local tensor)."""
    return tuple(t.to_local().shape) if _is_dtensor(t) else tuple(t.shape)


def _placements_text(pls):
    return "(" + ", ".join(repr(pl) for pl in pls) + ")"


def _plain(x, p, what):
    """x, a DTensor's gradient or state, as the tensor this rank holds in the parameter p's layout: placed as p
    (to_local), placed otherwise but of p's global shape redistributed to p's placements first (a Partial
    gradient summed, a replicated state cut: a collective, which every rank holding p reaches, the placements
    being the same on all of them), else one ValueError line. A plain tensor stays as it is."""
    if not _is_dtensor(x):
        return x
    if not _is_dtensor(p):
        raise ValueError(f"distopt.record: {what} is a DTensor {_placements_text(x.placements)} but its parameter is "
                         f"a plain tensor")
    if tuple(x.placements) != tuple(p.placements) or x.device_mesh != p.device_mesh:
        if tuple(x.shape) != tuple(p.shape):
            raise ValueError(f"distopt.record: {what} is placed {_placements_text(x.placements)} with shape "
                             f"{list(x.shape)}, its parameter {_placements_text(p.placements)} with shape "
                             f"{list(p.shape)}: record it with layout= and its states= ranges (docs/verify.md)")
        x = x.redistribute(p.device_mesh, p.placements)
    return x.to_local()


def _lib_message(e):
    """A library error's line without its status name."""
    return e.message.split(": ", 1)[1] if ": " in e.message else e.message


def _layout_piece(shape, block=None, lo=0, length=-1, stage=-1, expert=-1):
    """The checked dopt_layout_piece (distopt/layout.h) of a piece of a parameter of `shape` (length -1: to the
    end of the block) and its block's element count (the tensor's without a block), or ValueError with the
    library's one line."""
    from . import _lib
    lp = _lib.LayoutPiece.new(block, lo, length, stage, expert)
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    try:
        _lib.call(_lib.lib.dopt_layout_piece_check, len(shape), dims, ctypes.byref(lp))
    except _lib.Error as e:
        raise ValueError(_lib_message(e)) from None
    return lp, int(_lib.lib.dopt_layout_piece_extent(len(shape), dims, ctypes.byref(lp)))


def _check_cover(params, everyone):
    """Every parameter's pieces over all ranks obey the layout rule (dopt_layout_cover, the one verify applies:
    one block dimension, disjoint or identical, covering, one stage, one expert): else one ValueError line
    naming the parameter, the ranks and the ranges."""
    from . import _lib
    pieces = {}
    for part in everyone:
        for pc in part["pieces"]:
            pieces.setdefault(pc["param"], []).append((part["rank"], pc))
    for prm in params:
        got = pieces.get(prm["name"], [])
        shape = [int(d) for d in prm["shape"]]
        arr = (_lib.LayoutPiece * max(1, len(got)))(*[
            _lib.LayoutPiece.new(pc.get("block"), pc["lo"], pc["len"], pc.get("stage", -1), pc.get("expert", -1))
            for _, pc in got])
        ranks = (ctypes.c_int * max(1, len(got)))(*[r for r, _ in got])
        dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        try:
            _lib.call(_lib.lib.dopt_layout_cover, prm["name"].encode(), len(shape), dims, arr, ranks, len(got), None)
        except _lib.Error as e:
            raise ValueError(f"distopt.record: {_lib_message(e)}") from None


def _total(everyone, key, total_key, given, every_piece):
    """The number of pipeline stages (key "stage") or experts ("expert") of the layout: `given` (stages=,
    experts=: every id below it) or one more than the largest id; 0 when no piece names one. Stages: a
    pipelined recording names every piece's. One ValueError line naming the rank, the parameter and the id."""
    ids = [(part["rank"], pc["param"], pc.get(key, -1)) for part in everyone for pc in part["pieces"]]
    named = [q for q in ids if q[2] >= 0]
    if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 1):
        raise ValueError(f"distopt.record: {total_key}={given!r} must be an integer >= 1")
    if every_piece and named and len(named) != len(ids):
        r, n, _ = next(q for q in ids if q[2] < 0)
        r2, n2, s2 = named[0]
        raise ValueError(f"distopt.record: rank {r}'s piece of {n} names no {key} but rank {r2}'s piece of {n2} is on "
                         f"{key} {s2} (a pipelined recording names every piece's {key})")
    if given is None:
        return 1 + max(q[2] for q in named) if named else 0
    for r, n, v in named:
        if v >= given:
            raise ValueError(f"distopt.record: layout of {n} on rank {r}: {key} {v} is outside [0, {given}) "
                             f"({total_key}={given})")
    if not named:
        raise ValueError(f"distopt.record: {total_key}={given} but no piece of layout= names its {key}")
    return given


def _placement(pl):
    """("R",), ("S", dim), ("SS", dim, split_factor) or ("P",) of a DTensor placement: a torch placement object
    (Shard, _StridedShard, Replicate, Partial) or its text ("R", "S(1)", "Shard(1)", "_S(0, 2)",
    "_StridedShard(dim=0, sf=2)", "P")."""
    if not isinstance(pl, str):
        name = type(pl).__name__
        if name == "_StridedShard" or name == "StridedShard":
            return ("SS", int(pl.dim), int(pl.split_factor))
        if name == "Shard":
            return ("S", int(pl.dim))
        if name == "Replicate":
            return ("R",)
        if "Partial" in name:
            return ("P",)
        raise ValueError(f"distopt.record: placement {pl!r}: expected Shard, _StridedShard, Replicate or Partial")
    name = pl.strip().replace(" ", "")
    if name in ("R", "Replicate()", "Replicate"):
        return ("R",)
    if name.startswith("P") and name.rstrip(")").split("(")[0] in ("P", "Partial"):
        return ("P",)
    for pre in ("_StridedShard(", "_S("):  # dim and split factor: "_S(0,2)", "_StridedShard(dim=0,sf=2)"
        if name.startswith(pre) and name.endswith(")"):
            args = [x.split("=")[-1] for x in name[len(pre):-1].split(",")]
            if len(args) == 2 and all(x.lstrip("-").isdigit() for x in args):
                return ("SS", int(args[0]), int(args[1]))
    for pre in ("S(", "Shard(dim=", "Shard("):
        if name.startswith(pre) and name.endswith(")") and name[len(pre):-1].lstrip("-").isdigit():
            return ("S", int(name[len(pre):-1]))
    raise ValueError(f"distopt.record: placement {pl!r}: expected Shard(d), _StridedShard(d, sf), Replicate() or "
                     f"Partial() (or S(d), _S(d, sf), R, P)")


def _chunk(n, k, c):
    """[lo, hi) of chunk c when n items are cut into k as torch.chunk does: chunks of ceil(n / k), the last
    ones shorter or empty."""
    size = -(-n // k)
    return min(n, size * c), min(n, size * (c + 1))


def _dtensor_indices(shape, mesh_shape, placements, coordinate, name):
    """The global indices this rank holds along every tensor dimension, in the local tensor's order: the
    placements applied left to right (mesh dimension 0 first), each cutting the indices the rank holds so far.
    Shard(d): chunk c of k (torch.chunk's rule). _StridedShard(d, sf) (FSDP2 over a dimension TP already split,
    torch's right-to-left sharding written left to right): the indices cut into sf chunks, each of those into k,
    and the rank's chunk c of every one of them, concatenated (the later Shard(d) picks one of them)."""
    idx = [list(range(n)) for n in shape]
    for i, pl in enumerate(placements):
        kind = _placement(pl)
        if kind[0] == "P":
            raise ValueError(f"distopt.record: dtensor_layout of {name}: placement {pl!r} on mesh dimension {i} is a "
                             f"partial sum, not a layout (reduce it first)")
        if kind[0] == "R":
            continue
        d = kind[1] + len(shape) if kind[1] < 0 else kind[1]
        if not 0 <= d < len(shape):
            raise ValueError(f"distopt.record: dtensor_layout of {name}: {pl!r} on a tensor of shape {shape}")
        k, c = int(mesh_shape[i]), int(coordinate[i])
        if not 0 <= c < k:
            raise ValueError(f"distopt.record: dtensor_layout of {name}: coordinate {c} outside mesh dimension {i} "
                             f"of size {k}")
        cur = idx[d]
        if kind[0] == "S":
            lo, hi = _chunk(len(cur), k, c)
            idx[d] = cur[lo:hi]
        else:
            sf = kind[2]
            if sf < 1:
                raise ValueError(f"distopt.record: dtensor_layout of {name}: {pl!r} has split factor {sf} (>= 1)")
            out = []
            for j in range(sf):
                plo, phi = _chunk(len(cur), sf, j)
                lo, hi = _chunk(phi - plo, k, c)
                out.extend(cur[plo + lo:plo + hi])
            idx[d] = out
    return idx


def dtensor_layout(name, shape, mesh_shape, placements, coordinate, **extra):
    """The layout= entry of the local tensor of a torch >= 2 DTensor (FSDP2's fully_shard parameters and tensor
    parallelism's are DTensors) from its metadata: the global `shape`, its device mesh's shape, its placements
    (one per mesh dimension) and this rank's mesh coordinate; extra: "stage", "expert", "states". The local
    tensor is what to_local() returns (unpadded). Shard(d) on mesh dimension i cuts dimension d as torch.chunk
    does (chunks of ceil(n / k), the last ones shorter or empty), nested when several mesh dimensions shard the
    same tensor dimension; _StridedShard(d, sf) as torch defines it (FSDP2 after TP on one dimension: with the
    TP Shard(d) after it, one contiguous block per rank); Replicate() copies. Returns None when the rank holds
    no element (an empty chunk). Refused in one line: Partial() (a pending sum is no layout), a rank's indices
    that are not one contiguous range along a dimension (a _StridedShard without the shard that completes it),
    and shards of two dimensions other than dimension 0 and one more (not one block and a flat range of it).
    docs/layout.md."""
    shape = [int(d) for d in shape]
    if coordinate is None:  # torch: a rank outside the mesh holds nothing
        return None
    if len(mesh_shape) != len(placements) or len(coordinate) != len(placements):
        raise ValueError(f"distopt.record: dtensor_layout of {name}: mesh {list(mesh_shape)}, {len(placements)} "
                         f"placements and coordinate {list(coordinate)} must have one entry per mesh dimension")
    idx = _dtensor_indices(shape, mesh_shape, placements, coordinate, name)
    if any(not ix for ix in idx):
        return None
    for d, ix in enumerate(idx):
        if ix != list(range(ix[0], ix[0] + len(ix))):
            raise ValueError(f"distopt.record: dtensor_layout of {name}: placements {list(placements)} at coordinate "
                             f"{list(coordinate)} give this rank indices {_ranges_text(ix)} of dimension {d}, not one "
                             f"contiguous range (no piece describes them)")
    box = [[ix[0], ix[0] + len(ix)] for ix in idx]
    split = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    spec = {"param": name, "shape": shape, **extra}
    if not split:
        return spec
    if len(split) > 2 or (len(split) == 2 and split[0] != 0):
        raise ValueError(f"distopt.record: dtensor_layout of {name}: dimensions {split} are split: a piece is one "
                         f"block and a flat range of it (dimension 0 and at most one other)")
    d = split[-1]
    spec["block"] = {"dim": d, "lo": box[d][0], "len": box[d][1] - box[d][0]}
    if len(split) == 2:  # rows [a, b) of dimension 0: a flat range of the block [outer, len, inner]
        per_row = _prod_dims(shape[1:d]) * spec["block"]["len"] * _prod_dims(shape[d + 1:])
        spec["lo"] = box[0][0] * per_row
        spec["len"] = (box[0][1] - box[0][0]) * per_row
    return spec


def _ranges_text(ix):
    """Sorted-order runs of an index list, "[0, 2) [4, 6)"."""
    runs, start = [], 0
    for j in range(1, len(ix) + 1):
        if j == len(ix) or ix[j] != ix[j - 1] + 1:
            runs.append(f"[{ix[start]}, {ix[j - 1] + 1})")
            start = j
    return " ".join(runs)


def _agree_forms(part):
    """The (parameter, form) of every gradient digest a rank's gathered construction record says it writes:
    the digests of one parameter are compared among the ranks of one form ("whole", or schema 5 the list of
    the rank's pieces of it)."""
    if not _AGREE_PIECES:
        return {(n, "whole") for n in part["agree"]}
    forms = {}
    for pc in part["pieces"]:
        whole = pc["whole"] and not pc.get("block")
        forms.setdefault(pc["param"], []).append("whole" if whole else
                                                 (pc["lo"], pc["len"], json.dumps(pc.get("block"), sort_keys=True)))
    out = {(n, tuple(f) if f != ["whole"] else "whole") for n, f in forms.items()}
    return out | {(n, "whole") for n in part["agree"] if n not in forms}


def _prod_dims(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _block_numel(shape, blk):
    """The elements of a tensor-parallel block {"dim", "lo", "len"} of a tensor of `shape`."""
    return _prod_dims(shape) // int(shape[int(blk["dim"])]) * int(blk["len"]) if shape else 1


def _sha256(t):
    """The SHA-256 of a contiguous CPU tensor's bytes (a gradient digest, 32 bytes)."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).digest()


def _sha256_all(ts):
    """The SHA-256 of several tensors' bytes one after the other."""
    h = hashlib.sha256()
    for t in ts:
        h.update(t.contiguous().numpy().tobytes())
    return h.digest()


class Recorder:
    """What record() returns: a context manager; close() flushes, writes the final index and restores `step`."""

    def __init__(self, optimizer, path, every=1, params=True, states=True, *, flush_every=16, names=None,
                 name=None, hparams=None, layout=None, start_step=None, grads="f32", grad_steps=None,
                 grad_agree=None, stages=None, experts=None, stage=None, construction_steps=None):
        import torch
        import torch.distributed as dist
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"distopt.record: every={every!r} must be an integer >= 1")
        if not isinstance(flush_every, int) or isinstance(flush_every, bool) or flush_every < 1:
            raise ValueError(f"distopt.record: flush_every={flush_every!r} must be an integer >= 1")
        if getattr(optimizer, "_distopt_recorder", None) is not None:
            raise RuntimeError("distopt.record: this optimizer is already being recorded (close the other recorder)")
        self.optimizer, self.path = optimizer, os.fspath(path)
        self.every, self.flush_every = every, flush_every
        self.want_params, self.want_states = bool(params), bool(states)
        if start_step is not None and (not isinstance(start_step, int) or isinstance(start_step, bool)
                                       or start_step < 0):
            raise ValueError(f"distopt.record: start_step={start_step!r} must be an integer >= 0")
        if grads not in ("f32", "bf16"):
            raise ValueError(f"distopt.record: grads={grads!r} must be 'f32' or 'bf16'")
        if grad_steps is not None and not callable(grad_steps):
            kept = set(int(t) for t in grad_steps)
            grad_steps = kept.__contains__
        self.grad_dtype, self.grad_steps = grads, grad_steps
        if construction_steps is not None:  # the framework's steps before training (a step at construction, a
            # warm-up): a window whose start is after them, the index saying they were no training steps
            if not isinstance(construction_steps, int) or isinstance(construction_steps, bool) or construction_steps < 0:
                raise ValueError(f"distopt.record: construction_steps={construction_steps!r} must be an integer >= 0")
            if start_step is None:
                start_step = construction_steps
            elif start_step < construction_steps:
                raise ValueError(f"distopt.record: start_step={start_step} counts every optimizer step before the "
                                 f"window, the construction_steps={construction_steps} among them")
        self.construction = construction_steps or 0
        self.start = start_step or 0
        self.clip_max, self.pre, self.clip_rec = None, None, None  # clip_grad_norm_
        self.closed = False
        self.t = self.start

        # the optimizer: ZeRO -> its inner optimizer; the distopt name and hyperparameters
        zero = None
        try:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                zero = optimizer
        except ImportError:
            pass
        inner = zero.optim if zero is not None else optimizer
        self.upstream = _qualname(inner) + (" under " + _qualname(zero) if zero is not None else "") + \
            getattr(inner, "_distopt_under", "")
        known = _known_name(inner)
        if name is None:
            name = known  # None: no distopt optimizer, recorded as it is for distopt.replay
        elif hparams is None and known != name:
            raise ValueError(f"distopt.record: name={name!r} for {_qualname(inner)} needs hparams= (distopt keys)")
        if name is not None and name not in _core.names():
            raise ValueError(f"distopt.record: {name!r} is not a distopt optimizer (known: {', '.join(_core.names())})")
        entry = _upstream.upstream_class(type(_unwrap(inner))) if known == name else None
        self.drop = set(entry.get("drop", ())) if entry else set()
        if entry and entry.get("differs"):  # a recognised class that computes otherwise (distopt._upstream)
            warnings.warn(f"distopt.record: {_qualname(inner)} differs from the {name} distopt matches: "
                          f"{entry['differs']}", stacklevel=3)
        # what a constructor puts in state before any step (APOLLOAdamW's per-parameter seed) is in `drop`
        if start_step is None and any(set(v) - self.drop for v in inner.state.values()):
            raise ValueError("distopt.record: the optimizer has stepped already (it holds state): pass start_step= "
                             "(the steps taken so far) to record a window, its states at the start recorded first, "
                             "or construction_steps= for steps the framework took before training (a step at "
                             "construction, a warm-up; docs/verify.md)")
        self.name = name
        self.projectors = bool(entry and entry.get("projector"))
        self.proj_seen = {}  # id(parameter) -> the projector tensor(s) last recorded
        self.groups = _Groups(name, hparams, zero if zero is not None else optimizer, inner)
        self.inner = inner

        # the process group
        self.pg = None
        self.rank, self.world = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.pg = zero.process_group if zero is not None else dist.group.WORLD
            self.rank, self.world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
            if dist.get_backend(self.pg) != "gloo":  # the recorder's few objects travel over a CPU group
                self.pg = dist.new_group(ranks=dist.get_process_group_ranks(self.pg)
                                         if hasattr(dist, "get_process_group_ranks") else None, backend="gloo")

        # parameters: global order, names, groups; this rank's pieces
        outer = zero if zero is not None else optimizer
        all_params = [p for g in outer.param_groups for p in g["params"]]
        group_of = {id(p): g for g, grp in enumerate(outer.param_groups) for p in grp["params"]}
        naming = self._names(names, all_params)
        self.outer = outer
        self.all_ids = [id(p) for p in all_params]
        self.dt_params = [p for p in all_params if _is_dtensor(p)]  # the same list on every rank of their mesh
        if grad_agree is None:
            grad_agree = self.world > 1
        # this rank's pieces; an error here is gathered, so that every rank raises the same line (none is left
        # waiting in the collective below while another has raised)
        err = None
        try:
            self.pieces, params_info = self._local_layout(layout, all_params, naming, group_of, zero, inner)
            if stage is not None:  # this rank's pipeline stage: every piece of it is on that stage
                if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                    raise ValueError(f"distopt.record: stage={stage!r} must be an integer >= 0")
                for pc in self.pieces:
                    if pc.stage not in (-1, stage):
                        raise ValueError(f"distopt.record: layout of {pc.name} names stage {pc.stage} but stage="
                                         f"{stage}")
                self.pieces = [pc._replace(stage=stage) for pc in self.pieces]
            self.local_shapes = [_local_shape(pc.tensor) for pc in self.pieces]  # the layout, checked every step
            for pc in self.pieces:
                _f32(_local(pc, pc.tensor), f"parameter {pc.name}")  # float32 only, before anything is written
        except (ValueError, TypeError) as e:
            self.pieces, params_info, self.local_shapes = [], [], []
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
        # the gradients whose digests every rank records (grad_agree/<t>/<p>, compared by verify): schema 4, the
        # whole gradients this rank holds (DDP replicas, ZeRO's all-reduced gradients, whole pieces of layout= or
        # of a replicated DTensor); schema 5 (_AGREE_PIECES), every piece's, compared among the ranks holding the
        # same piece (HSDP replicas, TP-replicated biases and norms)
        if _AGREE_PIECES:
            self.agree = [(pc, pc.name) for pc in self.pieces]
        elif layout is not None or self.dt_params:
            self.agree = [(pc, pc.name) for pc in self.pieces
                          if pc.block is None and pc.at is None and pc.lo == 0 and pc.len == pc.extent]
        else:
            self.agree = []
        if layout is None:  # plain parameters: whole on every rank, held as a piece or not (ZeRO, DDP)
            held = {id(pc.tensor) for pc, _ in self.agree}
            self.agree += [(p, naming[id(p)]) for p in all_params if not _is_dtensor(p) and id(p) not in held]

        # every rank's layout and parameters, at every rank (the same error everywhere)
        mine = {"rank": self.rank, "params": params_info, "error": err, "agree": [n for _, n in self.agree],
                "pieces": [{"param": pc.name, "lo": pc.lo, "len": pc.len, "states": pc.states, "block": pc.block,
                            "whole": pc.lo == 0 and pc.len == pc.extent, "stage": pc.stage, "expert": pc.expert}
                           for pc in self.pieces]}
        everyone = self._gather(mine)
        bad = [part for part in everyone if part["error"]]
        if bad:
            first = min(bad, key=lambda q: q["rank"])
            raise ValueError(first["error"] + (f" (rank {first['rank']}; {len(bad)} of {self.world} ranks refused)"
                                               if self.world > 1 else ""))
        # a digest compared with no other (no parameter whose digest two ranks record): none is recorded, and the
        # index says so (grad_agree false), rather than verify reporting a comparison that cannot happen
        holders = collections.Counter(f for part in everyone for f in _agree_forms(part))
        self.grad_agree = bool(grad_agree) and any(c >= 2 for c in holders.values())
        self.params, seen = [], {}
        for part in everyone:
            for n, shape, g in part["params"]:
                if n in seen:
                    if seen[n] != (shape, g):
                        raise ValueError(f"distopt.record: parameter {n}: rank {part['rank']} has shape {shape} group "
                                         f"{g}, another rank {seen[n][0]} group {seen[n][1]}")
                    continue
                seen[n] = (shape, g)
                self.params.append({"name": n, "shape": shape, "dtype": "F32", "group": g})
        self.stages = _total(everyone, "stage", "stages", stages, every_piece=True)
        self.experts = _total(everyone, "expert", "experts", experts, every_piece=False)
        _check_cover(self.params, everyone)  # every rank the same verdict: one line naming the parameter
        self.layouts = []
        for part in sorted(everyone, key=lambda q: q["rank"]):
            pcs = []
            for pc in part["pieces"]:
                e = {"param": pc["param"]}
                if pc.get("block"):
                    e["block"] = pc["block"]
                if not pc["whole"]:
                    e.update(lo=pc["lo"], len=pc["len"])
                if pc["states"]:
                    e["states"] = pc["states"]
                for k in ("stage", "expert"):
                    if pc.get(k, -1) >= 0:
                        e[k] = pc[k]
                pcs.append(e)
            self.layouts.append(pcs)
        self.torch = _torch_info(torch)

        # the directory: refused when it holds a recording already
        if os.path.exists(os.path.join(self.path, "index.json")):
            raise FileExistsError(f"distopt.record: {self.path} already holds a recording (index.json); "
                                  f"choose another path")
        os.makedirs(os.path.join(self.path, f"rank{self.rank}"), exist_ok=True)
        self.files = [[] for _ in range(self.world)]
        self.changes = []
        self.hp_sent, self.hp_flushed = 0, False  # changes sent to the other ranks so far
        self.hp_hist, self.hp_disagree = {}, None  # every rank's hyperparameters and changes; the first difference
        self.last_hp = self._read_groups()
        self.hp0 = [dict(h) for h in self.last_hp]
        if self.name is not None:
            _core.format_hparams(self.hp0[0])  # a value distopt cannot spell fails here, not at the first flush
        self.block = []  # (name, tensor) of the open block
        self.block_first = self.start + 1
        self.block.extend((f"init/{pc[1]}", _f32(_local(pc, pc[0]), f"parameter {pc[1]}")) for pc in self.pieces)
        if self.start:  # a window: the states at its start first
            self._snapshot(None)
        self._install()

    def _read_groups(self):
        return self.groups.read() if self.name is not None else self.groups.read_raw()

    def _local_layout(self, layout, all_params, naming, group_of, zero, inner):
        """This rank's pieces (_Piece, in the optimizer's parameter order) and the (name, global shape, group)
        of every parameter it knows; ValueError with one line."""
        pieces, params_info = [], []

        def add(p, spec, specs_is_list, group):
            gname, gshape = str(spec["param"]), [int(x) for x in spec["shape"]]
            blk = spec.get("block")
            if blk is not None:  # a tensor-parallel block: indices [lo, lo + len) of dimension dim
                blk = {"dim": int(blk["dim"]), "lo": int(blk["lo"]), "len": int(blk["len"])}
            n_local = _prod_dims(_local_shape(p))
            at = int(spec["at"]) if specs_is_list else None
            if at is not None:
                ln = int(spec["len"])
                if at < 0 or ln < 1 or at + ln > n_local:
                    raise ValueError(f"distopt.record: layout of {gname}: local elements [{at}, {at + ln}) are "
                                     f"outside the local tensor's {n_local}")
            else:  # the local tensor is the piece: its element count (a DTensor's local tensor's, not p.numel())
                ln = n_local
                if "len" in spec and int(spec["len"]) != n_local:
                    raise ValueError(f"distopt.record: layout of {gname}: len {int(spec['len'])} but the local "
                                     f"tensor has {n_local} elements")
            stage, expert = int(spec.get("stage", -1)), int(spec.get("expert", -1))
            try:
                lp, extent = _layout_piece(gshape, blk, int(spec.get("lo", 0)), ln, stage, expert)
            except ValueError as e:
                raise ValueError(f"distopt.record: layout of {gname}: {e}") from None
            st = {str(k): [int(v[0]), int(v[1])] for k, v in dict(spec.get("states", {})).items()}
            pieces.append(_Piece(p, gname, lp.lo, lp.len, st, extent, blk, at, stage, expert))
            params_info.append((gname, gshape, group))

        if layout is not None:
            for p in all_params:
                if not isinstance(layout, dict) or p not in layout:
                    raise ValueError(f"distopt.record: layout= has no entry for a parameter of shape {list(p.shape)}")
                spec = layout[p]
                if spec is None:  # this rank holds none of it (an empty shard: dtensor_layout's None)
                    continue
                specs = spec if isinstance(spec, (list, tuple)) else [spec]
                for sp in specs:  # a list: a flat buffer spanning several tensors, each piece at its offset "at"
                    add(p, sp, isinstance(spec, (list, tuple)), group_of[id(p)])
            return pieces, params_info
        owned = all_params
        if zero is not None:
            mine = {id(p) for g in inner.param_groups for p in g["params"]}
            owned = [p for p in all_params if id(p) in mine]
        for p in owned:
            if _is_dtensor(p):  # its layout from its mesh, placements and this rank's coordinate
                mesh = p.device_mesh
                spec = dtensor_layout(naming[id(p)], list(p.shape), tuple(mesh.mesh.shape), tuple(p.placements),
                                      mesh.get_coordinate())
                if spec is not None:
                    add(p, spec, False, group_of[id(p)])
            else:
                pieces.append(_Piece(p, naming[id(p)], 0, p.numel(), {}, p.numel(), None, None, -1, -1))
        params_info = [(naming[id(p)], list(p.shape), group_of[id(p)]) for p in all_params]
        return pieces, params_info

    # -- names --
    @staticmethod
    def _names(names, all_params):
        if names is None:
            return {id(p): f"param{i}" for i, p in enumerate(all_params)}
        pairs = names.named_parameters() if hasattr(names, "named_parameters") else (
            names.items() if isinstance(names, dict) else names)
        out = {}
        for a, b in pairs:
            n, p = (a, b) if isinstance(a, str) else (b, a)
            out[id(p)] = str(n)
        missing = [i for i, p in enumerate(all_params) if id(p) not in out]
        if missing:
            raise ValueError(f"distopt.record: names= does not name the optimizer's parameter {missing[0]} (shape "
                             f"{list(all_params[missing[0]].shape)})")
        used = [out[id(p)] for p in all_params]
        for n in used:
            if not n or len(n.encode()) > 255 or any(ord(ch) < 0x20 for ch in n):
                raise ValueError(f"distopt.record: parameter name {n!r}: 1..255 bytes without control characters")
        if len(set(used)) != len(used):
            raise ValueError("distopt.record: names= gives two parameters the same name")
        return out

    # -- collectives --
    def _gather(self, obj):
        if self.pg is None:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    # -- the step wrapper --
    def _install(self):
        opt = self.optimizer
        self._had_own_step = "step" in opt.__dict__
        self._orig_step = opt.step
        rec = self

        def step(*args, **kwargs):
            return rec._step(args, kwargs)

        # what others marked on the step they wrapped stays visible (an lr scheduler's _with_counter)
        step.__dict__.update(getattr(self._orig_step, "__dict__", {}))
        step.__wrapped__ = self._orig_step
        opt.step = step
        opt._distopt_recorder = self

    def _restore(self):
        opt = self.optimizer
        if self._had_own_step:
            opt.step = self._orig_step
        else:
            opt.__dict__.pop("step", None)
        opt.__dict__.pop("_distopt_recorder", None)

    def _local_grads(self):
        """id(DTensor parameter) -> its gradient as this rank holds it in the parameter's layout (_plain), for
        every DTensor parameter in the optimizer's order: a gradient placed otherwise is redistributed, a
        collective every rank of the mesh reaches, holding a piece or not (an empty shard)."""
        return {id(p): _plain(p.grad, p, f"the gradient of {p.__class__.__name__} {list(p.shape)}")
                for p in self.dt_params if p.grad is not None}

    def _grads(self):
        """The pieces' gradients [(name, tensor)], and with grad_agree the digests of the gradients this rank
        records them of (grad_agree/<t>/<p>, filled in by _grad_tensors; self.agree: pieces, or parameters
        held whole without a piece)."""
        dt = self._local_grads()
        out, by_piece = [], {}  # by_piece: id(piece) -> its gradient's copy
        for pc in self.pieces:
            p, n = pc[0], pc[1]
            if p.grad is not None:
                out.append((n, _f32(_local(pc, dt.get(id(p), p.grad)), f"the gradient of {n}")))
                by_piece[id(pc)] = out[-1][1]
        agree, digests = [], {}
        for x, n in self.agree if self.grad_agree else ():
            if isinstance(x, _Piece):
                g = by_piece.get(id(x))
            else:  # a parameter held whole, as a piece or not (ZeRO: every rank's all-reduced gradient)
                g = None if x.grad is None else _f32(dt.get(id(x), x.grad), f"the gradient of {n}")
            if g is not None:
                digests.setdefault(n, []).append(g)
        for n, gs in digests.items():  # a rank's pieces of one parameter: one digest of them in order
            agree.append((n, _sha256(gs[0]) if len(gs) == 1 else _sha256_all(gs)))
        return out, agree

    def _grad_tensors(self, t, both):
        """Step t's gradient tensors: F32, BF16 (grads="bf16": rounded to nearest even), or for a step outside
        grad_steps only the SHA-256 of the piece's F32 bytes (grad_digest/<t>/<p>, 32 U8); then the digests of
        the whole gradients (grad_agree/<t>/<p>, 32 U8)."""
        import torch
        grads, agree = both
        return self._piece_grads(t, grads) + [(f"grad_agree/{t}/{n}", torch.tensor(list(d), dtype=torch.uint8))
                                              for n, d in agree]

    def _piece_grads(self, t, grads):
        import torch
        if self.grad_steps is not None and not self.grad_steps(t):
            out = []
            for n, g in grads:
                d = _sha256(g)
                out.append((f"grad_digest/{t}/{n}", torch.tensor(list(d), dtype=torch.uint8)))
            return out
        if self.grad_dtype == "bf16":
            return [(f"grad/{t}/{n}", g.to(torch.bfloat16)) for n, g in grads]
        return [(f"grad/{t}/{n}", g) for n, g in grads]

    def _check_layout(self, t):
        """The layout recorded at construction still holds at step t: the same parameters in the same order, each
        local tensor its shape (a resharded or replaced parameter needs a new recording); one ValueError line."""
        ids = [id(p) for g in self.outer.param_groups for p in g["params"]]
        if ids != self.all_ids:
            raise ValueError(f"distopt.record: step {t}: the optimizer's parameters changed since the recording began "
                             f"({len(ids)} tensors, {len(self.all_ids)} then): a layout cannot change mid-recording "
                             f"(close this recorder, start another)")
        for pc, shape in zip(self.pieces, self.local_shapes):
            if _local_shape(pc.tensor) != shape:
                raise ValueError(f"distopt.record: step {t}: the local tensor of {pc.name} has shape "
                                 f"{list(_local_shape(pc.tensor))}, {list(shape)} when the recording began: a layout cannot "
                                 f"change mid-recording (close this recorder, start another)")

    def _step(self, args, kwargs):
        if self.closed:
            return self._orig_step(*args, **kwargs)
        t = self.t + 1
        self._check_layout(t)
        hp = self._read_groups()
        for g, (old, new) in enumerate(zip(self.last_hp, hp)):
            for k in sorted(set(old) | set(new)):
                if old.get(k) != new.get(k):
                    v = new.get(k)
                    self.changes.append({"step": t, "group": g, "key": k,
                                         "value": None if v is None else (v if isinstance(v, bool) else float(v))})
        self.last_hp = hp
        out, grads = self._run_step(args, kwargs)
        self.t = t
        if self.pre is not None:  # clipped this step (clip_grad_norm_): the gradients before, the clip's record
            self.block.extend(self._clip_tensors(t, grads[0]))
            grads = self.pre
        self.pre = None
        self.block.extend(self._grad_tensors(t, grads))
        if self.projectors:
            self._projectors(t)
        if t % self.every == 0:
            self._snapshot(t)
        if t - self.block_first + 1 >= self.flush_every:
            self._flush()
        return out

    def _run_step(self, args, kwargs):
        """The wrapped step run; (its result, the gradients it took: _grads())."""
        closure = args[0] if args else kwargs.get("closure")
        if closure is None:
            grads = self._grads()
            out = self._orig_step(*args, **kwargs)
        else:
            box = []

            def wrapped():
                loss = closure()
                box[:] = [self._grads()]  # the last evaluation's gradients are the ones the update used
                return loss

            if args:
                args = (wrapped,) + tuple(args[1:])
            else:
                kwargs = dict(kwargs, closure=wrapped)
            out = self._orig_step(*args, **kwargs)
            grads = box[0] if box else ([], [])
        return out, grads

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2.0, clip=None, **kw):
        """Clips the gradients as torch.nn.utils.clip_grad_norm_ (or `clip`, the framework's or your own
        function of (parameters, max_norm, **kw) returning the total norm it computed and applying its
        coefficient) and records the gradients before clipping, the total norm returned, the coefficient
        fp32(min(1, max_norm / (norm + 1e-6))) and, at the step, the SHA-256 of each clipped gradient piece. Call it
        between backward() and step() on every rank; returns the clip's total norm. `distopt verify` checks the
        norm against the exact norm of the recorded gradient, the coefficient against the norm and each clipped
        piece against the piece times the coefficient, and replays the clipping itself (docs/verify.md)."""
        import torch
        if norm_type not in (2, 2.0):
            raise ValueError(f"distopt.record: clip_grad_norm_(norm_type={norm_type!r}): only the 2-norm is recorded")
        if not (isinstance(max_norm, (int, float)) and not isinstance(max_norm, bool) and 0 < float(max_norm) < float("inf")):
            raise ValueError(f"distopt.record: clip_grad_norm_(max_norm={max_norm!r}): a finite number > 0")
        if self.grad_dtype != "f32":
            raise ValueError("distopt.record: clip_grad_norm_ with grads='bf16': the clipped gradients' check needs "
                             "the F32 gradients")
        if self.clip_max is not None and float(max_norm) != self.clip_max:
            raise ValueError(f"distopt.record: clip_grad_norm_(max_norm={max_norm!r}): this recording clips at "
                             f"{self.clip_max!r} (one max_norm a recording)")
        if self.closed:
            return (clip or torch.nn.utils.clip_grad_norm_)(parameters, max_norm, **kw)
        self.clip_max = float(max_norm)
        self.pre = self._grads()
        total = (clip or torch.nn.utils.clip_grad_norm_)(parameters, max_norm, **kw)
        norm = total.full_tensor() if _is_dtensor(total) else total
        norm = torch.as_tensor(norm, dtype=torch.float32).detach().to("cpu").reshape(())
        # the coefficient the clip applied: torch's max_norm / (norm + 1e-6) (a Python float over a tensor: a
        # reciprocal times max_norm), or a true division (DeepSpeed's tensor over tensor): _clip_tensors chooses
        self.clip_rec = (norm.clone(), [torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0),
                                        torch.clamp(torch.tensor(float(max_norm)) / (norm + 1e-6), max=1.0)])
        return total

    def _clip_tensors(self, t, clipped):
        """clip/<t>/norm, clip/<t>/coef and clipped_digest/<t>/<p> (each piece's gradient as the step took it).
        clip_rec holds the norm and the candidate coefficients (the arithmetic of the clips met so far); the one
        recorded makes the first non-empty piece's clipped gradient from its gradient before (self.pre; verify checks
        every piece's), else the first candidate."""
        import torch
        norm, cands = self.clip_rec
        coef = cands[0]
        for (_, g0), (_, g1) in zip(self.pre[0], clipped):
            if g0.numel():
                coef = next((c for c in cands if torch.equal(g0 * c, g1)), cands[0])
                break
        return [(f"clip/{t}/norm", norm), (f"clip/{t}/coef", coef)] + [
            (f"clipped_digest/{t}/{n}", torch.tensor(list(_sha256(g)), dtype=torch.uint8)) for n, g in clipped]

    def _projector_of(self, p):
        """galore_torch's projector of p: {distopt state name: tensor}, empty before its first refresh."""
        obj = self.inner.state.get(p, {}).get("projector")
        m = getattr(obj, "ortho_matrix", None)
        if m is None:
            return {}
        if isinstance(m, (list, tuple)):  # proj_type="full": [A, B]
            return {"projector_left": m[0], "projector_right": m[1]}
        return {"projector": m}

    def _projectors(self, t):
        """The projectors refreshed by step t (a new ortho_matrix object): proj/<t>/<p>/<key>."""
        for p, n, *_ in self.pieces:
            cur = self._projector_of(p)
            seen = self.proj_seen.get(id(p), {})
            if cur and any(seen.get(k) is not v for k, v in cur.items()):
                for k, v in cur.items():
                    self.block.append((f"proj/{t}/{n}/{k}", _f32(v, f"the projector of {n}")))
                self.proj_seen[id(p)] = dict(cur)

    def _snapshot(self, t):
        """Parameters and states after step t; t None: a window's start (init_state/<p>/<key>; the parameters
        are init/<p>)."""
        import torch
        # the DTensor parameters' states as this rank holds them in the parameter's layout, for every DTensor
        # parameter (a state placed otherwise is redistributed: a collective, reached by every rank of the mesh)
        dt_states = {}
        if self.want_states or t is None:
            for p in self.dt_params:
                for key, v in self.inner.state.get(p, {}).items():
                    if _is_dtensor(v) and str(key) != "step":
                        dt_states[(id(p), str(key))] = _plain(v, p, f"state {key} of a parameter of shape "
                                                                    f"{list(p.shape)}")
        for pc in self.pieces:
            p, n = pc[0], pc[1]
            if self.want_params and t is not None:
                self.block.append((f"param/{t}/{n}", _f32(_local(pc, p), f"parameter {n}")))
            if not self.want_states and t is not None:
                continue
            base = f"state/{t}/{n}" if t is not None else f"init_state/{n}"
            items = []
            for key, v in self.inner.state.get(p, {}).items():  # a list of tensors (SOAP's GG, Q: one per
                # dimension, [] where none) as key0, key1, ...
                if isinstance(v, (list, tuple)) and all(torch.is_tensor(x) or x == [] for x in v):
                    items += [(f"{key}{i}", x) for i, x in enumerate(v) if torch.is_tensor(x)]
                else:
                    items.append((key, v))
            for key, v in items:
                k = str(key)
                if not k or "/" in k or len(k) > 63 or k in self.drop:
                    continue
                v = dt_states.get((id(p), k), v)
                if k == "step":  # upstream's type kept: a tensor (torch AdamW) as F32, an int as I64
                    if _is_dtensor(v):
                        v = v.to_local()
                    if torch.is_tensor(v):
                        self.block.append((f"{base}/step", torch.tensor(float(v.item()), dtype=torch.float32)))
                    else:
                        self.block.append((f"{base}/step", torch.tensor(int(v), dtype=torch.int64)))
                elif torch.is_tensor(v) and v.dtype == torch.float32 and not v.is_sparse:
                    if pc[7] is not None and v.numel() == _prod_dims(_local_shape(p)):  # elementwise, of a flat
                        # buffer: the piece's
                        v = _local(pc, v)
                    self.block.append((f"{base}/{k}", v.detach().to("cpu", copy=True).contiguous()))
                elif isinstance(v, (float, int)) and not isinstance(v, bool):  # a Python number state (an
                    # optimizer's running scalar, ColossalAI's int RMS): 0-d F32
                    self.block.append((f"{base}/{k}", torch.tensor(float(v), dtype=torch.float32)))
            if t is None and self.projectors:
                cur = self._projector_of(p)
                for k, v in cur.items():
                    self.block.append((f"{base}/{k}", _f32(v, f"the projector of {n}")))
                self.proj_seen[id(p)] = dict(cur)

    def _flush(self, final=False):
        last = self.t
        if last >= self.block_first:
            rel = f"rank{self.rank}/{self.block_first:09d}-{last:09d}.safetensors"
            meta = {"kind": KIND, "rank": self.rank, "first_step": self.block_first, "last_step": last}
            _write_safetensors(os.path.join(self.path, rel), self.block, meta)
            entry = {"path": rel, "first_step": self.block_first, "last_step": last}
        else:
            entry = None
        self.block = []
        self.block_first = last + 1
        hp = {"first": self.hp0 if not self.hp_flushed else None, "changes": self.changes[self.hp_sent:]}
        self.hp_sent, self.hp_flushed = len(self.changes), True
        parts = self._gather({"rank": self.rank, "file": entry, "t": last, "hp": hp})
        if len({p["t"] for p in parts}) != 1:
            raise RuntimeError(f"distopt.record: the ranks are at different steps "
                               f"({', '.join(str(p['t']) for p in parts)}): every rank must step the optimizer")
        self._check_hparams(parts)
        for p in parts:
            if p["file"] is not None:
                self.files[p["rank"]].append(p["file"])
        if self.rank == 0:
            self._write_index(complete=final)

    def _check_hparams(self, parts):
        """Every rank's hyperparameters and changes agree with rank 0's, which the index keeps and verify
        replays. The first difference (the earliest step, then the lowest rank) goes into the index
        (hparam_disagreement: verify's verdict `hparams` at that step) and is one warning line on every rank."""
        for p in parts:
            h = self.hp_hist.setdefault(p["rank"], {"first": None, "changes": []})
            if p["hp"]["first"] is not None:
                h["first"] = p["hp"]["first"]
            h["changes"].extend(p["hp"]["changes"])
        if self.hp_disagree is not None or len(parts) < 2:
            return
        ref = self.hp_hist[0]

        def value(h, step, g, k):  # the value in effect at step (its changes before it applied)
            v = (h["first"][g] if g < len(h["first"]) else {}).get(k)
            for c in h["changes"]:
                if c["step"] <= step and c["group"] == g and c["key"] == k:
                    v = c["value"]
            return v

        found = None
        for r in sorted(self.hp_hist)[1:]:
            h = self.hp_hist[r]
            steps = sorted({self.start + 1} | {c["step"] for c in h["changes"] + ref["changes"]})
            keys = sorted({(g, k) for hh in (h, ref) for g, grp in enumerate(hh["first"]) for k in grp}
                          | {(c["group"], c["key"]) for c in h["changes"] + ref["changes"]})
            for t in steps:
                diff = [(g, k) for g, k in keys if value(h, t, g, k) != value(ref, t, g, k)]
                if diff:
                    g, k = diff[0]
                    if found is None or t < found["step"]:
                        found = {"step": t, "rank": r, "group": g, "key": k, "value": value(h, t, g, k),
                                 "rank0_value": value(ref, t, g, k)}
                    break
        if found is not None:
            self.hp_disagree = found
            warnings.warn(f"distopt.record: rank {found['rank']}'s hyperparameters differ from rank 0's at step "
                          f"{found['step']}: group {found['group']} {found['key']} = {found['value']!r}, rank 0's "
                          f"{found['rank0_value']!r} (the recording keeps rank 0's; verify names it)", stacklevel=3)

    def _write_index(self, complete):
        index = {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "generator": "distopt.record (python)",
            "optimizer": {"name": self.name, "upstream": self.upstream},
            "groups": [{"hparams": _core.format_hparams(h) if self.name is not None else ""} for h in self.hp0],
            "params": self.params,
            "torch": self.torch,
            "world_size": self.world,
            "record": {"every": self.every, "params": self.want_params, "states": self.want_states,
                       "flush_every": self.flush_every, "grads": "BF16" if self.grad_dtype == "bf16" else "F32",
                       "projectors": self.projectors, "grad_agree": self.grad_agree,
                       **({"clip": {"max_norm": self.clip_max, "norm_type": 2}} if self.clip_max else {})},
            **({"construction_steps": self.construction} if self.construction else {}),
            "ranks": [{"rank": r, "pieces": self.layouts[r], "files": self.files[r]} for r in range(self.world)],
            **({"stages": self.stages} if self.stages else {}),
            **({"experts": self.experts} if self.experts else {}),
            **({"hparam_disagreement": self.hp_disagree} if self.hp_disagree is not None else {}),
            "start_step": self.start,
            "steps": max((f["last_step"] for f in self.files[0]), default=self.start),
            "complete": bool(complete),
            "hparam_changes": self.changes,
        }
        _write_json_atomic(os.path.join(self.path, "index.json"), index)

    def close(self):
        """Writes the open block and the final index ("complete": true) and restores the optimizer's step. In a
        distributed job every rank must call it (a collective)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._flush(final=True)
        finally:
            self._restore()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        # an exception: restore the optimizer; a single process also writes what it has (an interrupted
        # prefix); a distributed job does not meet in a collective another rank may never reach
        self.closed = True
        try:
            if self.pg is None:
                self._flush(final=False)
        finally:
            self._restore()
        return False


def record(optimizer, path, every=1, params=True, states=True, **kw):
    """Records `optimizer`'s steps into the directory `path` for `distopt verify` (a Recorder: a context manager).

    every:        parameters and states are recorded after every `every`-th step (gradients after every step)
    params, states: record parameters / optimizer states (upstream's keys) at those steps
    flush_every:  steps per file (memory holds at most one block; the index follows each file)
    names:        a Module (its named_parameters), a dict or (name, parameter) pairs; default param0, param1, ...
    name, hparams: the distopt optimizer and its hyperparameters (a dict, or one per param group) for an
                  optimizer distopt does not know by class
    layout:       {local tensor: {"param": global name, "shape": global shape, "lo": first flat element,
                  "block": {"dim", "lo", "len"}, "states": {key: (lo, len)}}} for a hand-written sharded optimizer
                  (docs/verify.md); "block": the local tensor is the tensor-parallel block of indices [lo, lo + len)
                  of dimension dim (a column-parallel weight: dim 0, a row-parallel one: dim 1), "lo" then a flat
                  offset in the block; a list of specs for one local tensor: a flat buffer spanning several
                  tensors, each spec with "at" (its first element in the local tensor) and "len"; the ranks'
                  pieces must be disjoint or identical and cover each parameter (checked here, one line naming the
                  parameter and the ranges)
    start_step:   record a window of a run under way: the steps taken so far; the parameters and states now are
                  recorded first (init/, init_state/) and the steps are numbered from start_step + 1
    grads:        "f32" (default) or "bf16" (gradients rounded to bf16: half the size, lossy, docs/verify.md)
    grad_steps:   the steps whose gradients are kept (a container or a callable t -> bool); the others keep only
                  the SHA-256 of each gradient (verify --stepwise skips them); default: every step
    grad_agree:   each rank also records the SHA-256 of every whole gradient it holds (grad_agree/<t>/<p>: DDP
                  replicas, ZeRO's all-reduced gradients, whole tensors of layout=), and verify checks that every
                  rank's equals the lowest rank's (a ZeRO run without gradient synchronisation is named);
                  default: on when torch.distributed runs with more than one rank
    stage, stages: a pipeline: this rank's stage (every piece it records is on it; or "stage" in layout=
                  entries) and the number of stages (default: one more than the largest stage named)
    experts:      the number of experts when layout= entries name an "expert" id
    construction_steps: steps the framework's optimizer took before training (a step at construction, a warm-up):
                  a window starting after them, named as such for distopt.twin (docs/verify.md)
    Clipping: call rec.clip_grad_norm_(params, max_norm) where the training clips: the gradients are recorded
    before clipping with the norm and coefficient, and verify checks and replays the clip. A DeepSpeed engine (or
    its optimizer with names=) is recorded unchanged, its clipping included (distopt._deepspeed).
    An optimizer class distopt does not implement (no mapping, no name=) is recorded as it is: its states under
    its own keys, its groups' numeric values as hyperparameter changes, for distopt.replay.
    """
    from . import _deepspeed
    if _deepspeed.is_deepspeed(optimizer):  # an engine or its ZeRO optimizer: pieces from DeepSpeed's own map
        return _deepspeed.recorder(optimizer, path, every, params, states, **kw)
    return Recorder(optimizer, path, every, params, states, **kw)
