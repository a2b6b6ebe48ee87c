"""distopt.replay: verify a recorded run (distopt.record) against your own single-device torch optimizer.

    res = distopt.replay("run.rec", lambda params: MyOptimizer(params, lr=1e-3))    # a VerifyResult
    res = distopt.replay("run.rec", make, stepwise=True, rtol=1e-6)                  # teacher-forced

make_optimizer(params) gets the recording's parameters (torch.nn.Parameter, in the index's order, with their
initial values; params.named() gives (name, parameter) pairs, params["name"] one of them) and returns the
optimizer that is the reference: typically the single-device version of the sharded optimizer that was
recorded. The replay steps it on the recording's logical gradients (assembled from the ranks' pieces), applies
the recorded hyperparameter changes (an lr schedule) to its param_groups, and writes what it computed at the
recorded steps into a reference recording; `distopt verify RUN --reference REF` then compares every recorded
parameter and state, per rank and piece, with it: the same comparison, table, JSON and SVG as verify against
the C reference (docs/verify.md). States are matched by name through the optimizer's own state_dict.

stepwise=True: before each step the optimizer takes the recorded parameters and states of the step before
(its state_dict's tensors overwritten in place), so each comparison is one step's rounding and the verdict
names the step where the two computations first parted.

Command line (Python; the C tool does not embed Python):
    python3 -m distopt.replay RUN.rec MODULE:FUNCTION [--stepwise] [--rtol X] [--json FILE] [--plot FILE.svg]
"""
import json
import os
import sys
import tempfile

from . import _upstream
from ._safetensors import read_torch
from .record import KIND, SCHEMA_VERSION, _block_numel, _prod_dims, _torch_info, _write_json_atomic
from ._safetensors import write as _write_safetensors
from .verify import run_verify

__all__ = ["replay", "Params"]


class Params(list):
    """The recording's parameters in index order; named() -> (name, parameter) pairs; p["name"] by name."""

    def __init__(self, names, tensors):
        super().__init__(tensors)
        self.names = list(names)
        self._by = dict(zip(self.names, tensors))

    def named(self):
        return list(zip(self.names, self))

    def __getitem__(self, k):
        return self._by[k] if isinstance(k, str) else list.__getitem__(self, k)


class _Recording:
    """A recording read back (index.json, one loaded file per rank), assembled as verify assembles it."""

    def __init__(self, path):
        path = os.fspath(path)
        self.dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        with open(os.path.join(self.dir, "index.json")) as f:
            self.ix = json.load(f)
        ix = self.ix
        if ix.get("kind") != KIND or ix.get("schema_version") not in range(1, SCHEMA_VERSION + 1):
            raise ValueError(f"distopt.replay: {self.dir}: not a distopt recording of schema 1..{SCHEMA_VERSION}")
        self.start, self.steps = int(ix.get("start_step", 0)), int(ix["steps"])
        self.every = int(ix["record"]["every"])
        self.params = ix["params"]
        self.numel = {p["name"]: _prod_dims(p["shape"]) for p in self.params}
        self.shape = {p["name"]: [int(d) for d in p["shape"]] for p in self.params}
        self.pieces = {}  # name -> [(rank, lo, len, states, block)] in rank order
        for r, rk in enumerate(ix["ranks"]):
            for pc in rk["pieces"]:
                n = pc["param"]
                blk = pc.get("block")
                extent = self.numel[n] if blk is None else _block_numel(self.shape[n], blk)
                lo, ln = int(pc.get("lo", 0)), int(pc.get("len", extent))
                self.pieces.setdefault(n, []).append((r, lo, ln, pc.get("states", {}), blk))
        self.sources = {}  # the lowest rank of identical pieces supplies the values (as verify)
        for n, pcs in self.pieces.items():
            seen = set()
            key = lambda q: (_block_key(q[4]), q[1], q[2])  # noqa: E731
            self.sources[n] = [pc for pc in sorted(pcs, key=lambda q: (key(q), q[0]))
                               if not (key(pc) in seen or seen.add(key(pc)))]
        self.loaded = {}  # rank -> (file index, {name: tensor})

    def file(self, r, t):
        files = self.ix["ranks"][r]["files"]
        k = next((i for i, f in enumerate(files) if f["first_step"] <= t <= f["last_step"]), None)
        if k is None:
            raise ValueError(f"distopt.replay: rank {r} has no file holding step {t}")
        if self.loaded.get(r, (None,))[0] != k:
            self.loaded[r] = (k, read_torch(os.path.join(self.dir, files[k]["path"])))
        return self.loaded[r][1]

    def assemble(self, name, t, key):
        """Parameter `name`'s flat tensor `key` (init/, param/<t>/, grad/<t>/) from its source pieces; None when
        absent; "digest" when only grad_digest/ is there."""
        import torch
        out = torch.empty(self.numel[name], dtype=torch.float32)
        found = 0
        for r, lo, ln, _, blk in self.sources[name]:
            f = self.file(r, t)
            x = f.get(key)
            if x is None:
                if key.startswith("grad/") and f"grad_digest/{key[5:]}" in f:
                    return "digest"
                continue
            out[_piece_index(self.shape[name], lo, ln, blk)] = x.reshape(-1).to(torch.float32)
            found += 1
        return out if found else None

    def state(self, name, t, key, n):
        """State `key` of parameter `name` after step t (t = start: init_state/) over all ranks' ranges, the
        lowest rank's value where they overlap; n: its element count (None: from the ranges). None when no rank
        records it; (tensor, shape of a whole recorded piece or None)."""
        import torch
        tname = f"init_state/{name}/{key}" if t == self.start else f"state/{t}/{name}/{key}"
        got = []
        for r, lo, ln, declared, blk in self.pieces[name]:
            x = self.file(r, self.start + 1 if t == self.start else t).get(tname)
            if x is None:
                continue
            whole = blk is None and lo == 0 and ln == self.numel[name]
            if key in declared:
                a, b = declared[key]
                idx = torch.arange(a, a + b)
            elif whole:
                a, b = 0, x.numel()
                idx = torch.arange(a, a + b)
            else:  # elementwise: the piece's own elements
                idx = _piece_index(self.shape[name], lo, ln, blk)
            got.append((idx, x, whole))
        if not got:
            return None
        if n is None:
            n = max(int(idx.max()) + 1 if idx.numel() else 0 for idx, _, _ in got)
        out, mask = torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.bool)
        for idx, x, _ in got:
            if (idx.numel() and int(idx.max()) >= n) or x.numel() != idx.numel():
                raise ValueError(f"distopt.replay: {tname}: its {x.numel()} elements do not fit the state's {n}")
            sel = ~mask[idx]
            out[idx[sel]] = x.reshape(-1).to(torch.float32)[sel] if x.dtype != torch.int64 else 0
            mask[idx] = True
        if not bool(mask.all()):
            raise ValueError(f"distopt.replay: {tname}: element {int((~mask).nonzero()[0])} of {n} is recorded by "
                             f"no rank (the replay cannot start from it)")
        whole_shape = tuple(got[0][1].shape) if len(got) == 1 and got[0][2] else None
        return out, whole_shape

    def step_count(self, name, t):
        """The recorded step count of `name` after step t: (value, is_int) or None."""
        tname = f"init_state/{name}/step" if t == self.start else f"state/{t}/{name}/step"
        for r, *_ in self.pieces[name]:
            x = self.file(r, self.start + 1 if t == self.start else t).get(tname)
            if x is not None:
                return x.item(), x.dtype == __import__("torch").int64
        return None

    def recorded_after(self, t):
        rec = self.ix["record"]
        return t == self.start or (rec.get("params") and rec.get("states") and t % self.every == 0)


class _Writer:
    """A one-rank recording's tensor files: (name, tensor) pairs of steps first.., written as a file of their
    block when flush(last) is called (rank0/<first>-<last>.safetensors); files: the index's list."""

    def __init__(self, out, first, flush_every):
        self.out, self.first, self.flush_every = out, first, flush_every
        self.block, self.files = [], []
        os.makedirs(os.path.join(out, "rank0"), exist_ok=True)

    def add(self, name, tensor):
        self.block.append((name, tensor))

    def after_step(self, t):
        if t - self.first + 1 >= self.flush_every:
            self.flush(t)

    def flush(self, last):
        if last >= self.first:
            rel = f"rank0/{self.first:09d}-{last:09d}.safetensors"
            _write_safetensors(os.path.join(self.out, rel), self.block,
                               {"kind": KIND, "rank": 0, "first_step": self.first, "last_step": last})
            self.files.append({"path": rel, "first_step": self.first, "last_step": last})
        self.block, self.first = [], last + 1


def _block_key(blk):
    return (-1, 0, 0) if blk is None else (int(blk["dim"]), int(blk["lo"]), int(blk["len"]))


def _piece_index(shape, lo, ln, blk):
    """The parameter's flat indices of a piece's elements: [lo, lo + ln) of the tensor, or of the block
    (the tensor seen as [outer, dim, inner], indices [blk.lo, blk.lo + blk.len) of the middle one)."""
    import torch
    if blk is None:
        return torch.arange(lo, lo + ln)
    d = int(blk["dim"])
    outer, inner = _prod_dims(shape[:d]), _prod_dims(shape[d + 1:])
    idx = torch.arange(_prod_dims(shape)).reshape(outer, int(shape[d]), inner)
    return idx[:, int(blk["lo"]):int(blk["lo"]) + int(blk["len"]), :].reshape(-1)[lo:lo + ln]


def _set_change(group, name, key, value):
    """A recorded hyperparameter change in the optimizer's param_groups: upstream keys as they are (an as-is
    recording), distopt keys through distopt._upstream's table (beta1 -> betas[0])."""
    if name is not None:
        for dkey, up, pos in _upstream.entry(name)["group"]:
            if dkey == key and up in group:
                if pos is None:
                    group[up] = value
                else:
                    t = list(group[up])
                    t[pos] = value
                    group[up] = tuple(t)
                return
    if key in group:
        group[key] = type(group[key])(value) if isinstance(group[key], (bool, int, float)) else value


def _force(rec, opt, params, t, strict):
    """The optimizer's parameters and states := those recorded after step t (t = start: the window's start)."""
    import torch
    with torch.no_grad():
        for p, name in zip(params, params.names):
            if t > rec.start:
                x = rec.assemble(name, t, f"param/{t}/{name}")
                if x is None:
                    raise ValueError(f"distopt.replay: --stepwise: no param/{t}/{name} (the state to start step "
                                     f"{t + 1} from)")
                p.copy_(x.reshape(p.shape))
            sc = rec.step_count(name, t)
            if sc is None:
                continue  # the recorded run had no state for it yet
            st = opt.state[p]
            keys = set(k for k, v in st.items() if torch.is_tensor(v) and v.dtype == torch.float32 and k != "step")
            if strict or not st:  # what the recording holds at a window's start
                f = rec.file(rec.pieces[name][0][0], t + 1 if t == rec.start else t)
                pre = f"init_state/{name}/" if t == rec.start else f"state/{t}/{name}/"
                keys |= {k[len(pre):] for k in f if k.startswith(pre) and k[len(pre):] != "step"}
            for k in sorted(keys):
                cur = st.get(k)
                got = rec.state(name, t, k, cur.numel() if torch.is_tensor(cur) else None)
                if got is None:
                    continue
                val, shape = got
                if torch.is_tensor(cur):
                    cur.copy_(val.reshape(cur.shape))
                else:
                    st[k] = val.reshape(p.shape if val.numel() == p.numel() else (shape or (-1,))).clone()
            v, is_int = sc
            cur = st.get("step")
            if torch.is_tensor(cur):
                cur.fill_(v)
            else:
                st["step"] = int(v) if (is_int or cur is not None) else torch.tensor(float(v))


def replay(recording, make_optimizer, stepwise=False, rtol=None, json_path=None, plot=None, cli=None, work=None,
           timeout=None):
    """Replays `recording` through make_optimizer(params) and verifies it (`distopt verify --reference`);
    returns a VerifyResult (returncode 0 within tolerance, 1 diverged, 2 bad input). work: a folder for the
    reference recording (default: a temporary one, removed)."""
    import torch
    rec = _Recording(recording)
    ix = rec.ix
    name = ix["optimizer"].get("name")
    tensors = []
    for p in rec.params:
        x = rec.assemble(p["name"], rec.start + 1, f"init/{p['name']}")
        if x is None:
            raise ValueError(f"distopt.replay: no init/{p['name']} in the recording")
        tensors.append(torch.nn.Parameter(x.reshape(p["shape"]).clone()))
    params = Params([p["name"] for p in rec.params], tensors)
    opt = make_optimizer(params)
    order = [p for g in opt.param_groups for p in g["params"]]
    known = {id(p) for p in params}
    if any(id(p) not in known for p in order):
        raise ValueError("distopt.replay: make_optimizer's optimizer holds a tensor that is not one of the params")
    index_of = {id(p): i for i, p in enumerate(order)}
    group_of = {id(p): g for g, grp in enumerate(opt.param_groups) for p in grp["params"]}
    changes = {}
    for ch in ix.get("hparam_changes", []):
        changes.setdefault(int(ch["step"]), []).append(ch)
    tmp = tempfile.TemporaryDirectory(prefix="distopt-replay-") if work is None else None
    out = os.path.join(tmp.name if tmp else os.fspath(work), "reference.rec")
    flush = int(ix["record"].get("flush_every", 16))
    wr = _Writer(out, rec.start + 1, flush)
    for n, p in params.named():
        wr.add(f"init/{n}", p.detach().clone())
    synced = True
    if rec.start:
        _force(rec, opt, params, rec.start, True)
    not_replayed = 0
    for t in range(rec.start + 1, rec.steps + 1):
        if stepwise and t - 1 > rec.start and rec.recorded_after(t - 1):
            _force(rec, opt, params, t - 1, False)
            synced = True
        for ch in changes.get(t, []):
            g = ch["group"]
            if g < len(opt.param_groups):
                _set_change(opt.param_groups[g], name, ch["key"], ch["value"])
        grads = [rec.assemble(n, t, f"grad/{t}/{n}") for n in params.names]
        digest = any(isinstance(g, str) for g in grads)
        if digest and not stepwise:
            raise ValueError(f"distopt.replay: step {t} keeps only gradient digests: the accumulated replay needs "
                             f"every step's gradient (stepwise=True replays the steps whose gradients are kept)")
        if digest or (stepwise and not synced):
            not_replayed += 1
            synced = False
        else:
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.reshape(p.shape)
            opt.step()
            if t % rec.every == 0:
                sd = opt.state_dict()["state"]
                for n, p in params.named():
                    wr.add(f"param/{t}/{n}", p.detach().clone())
                    for k, v in sd.get(index_of.get(id(p), -1), {}).items():
                        k = str(k)
                        if k == "step":
                            s = v.item() if torch.is_tensor(v) else v
                            wr.add(f"state/{t}/{n}/step", torch.tensor(float(s), dtype=torch.float32)
                                   if torch.is_tensor(v) else torch.tensor(int(s), dtype=torch.int64))
                        elif torch.is_tensor(v) and v.dtype == torch.float32 and "/" not in k and 0 < len(k) <= 63:
                            wr.add(f"state/{t}/{n}/{k}", v.detach().clone().contiguous())
        wr.after_step(t)
    wr.flush(rec.steps)
    index = {
        "schema_version": SCHEMA_VERSION, "kind": KIND, "generator": "distopt.replay (python)",
        "optimizer": {"name": name, "upstream": f"{type(opt).__module__}.{type(opt).__qualname__}"},
        "groups": ix["groups"], "params": ix["params"], "torch": _torch_info(torch), "world_size": 1,
        "record": {"every": rec.every, "params": True, "states": True, "flush_every": flush},
        "ranks": [{"rank": 0, "pieces": [{"param": n} for n in params.names], "files": wr.files}],
        "start_step": rec.start, "steps": rec.steps, "complete": True,
    }
    _write_json_atomic(os.path.join(out, "index.json"), index)
    try:
        extra = ["--reference", out] + (["--stepwise"] if stepwise else [])
        res = run_verify(recording, extra, cli, rtol, json_path, plot, timeout)
        res.not_replayed = not_replayed
        return res
    finally:
        if tmp:
            tmp.cleanup()


def main(argv=None):
    import argparse
    import importlib
    ap = argparse.ArgumentParser(prog="python3 -m distopt.replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("recording")
    ap.add_argument("factory", help="MODULE:FUNCTION, called with the parameters, returning the optimizer")
    ap.add_argument("--stepwise", action="store_true")
    ap.add_argument("--rtol", type=float)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args(argv)
    mod, _, fn = a.factory.partition(":")
    if not mod or not fn:
        ap.error(f"factory {a.factory!r}: expected MODULE:FUNCTION")
    sys.path.insert(0, os.getcwd())
    make = getattr(importlib.import_module(mod), fn)
    res = replay(a.recording, make, stepwise=a.stepwise, rtol=a.rtol, json_path=a.json, plot=a.plot)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
