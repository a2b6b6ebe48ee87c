"""distopt.Optimizer: a torch.optim.Optimizer whose step is the C reference (imported only with torch)."""
import collections
import collections.abc
import types
import ctypes

import torch

from . import _lib, _upstream
from ._core import Handle

# dopt_dtype code -> torch dtype
_TORCH = {0: torch.float32, 1: torch.float64, 2: torch.bfloat16, 3: torch.float16, 4: torch.int32, 5: torch.int64,
          6: torch.uint8, 7: torch.int8}


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_param(p, where):
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"distopt: {where} is a {type(p).__name__}, not a torch.Tensor")
    if p.dtype not in _DTYPES:
        raise TypeError(f"distopt: {where} is {p.dtype}; parameters are float32, bfloat16 or float16")
    if p.device.type != "cpu":
        raise TypeError(f"distopt: {where} is on {p.device}; only CPU tensors are supported")
    if p.layout != torch.strided:
        raise ValueError(f"distopt: {where} is not a dense (strided) tensor")
    if p.numel() == 0:
        raise ValueError(f"distopt: {where} is empty")


def _mode(d):
    """How the library holds d: 0 its fp32 storage, stepped in place; 1 its bf16 storage as the working copy of
    an fp32 master kept here, written by every step (the master follows elements written outside); 2 a staged
    fp32 copy (fp16, non-contiguous) copied in and out around each step."""
    if d.is_contiguous() and d.dtype == torch.float32:
        return 0
    return 1 if d.is_contiguous() and d.dtype == torch.bfloat16 else 2


def _register(h, group, d, st, name):
    """d (a parameter's data) registered in group of handle h as _mode(d) says; st: its _stage_for."""
    if st is None:
        h.add_param(group, d.data_ptr(), d.shape, name)
    elif _mode(d) == 1:
        h.add_param(group, d.data_ptr(), d.shape, name, master=st.data_ptr())
    else:
        h.add_param(group, st.data_ptr(), d.shape, name)


def _stage_for(d):
    """None when the library can step d's storage itself (fp32, contiguous); else the fp32 contiguous tensor
    it steps instead: the fp32 master of a bf16/fp16 parameter (kept across steps, written back rounded to
    nearest even after each), or the shadow of a non-contiguous fp32 one (channels_last: copied in and out)."""
    if d.dtype == torch.float32 and d.is_contiguous():
        return None
    return torch.empty(d.shape, dtype=torch.float32).copy_(d)


def _storage_bytes(t):
    """Bytes of the storage under t (torch 1.13: typed storage; newer: untyped)."""
    us = getattr(t, "untyped_storage", None)
    return us().nbytes() if us is not None else t.storage().nbytes()


def _check_storage(t, where):
    """t's elements lie inside its storage (a storage resized smaller under a registered tensor would be
    read and written out of bounds by the library)."""
    need = (t.storage_offset() + t.numel()) * t.element_size()
    have = _storage_bytes(t)
    if have < need:
        raise _lib.invalid(f"{where}: its storage holds {have} bytes, the tensor needs {need} (resized under "
                           f"the optimizer?)")


def _tensor_at(dtype, shape, address, nbytes):
    """A torch tensor holding a copy of `nbytes` bytes at `address`."""
    if nbytes == 0:
        return torch.zeros(shape, dtype=_TORCH[dtype])
    buf = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(buf, dtype=_TORCH[dtype]).clone().reshape(shape)


class Optimizer(torch.optim.Optimizer):
    """A registry optimizer (distopt.list()) as a torch.optim.Optimizer over fp32 CPU contiguous tensors.

        opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)
        loss.backward(); opt.step(); opt.zero_grad()

    Zero-copy: the library updates each parameter's storage in place (its address is registered once);
    gradients are read from p.grad (None: the parameter is skipped, as torch does). Hyperparameters take
    upstream's names where distopt's differ (betas for beta1/beta2; distopt/_upstream.py) or distopt's;
    param_groups hold upstream's. A change to a group's value (an lr scheduler) applies at the next step().
    state_dict() returns copies of the states under upstream's keys; load_state_dict() takes this class's or
    the upstream class's state_dict (e.g. torch.optim.AdamW's). Library errors raise distopt.Error.
    """

    def __init__(self, name, params, **hparams):
        if params is None or isinstance(params, (torch.Tensor, dict, str, bytes)):
            raise _lib.invalid(f"distopt.Optimizer({name!r}): params is "
                               f"{'None' if params is None else type(params).__name__}; pass an iterable of "
                               f"tensors or of param-group dicts (model.parameters(), [{{'params': ...}}])")
        values, kept = _upstream.to_distopt(name, hparams)  # kept: upstream keys with no effect (foreach=...)
        self._h = Handle(name, values)  # validates the defaults (distopt.Error)
        self._dname = name
        self._create = dict(values)
        self._known = set(self._h.keys(values))
        self._params, self._addr, self._keep, self._stage = [], [], [], []
        self._cgroups, self._applied = [], []
        self._group0 = self._h.read_group(0, values)
        defaults = _upstream.to_upstream(name, self._group0)
        defaults.update(kept)
        super().__init__(params, defaults)

    def _overrides(self, values):
        """The values that differ from group 0's (a wrapper's optimizer-wide keys may not be overridden)."""
        return {k: v for k, v in values.items() if k not in self._group0 or not _same(self._group0[k], v)}

    @property
    def name(self):
        return self._dname

    @property
    def state(self):
        """{parameter: {"step": ..., upstream state key: tensor}} as torch optimizers keep it: read-only copies of
        the library's states taken now (an assignment or an in-place write raises one line; load_state_dict()
        writes states); {} for a parameter before its first step."""
        return _States(self)

    @state.setter
    def state(self, value):  # torch's Optimizer.__init__ assigns an empty defaultdict: the library keeps states
        if value:
            raise AttributeError("distopt.Optimizer.state is read-only: use load_state_dict()")

    def __repr__(self):
        lines = [f"distopt.Optimizer({self._dname!r}) ("]
        for i, group in enumerate(self.param_groups):
            n = len(group["params"])
            lines.append(f"Parameter Group {i} ({n} parameter{'s' if n != 1 else ''})")
            for key in sorted(k for k in group if k != "params"):
                lines.append(f"    {key}: {group[key]}")
        lines.append(")")
        return "\n".join(lines)

    def __getstate__(self):
        raise TypeError("distopt.Optimizer cannot be pickled or deep-copied (the C library owns its states); "
                        "save state_dict() instead")

    # ---- groups and parameters ----------------------------------------------------------------------

    def add_param_group(self, param_group):
        if not isinstance(param_group, dict):
            raise TypeError("distopt: a param group must be a dict")
        given, kept_given = _upstream.to_distopt(self._dname, param_group)
        values, kept = _upstream.to_distopt(self._dname, self.defaults)
        values.update(given)
        kept.update(kept_given)  # upstream keys with no effect (foreach=...): in the group as given
        group = _upstream.to_upstream(self._dname, values)
        group.update(kept)
        group["params"] = param_group["params"]
        n_before = len(self.param_groups)
        super().add_param_group(group)  # torch's checks: tensors, leaves, no parameter in two groups
        touched = False
        try:
            plist = group["params"]
            snaps = [p.detach() for p in plist]  # read once: another thread may reassign p.data meanwhile
            for k, d in enumerate(snaps):
                _check_param(d, f"param_groups[{n_before}] parameter {k}")
                _check_storage(d, f"distopt: param_groups[{n_before}] parameter {k}")
            stages = [_stage_for(d) for d in snaps]
            cg = _in_group(n_before, self._h.add_group, self._overrides(values))  # validated by the library
            touched = True
            applied = self._h.read_group(cg, values)
            for k, (d, st) in enumerate(zip(snaps, stages)):
                _register(self._h, cg, d, st, f"param_groups[{n_before}][{k}]")
        except BaseException:
            del self.param_groups[n_before:]
            if touched:  # the library has the group (and maybe some of its parameters): rebuild without them
                self._rebuild([dict(a) for a in self._applied], None)
            raise
        self._known.update(values)
        for p, d, st in zip(plist, snaps, stages):
            self._params.append(p)
            self._stage.append(st)
            self._addr.append((d.data_ptr(), tuple(d.shape), _mode(d), d.dtype))
            self._keep.append(d)  # keeps this storage alive while the library holds its address
        self._cgroups.append(cg)
        self._applied.append(applied)
        for k, v in _upstream.to_upstream(self._dname, applied).items():
            if k not in kept:
                group[k] = v

    def _group_values(self, group):
        values, _ = _upstream.to_distopt(self._dname, group, self._known)
        return values

    def _sync(self):
        """Applies param_groups' values changed since the last step (an lr schedule) and re-registers
        parameters whose storage moved (p.data = ...)."""
        for gi, group in enumerate(self.param_groups):
            applied = self._applied[gi]
            for k, v in _in_group(gi, self._group_values, group).items():
                if k not in applied or not _same(applied[k], v):
                    _in_group(gi, self._h.set, self._cgroups[gi], k, v)
                    applied[k] = self._h.get(self._cgroups[gi], k)
        moved = False
        for i, p in enumerate(self._params):
            d = p.detach()  # one read of p.data
            _check_storage(d, f"distopt: parameter {i}")
            ptr, shape, mode, dtype = self._addr[i]
            now = _mode(d)
            if now != mode or (now < 2 and d.data_ptr() != ptr) or tuple(d.shape) != shape or d.dtype != dtype:
                _check_param(d, f"parameter {i}")
                if tuple(d.shape) != shape:
                    raise ValueError(f"distopt: parameter {i} changed shape from {shape} to {tuple(d.shape)}")
                if (now == 0) != (mode == 0) or d.dtype != dtype:  # another kind of storage: a new master
                    self._stage[i] = _stage_for(d)
                moved = True  # the master of a bf16 parameter that moved is kept: it follows the new values
        if moved:
            self._rebuild([dict(a) for a in self._applied], None)

    def _rebuild(self, group_values, states):
        """A new handle: the same defaults, these group values, every parameter at its current address, and
        `states` (per parameter None or (step, {distopt state name: tensor}, id in the state_dict)), or when
        None the current states and clock. Replaces the old handle only when all of it succeeded."""
        h = Handle(self._dname, self._create)
        snaps = [p.detach() for p in self._params]  # read once: registered and kept are the same storage
        try:
            cgroups = [_in_group(gi, h.add_group, self._overrides(v)) for gi, v in enumerate(group_values)]
            k = 0
            for gi, group in enumerate(self.param_groups):
                for j in range(len(group["params"])):
                    d, st = snaps[k], self._stage[k]
                    _check_storage(d, f"distopt: param_groups[{gi}] parameter {j}")
                    _register(h, cgroups[gi], d, st, f"param_groups[{gi}][{j}]")
                    k += 1
            if states is None:
                for i in range(len(self._params)):
                    exported = self._h.export_state(i)
                    if exported is not None:
                        h.import_state(i, exported)
                h.set_gstep(self._h.get_gstep())
                if self._h.get_mode():  # the parameters still hold the evaluation point
                    h.declare_mode(True)
            else:
                for i, st in enumerate(states):
                    if st is not None:
                        _import_tensors(h, i, st)
            applied = [h.read_group(cg, v) for cg, v in zip(cgroups, group_values)]
        except BaseException:
            h.close()
            raise
        old, self._h = self._h, h
        old.close()
        self._cgroups, self._applied = cgroups, applied
        self._addr = [(d.data_ptr(), tuple(d.shape), _mode(d), d.dtype) for d in snaps]
        self._keep = snaps

    # ---- step ------------------------------------------------------------------------------------------

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad(), self._h.lock:  # one step at a time on this optimizer (threads serialised)
            self._sync()
            keep, addrs, back, bf16 = [], [], [], []
            for i, p in enumerate(self._params):
                g = p.grad
                bf16.append(False)
                if g is None:
                    addrs.append(None)
                    continue
                if g.is_sparse or g.dtype not in (torch.float32, p.dtype) or g.device.type != "cpu":
                    raise TypeError(f"distopt: the gradient of parameter {i} is {g.dtype} on {g.device}"
                                    f"{' (sparse)' if g.is_sparse else ''}; dense CPU gradients, fp32 or the "
                                    f"parameter's dtype")
                if g.shape != p.shape:
                    raise ValueError(f"distopt: the gradient of parameter {i} has shape {tuple(g.shape)}, "
                                     f"the parameter {tuple(p.shape)}")
                mode = self._addr[i][2]
                if mode == 1 and g.dtype == torch.bfloat16 and g.is_contiguous():
                    bf16[i] = True  # widened by the library, exactly
                else:
                    g = g.float().contiguous()  # bf16/fp16 -> fp32 exactly
                _check_storage(g, f"distopt: the gradient of parameter {i}")
                keep.append(g)
                addrs.append(g.data_ptr())
                self._stage_in(i, p, back)
            self._h.step(addrs, bf16)
            for d, st in back:
                d.copy_(st)  # to bf16/fp16: round to nearest even (fp16 overflows to inf); fp32: exact
        return loss

    def _stage_in(self, i, p, back):
        """A staged parameter (mode 2: fp16, non-contiguous): its stage takes the values written outside, and
        (d, stage) joins `back`, copied back after the library changed the stage."""
        st = self._stage[i]
        if st is None or self._addr[i][2] != 2:
            return
        d = p.detach()
        if d.dtype == torch.float32:
            st.copy_(d)  # a non-contiguous fp32 parameter: its values, exactly
        else:
            r = st.to(d.dtype)
            if not torch.equal(r, d):  # written outside: those elements' masters follow them
                ch = r != d
                st[ch] = d[ch].float()
        back.append((d, st))

    def train(self, mode=True):
        """Train mode (mode False: evaluation mode), for an optimizer whose parameters hold a different point in
        each (adamw_schedulefree, as schedulefree's optimizer.train()/.eval()): every parameter that has stepped
        moves to the other point. Others: distopt.Error (DOPT_ERR_UNSUPPORTED). step() in evaluation mode is
        refused. Returns self."""
        with torch.no_grad(), self._h.lock:
            self._sync()
            back = []
            for i, p in enumerate(self._params):
                self._stage_in(i, p, back)
            self._h.set_mode(not mode)
            for d, st in back:
                d.copy_(st)
        return self

    def eval(self):
        """Evaluation mode: train(False)."""
        return self.train(False)

    def counters(self, param=None):
        """What the steps did, {name: count} since creation (docs/api.md "Counters": steps,
        galore.refreshes, muon.ns, q8.steps, ...): of one parameter (a tensor of the groups, or its index), or
        summed over all of them (None)."""
        with torch.no_grad():
            self._sync()
            if param is None:
                out = {}
                for i in range(len(self._params)):
                    for k, v in self._h.counters(i)[1].items():
                        out[k] = out.get(k, 0) + v
                return out
            if isinstance(param, int):
                i = param
            else:
                i = next((k for k, q in enumerate(self._params) if q is param), None)
                if i is None:
                    raise ValueError("distopt: counters(param): the tensor is not a parameter of this optimizer")
            if not 0 <= i < len(self._params):
                raise IndexError(f"distopt: counters({i}): {len(self._params)} parameters")
            return self._h.counters(i)[1]

    # ---- state_dict ------------------------------------------------------------------------------------

    def state_dict(self):
        """{"state": {i: {"step": ..., key: tensor}}, "param_groups": [...]} as the upstream class writes it:
        parameter i numbered group by group, upstream's state keys and step type; tensors are copies."""
        state = {}
        for i in range(len(self._params)):
            st = self._param_state(i)
            if st is not None:
                state[i] = st
        groups, k = [], 0
        for group in self.param_groups:
            packed = {key: v for key, v in group.items() if key != "params"}
            packed["params"] = list(range(k, k + len(group["params"])))
            _to_group(self._dname, packed, [state.get(j) for j in packed["params"]], self._h.get_mode())
            k += len(group["params"])
            groups.append(packed)
        sd = {"state": state, "param_groups": groups}
        if self._h.spec.wrapper:  # a wrapper's schedule runs on the optimizer's clock
            sd["distopt"] = {"gstep": self._h.get_gstep()}
        return sd

    def _param_state(self, i):
        """Parameter i's {"step", upstream key: tensor copy}, or None before its first step."""
        views = self._h.views(i)
        if not views:
            return None
        step = self._h.get_step(i)
        st = {"step": torch.tensor(float(step)) if _upstream.entry(self._dname)["step"] == "tensor" else step}
        for n, d, shape, addr, nbytes in views:
            st[_upstream.state_key(self._dname, n)] = _tensor_at(d, shape, addr, nbytes)
        if self._stage[i] is not None and self._params[i].dtype != torch.float32:
            st["master"] = self._stage[i].clone()  # the fp32 weights a bf16/fp16 parameter rounds from
        return st

    def load_state_dict(self, state_dict):
        """Loads this class's or the upstream class's state_dict: the same groups with the same numbers of
        parameters; their hyperparameters, each parameter's states (checked by name, dtype and shape) and
        step. Nothing changes unless all of it loads."""
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), (list, tuple)) \
                or not isinstance(state_dict.get("state"), dict):
            raise _lib.invalid(f"distopt {self._dname}: a state_dict is a dict with 'state' (a dict) and "
                               f"'param_groups' (a list); got {type(state_dict).__name__}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(f"distopt: the state_dict has {len(saved)} parameter groups, the optimizer "
                             f"{len(self.param_groups)}")
        index, values, rests, group_of = {}, [], [], {}
        k = 0
        for gi, (sg, og) in enumerate(zip(saved, self.param_groups)):
            if len(sg["params"]) != len(og["params"]):
                raise ValueError(f"distopt: group {gi} of the state_dict has {len(sg['params'])} parameters, "
                                 f"the optimizer's {len(og['params'])}")
            for j, pid in enumerate(sg["params"]):
                index[pid] = k + j
                group_of[pid] = sg
            k += len(og["params"])
            if not isinstance(sg, dict) or "params" not in sg:
                raise _lib.invalid(f"distopt {self._dname}: param_groups[{gi}] of the state_dict is not a dict "
                                   f"with 'params'")
            v, rest = _in_group(gi, _upstream.to_distopt, self._dname, sg, self._known)
            base = dict(self._applied[gi])
            base.update(v)
            values.append(base)
            rests.append(rest)
        states = [None] * len(self._params)
        masters = {}
        for pid, st in state_dict["state"].items():
            if pid not in index:
                raise ValueError(f"distopt: the state_dict has a state for parameter {pid}, which no group lists")
            states[index[pid]] = _from_upstream_state(self._dname, st, pid, group_of[pid])
            k = index[pid]
            m = states[k][1].pop("master", None)  # a bf16/fp16 parameter's fp32 master (else ignored)
            if m is not None and self._stage[k] is not None and self._params[k].dtype != torch.float32:
                m = torch.as_tensor(m)
                if m.shape != self._stage[k].shape:
                    raise ValueError(f"distopt: the master of parameter {pid} has shape {tuple(m.shape)}, the "
                                     f"parameter {tuple(self._stage[k].shape)}")
                masters[k] = m
        gstep = None
        if "distopt" in state_dict and "gstep" in state_dict["distopt"]:
            gstep = _lib.count(state_dict["distopt"]["gstep"], "the state_dict's distopt.gstep")
        self._rebuild(values, states)
        mode_key = _upstream.entry(self._dname).get("group_mode")
        if mode_key and saved and mode_key in saved[0]:  # saved in eval mode: the weights loaded are x
            self._h.declare_mode(not saved[0][mode_key])
        for k, m in masters.items():
            self._stage[k].copy_(m)
        if gstep is not None:
            self._h.set_gstep(gstep)
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            group.clear()
            group.update(_upstream.to_upstream(self._dname, self._applied[gi]))
            group.update(rests[gi])
            group["params"] = params

    def state_bytes(self):
        """(allocated, full): the exact optimizer-state memory now and once every parameter has stepped."""
        return self._h.state_bytes(-1)


_READ_ONLY = ("distopt.Optimizer.state holds read-only copies of the library's states (a write would change "
              "nothing): write states with load_state_dict()")


def _in_place(func):
    """Whether a torch function writes into its first argument (add_, copy_, __setitem__, __iadd__, ...)."""
    name = getattr(func, "__name__", "") or ""
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        (name.startswith("__i") and name.endswith("__") and name not in ("__index__", "__int__", "__invert__"))


class _ReadOnlyState(torch.Tensor):
    """A state tensor of Optimizer.state: a copy of the library's, readable as any tensor (its operations give
    plain tensors); an in-place write raises RuntimeError with one line instead of being lost."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if _in_place(func):
            raise RuntimeError(_READ_ONLY)
        disable = getattr(torch._C, "DisableTorchFunctionSubclass", None) or torch._C.DisableTorchFunction
        with disable():
            return func(*args, **(kwargs or {}))


class _States(collections.abc.Mapping):
    """Optimizer.state: parameter -> its states, copied when looked up (only that parameter's), read-only (a
    mapping that takes no assignment; tensors whose in-place writes raise); {} for a parameter before its first
    step, as torch's defaultdict gives."""

    def __init__(self, opt):
        self._o = opt
        self._index = {id(p): i for i, p in enumerate(getattr(opt, "_params", ()))}

    def __getitem__(self, p):
        i = self._index.get(id(p))
        st = None if i is None else self._o._param_state(i)
        if st is None:
            return types.MappingProxyType({})
        return types.MappingProxyType({k: v.as_subclass(_ReadOnlyState) if torch.is_tensor(v) else v
                                       for k, v in st.items()})

    def __iter__(self):
        for i, p in enumerate(getattr(self._o, "_params", ())):
            if self._o._h.views(i):
                yield p

    def __len__(self):
        return sum(1 for _ in self)

    def __contains__(self, p):
        i = self._index.get(id(p))
        return i is not None and bool(self._o._h.views(i))


def _in_group(gi, fn, *args):
    """fn(*args), its errors prefixed with the group they concern, numbered as param_groups is."""
    try:
        return fn(*args)
    except _lib.Error as e:  # "DOPT_ERR_X: detail" -> "DOPT_ERR_X: param_groups[i]: detail"
        head = f"{e.status_name}: "
        rest = e.message[len(head):] if e.message.startswith(head) else e.message
        raise _lib.Error(e.status, e.status_name, f"{head}param_groups[{gi}]: {rest}") from None
    except ValueError as e:
        raise ValueError(f"param_groups[{gi}]: {e}") from None


def _same(a, b):
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if a is None or b is None:
        return a is None and b is None
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _to_group(name, packed, states, eval_mode):
    """An upstream that keeps per group what distopt keeps per parameter (_upstream TABLE group_states,
    group_step, group_mode): the group's values from its first parameter with state, its mode as upstream's
    flag."""
    e = _upstream.entry(name)
    if "group_mode" in e:
        packed[e["group_mode"]] = not eval_mode
    first = next((st for st in states if st is not None), None)
    if first is None:
        return
    for c_key, g_key in e.get("group_states", {}).items():
        packed[g_key] = float(first[_upstream.state_key(name, c_key)])
    if "group_step" in e:
        packed[e["group_step"]] = int(first["step"])


def _from_upstream_state(name, st, pid, group):
    if not isinstance(st, dict):
        raise _lib.invalid(f"distopt: the state of parameter {pid} is a {type(st).__name__}, not a dict")
    e = _upstream.entry(name)
    if "step" not in st and "group_step" in e and e["group_step"] in group:  # upstream's group clock
        st = dict(st, step=group[e["group_step"]])
    if "step" not in st and not e.get("step_optional"):
        raise ValueError(f"distopt: the state of parameter {pid} has no 'step'")
    step = _lib.count(st.get("step", 0), f"the step of parameter {pid}")
    reverse = {up: c for c, up in e["states"].items()}
    drop = e.get("drop", ())
    tensors = {}
    for key, v in st.items():
        if key != "step" and key not in drop:
            tensors[reverse.get(key, key)] = v
    for c_key, g_key in e.get("group_states", {}).items():  # kept per group upstream
        if c_key not in tensors and g_key in group:
            tensors[c_key] = torch.tensor(float(group[g_key]), dtype=torch.float64)
    return step, tensors, pid


def _import_tensors(h, i, st):
    step, tensors, pid = st
    h.init_state(i)
    views = h.views(i)
    extra = set(tensors) - {v[0] for v in views}
    if extra:
        raise ValueError(f"distopt {h.name}: the state of parameter {pid} has {sorted(extra)}, which "
                         f"{h.name} with these hyperparameters does not keep")
    for n, d, shape, addr, nbytes in views:
        if n not in tensors:
            raise ValueError(f"distopt {h.name}: the state of parameter {pid} lacks '{n}'")
        t = tensors[n]
        t = t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        want = _TORCH[d]
        if t.dtype != want:
            if not (t.is_floating_point() and want.is_floating_point):
                raise ValueError(f"distopt {h.name}: state '{n}' of parameter {pid} is {t.dtype}, expected {want}")
            t = t.to(want)
        if tuple(t.shape) != shape:
            raise ValueError(f"distopt {h.name}: state '{n}' of parameter {pid} has shape {tuple(t.shape)}, "
                             f"expected {shape}")
        t = t.to("cpu").contiguous()
        ctypes.memmove(addr, t.data_ptr(), nbytes)
    h.set_step(i, step)


__all__ = ["Optimizer"]
