#!/usr/bin/env python3
"""Convert distopt checkpoints (docs/checkpoints.md) to torch optimizer state_dicts and back.

    ckpt_torch.py to-torch CKPT OUT.pt      # CKPT: a checkpoint directory (follows `latest`) or CKPT/step-N
    ckpt_torch.py from-torch IN.pt CKPT     # writes a new generation of CKPT
    ckpt_torch.py show CKPT                 # the index: optimizer, groups, tensors

Supported optimizers and their upstream classes:

    adamw      torch.optim.AdamW
    adafactor  transformers.optimization.Adafactor (HF)
    came       came_pytorch.CAME

OUT.pt / IN.pt is a dict (torch.save):
    "optimizer":    the upstream state_dict ({"state": {i: {...}}, "param_groups": [...]}), parameter i
                    numbered as torch numbers them (group by group, in the order of each group's members)
    "param_names":  the name of parameter i in that numbering
    "params":       {name: fp32 tensor} (the master weights of bf16 parameters)
    "bf16":         {name: bf16 tensor}, the working copies of bf16 parameters
    "distopt":      what the state_dict cannot hold (global step, optimizer clock, skipped steps, layers),
                    used by from-torch when present

State keys are upstream's, which are distopt's (docs/optimizers.md); `step` is a float32 0-d tensor for
AdamW (torch >= 1.12 keeps it so) and an int for Adafactor and CAME, as upstream. Needs the stdlib, torch
and distopt's Python package (its safetensors reader and writer: the library's, which validates every
header; found installed or in this source tree's python/, with the library as distopt finds it).
"""
import functools
import hashlib
import json
import os
import stat
import sys

import torch

try:
    from distopt import _safetensors as st_io
except ImportError:  # not installed: the package of this source tree
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))
    from distopt import _safetensors as st_io

FORMAT, VERSION = "distopt-checkpoint", 1
DTYPES = {"F32": torch.float32, "F64": torch.float64, "BF16": torch.bfloat16, "F16": torch.float16,
          "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}
NAMES = {v: k for k, v in DTYPES.items()}

# distopt key -> (upstream group key, index into a tuple or None), for each optimizer; every distopt key.
GROUP_KEYS = {
    "adamw": [("lr", "lr", None), ("beta1", "betas", 0), ("beta2", "betas", 1), ("eps", "eps", None),
              ("weight_decay", "weight_decay", None), ("amsgrad", "amsgrad", None)],
    "adafactor": [("lr", "lr", None), ("eps1", "eps", 0), ("eps2", "eps", 1), ("clip_threshold", "clip_threshold", None),
                  ("decay_rate", "decay_rate", None), ("beta1", "beta1", None), ("weight_decay", "weight_decay", None),
                  ("scale_parameter", "scale_parameter", None), ("relative_step", "relative_step", None),
                  ("warmup_init", "warmup_init", None)],
    "came": [("lr", "lr", None), ("eps1", "eps", 0), ("eps2", "eps", 1), ("clip_threshold", "clip_threshold", None),
             ("beta1", "betas", 0), ("beta2", "betas", 1), ("beta3", "betas", 2), ("weight_decay", "weight_decay", None)],
}
BOOL_KEYS = {"amsgrad", "scale_parameter", "relative_step", "warmup_init"}
OPTIONAL_KEYS = {("adafactor", "lr"), ("adafactor", "beta1"), ("came", "lr")}
# upstream keys distopt has no equivalent of, with the only value distopt computes
FIXED = {"adamw": {"maximize": False}}


def fail(msg):
    sys.exit("ckpt_torch: " + msg)


# ---- files, by the library's rule (docs/files.md) ---------------------------------------------------

def read_regular(path, mode="r"):
    """The contents of path, a regular file: a FIFO, socket or folder is refused, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        fail(f"{path}: cannot open: {e.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            fail(f"{path}: not a regular file")
        os.set_blocking(fd, True)
        with os.fdopen(fd, mode) as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def remove_flat_dir(path):
    """A stale temporary generation: a symbolic link there is removed as a link (never followed); a folder
    of plain files is emptied through a descriptor opened without following links, then removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.unlink(path)
        return
    if not stat.S_ISDIR(st.st_mode):
        fail(f"{path} is not a folder, where a temporary generation belongs")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        names = os.listdir(fd)
        for n in names:
            if stat.S_ISDIR(os.stat(n, dir_fd=fd, follow_symlinks=False).st_mode):
                fail(f"{path} holds a folder {n!r}: not distopt's, nothing removed")
        for n in names:
            os.unlink(n, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def create_temp(base):
    """(path, fd) of a new file named base.tmp-<pid>-<n>, created exclusively: a link someone placed at
    such a name is never written through (the next name is tried)."""
    for n in range(100):
        path = f"{base}.tmp-{os.getpid()}-{n}"
        try:
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
    fail(f"{base}: 100 temporary names taken")


def write_new(path, data, fd=None):
    """A file distopt's own folder holds: created exclusively (never through a link placed at the name)."""
    if fd is None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_output(path, save, inputs=()):
    """An output the user named, by the library's one rule: a character device is written through; a
    symbolic link's final target is replaced in its own folder; a new or regular file is written to a
    temporary beside it and renamed over it; a FIFO, socket or folder is refused; and it may not be,
    or lie inside, an input. save(f) writes the contents to a binary file object."""
    target = os.path.realpath(path)
    st = os.stat(target) if os.path.exists(target) else None
    if st and not (stat.S_ISREG(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        fail(f"{path}: not a regular file or character device (a FIFO, socket or folder is no output)")
    for i in inputs:
        ri = os.path.realpath(i)
        if target == ri or target.startswith(ri.rstrip("/") + "/") or (st and os.path.samefile(target, ri)):
            fail(f"{path} is, or lies inside, the input {i}: it would change an input")
    if st and stat.S_ISCHR(st.st_mode):
        with open(target, "wb") as f:
            save(f)
        return
    folder = os.path.dirname(target)
    tmp, fd = create_temp(target)
    try:
        with os.fdopen(fd, "wb") as f:
            save(f)
            f.flush()
            os.fsync(f.fileno())
        if st:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.rename(tmp, target)
        fsync_dir(folder)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


# ---- reading a distopt checkpoint --------------------------------------------------------------

def generation(path):
    latest = os.path.join(path, "latest")
    if os.path.lexists(latest):
        name = read_regular(latest).strip()
        if not name.startswith("step-") or "/" in name:
            fail(f"{latest}: '{name}' is not a generation name")
        path = os.path.join(path, name)
    if not os.path.lexists(os.path.join(path, "index.json")):
        fail(f"{path}: no index.json (not a checkpoint, or a half-written generation)")
    return path


def load_index(path):
    gen = generation(path)
    idx = json.loads(read_regular(os.path.join(gen, "index.json")))
    if idx.get("format") != FORMAT:
        fail(f"{gen}/index.json: format {idx.get('format')!r} is not {FORMAT!r}")
    if idx.get("version") != VERSION:
        fail(f"{gen}/index.json: format version {idx.get('version')} is unknown (this tool reads {VERSION})")
    return gen, idx


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def raw_bytes(t):
    """The tensor's elements as little-endian bytes (what the SHA-256 of a piece covers)."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits as int16
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def view_bhw(shape):
    if len(shape) >= 2:
        return numel(shape[:-2]), shape[-2], shape[-1]
    return 1, 1, numel(shape)


@functools.lru_cache(maxsize=None)  # each rank file read once per checkpoint read (read_checkpoint clears it)
def rank_tensors(rank_file):
    return st_io.read_torch(rank_file)


def read_tensor(gen, t):
    """The logical tensor of an index entry, assembled from its pieces (each checked against its SHA-256)."""
    dt, shape = DTYPES[t["dtype"]], t["shape"]
    flat = torch.zeros(numel(shape), dtype=dt)
    b, h, w = view_bhw(shape)
    for p in t["pieces"]:
        if p["len"] == 0:
            continue
        rank_file = os.path.join(gen, p["file"])
        st = os.stat(rank_file) if os.path.exists(rank_file) else None
        if not st or not stat.S_ISREG(st.st_mode):  # a FIFO would block the read
            fail(f"{rank_file}: missing or not a regular file")
        tensors = rank_tensors(rank_file)
        if p["key"] not in tensors:
            fail(f"{gen}/{p['file']}: no tensor {p['key']!r} (for {t['name']!r})")
        data = tensors[p["key"]].reshape(-1)
        digest = hashlib.sha256(raw_bytes(data)).hexdigest()
        if digest != p["sha256"]:
            fail(f"{gen}/{p['file']}: tensor {t['name']!r} key {p['key']!r}: SHA-256 mismatch (corrupted)")
        if (p["b"], p["h"], p["w"]) != (b, h, w) or data.numel() != p["len"]:
            fail(f"{gen}: tensor {t['name']!r} piece {p['key']!r} does not fit its shape")
        # block element j of [b, hl, wl] -> logical element (as core/grid.h dopt_grid_logical)
        j = torch.arange(p["lo"], p["lo"] + p["len"], dtype=torch.int64)
        per = p["hl"] * p["wl"]
        r = j % per
        logical = ((j // per) * h + p["h0"] + r // p["wl"]) * w + p["w0"] + r % p["wl"]
        flat[logical] = data
    return flat.reshape(shape)


def read_checkpoint(path):
    """(index, {tensor name: tensor}) of a checkpoint."""
    gen, idx = load_index(path)
    try:
        return idx, {t["name"]: read_tensor(gen, t) for t in idx["tensors"]}
    finally:
        rank_tensors.cache_clear()


# ---- distopt -> torch ---------------------------------------------------------------------------

def group_to_torch(opt, hp):
    g = {}
    for key, up, pos in GROUP_KEYS[opt]:
        if key not in hp:
            fail(f"hyperparameter {key!r} missing for {opt}")
        v = hp[key]
        if pos is None:
            g[up] = v
        else:
            g.setdefault(up, [])
            while len(g[up]) <= pos:
                g[up].append(None)
            g[up][pos] = v
    for up in list(g):
        if isinstance(g[up], list):
            g[up] = tuple(g[up])
    g.update(FIXED.get(opt, {}))
    if opt == "adamw":  # the installed torch's remaining defaults (foreach, capturable, ...)
        ref = torch.optim.AdamW([torch.zeros(1)], lr=g["lr"], betas=g["betas"], eps=g["eps"],
                                weight_decay=g["weight_decay"], amsgrad=g["amsgrad"])
        for k, v in ref.param_groups[0].items():
            if k != "params":
                g.setdefault(k, v)
    return g


def to_torch(path):
    idx, tensors = read_checkpoint(path)
    opt = idx["optimizer"]
    if idx.get("wrapper"):
        fail(f"wrapper {idx['wrapper']['name']!r}: upstream has no state_dict for it")
    if opt not in GROUP_KEYS:
        fail(f"optimizer {opt!r}: only {', '.join(GROUP_KEYS)} convert")
    params = idx["params"]
    order = [i for g in range(len(idx["groups"])) for i, p in enumerate(params) if p["group"] == g]
    state, groups, names = {}, [], []
    for g, grp in enumerate(idx["groups"]):
        tg = group_to_torch(opt, grp["hparams"])
        tg["params"] = []
        groups.append(tg)
    for k, i in enumerate(order):
        p = params[i]
        names.append(p["name"])
        groups[p["group"]]["params"].append(k)
        if not p["has_state"]:
            continue
        st = {}
        for t in idx["tensors"]:
            prefix = p["name"] + "/"
            if t["name"].startswith(prefix) and t["name"] != prefix + "bf16":
                st[t["name"][len(prefix):]] = tensors[t["name"]]
        st["step"] = torch.tensor(float(p["step"])) if opt == "adamw" else int(p["step"])
        state[k] = st
    extra = {"global_step": idx["global_step"], "optimizer_steps": idx["optimizer_steps"],
             "skipped_steps": idx["skipped_steps"], "layers": {p["name"]: p["layer"] for p in params},
             "param_order": [p["name"] for p in params], "optimizer": opt}
    return {"optimizer": {"state": state, "param_groups": groups}, "param_names": names,
            "params": {p["name"]: tensors[p["name"]] for p in params},
            "bf16": {p["name"]: tensors[p["name"] + "/bf16"] for p in params if p["has_bf16"]},
            "distopt": extra}


# ---- torch -> distopt ---------------------------------------------------------------------------

def group_from_torch(opt, g):
    hp = {}
    for key, up, pos in GROUP_KEYS[opt]:
        if up not in g:
            fail(f"param_groups entry lacks {up!r} ({opt})")
        v = g[up] if pos is None else g[up][pos]
        if v is None and (opt, key) not in OPTIONAL_KEYS:
            fail(f"{opt}: {key} is None")
        if isinstance(v, torch.Tensor):
            v = v.item()
        hp[key] = bool(v) if key in BOOL_KEYS else (None if v is None else float(v))
    for up, want in FIXED.get(opt, {}).items():
        if g.get(up, want) != want:
            fail(f"{opt}: {up}={g[up]!r} has no distopt equivalent (only {want!r})")
    return hp


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)




def piece(shape):
    b, h, w = view_bhw(shape)
    return {"b": b, "h": h, "w": w, "numel": b * h * w, "factored": 1 if len(shape) >= 2 else 0,
            "h0": 0, "hl": h, "w0": 0, "wl": w, "lo": 0, "len": b * h * w}


def from_torch(container, ckpt_dir, optimizer=None):
    sd, names = container["optimizer"], container["param_names"]
    extra = container.get("distopt", {})
    opt = optimizer or extra.get("optimizer")
    if opt not in GROUP_KEYS:
        fail(f"optimizer {opt!r}: give one of {', '.join(GROUP_KEYS)}")
    params = []
    tensors = {}  # name -> tensor (whole pieces)
    groups = []
    for g, grp in enumerate(sd["param_groups"]):
        groups.append({"hparams": group_from_torch(opt, grp), "params": []})
        for k in grp["params"]:
            name = names[k]
            w = container["params"][name].detach().to(torch.float32).contiguous()
            st = sd["state"].get(k, {})
            step = st.get("step", 0)
            step = int(step.item() if isinstance(step, torch.Tensor) else step)
            bf16 = container.get("bf16", {}).get(name)
            params.append({"name": name, "dtype": "BF16" if bf16 is not None else "F32", "shape": list(w.shape),
                           "group": g, "layer": extra.get("layers", {}).get(name, -1), "step": step,
                           "has_bf16": bf16 is not None, "has_state": bool(st)})
            tensors[name] = w
            if bf16 is not None:
                tensors[name + "/bf16"] = bf16.detach().to(torch.bfloat16).contiguous()
            for key, v in st.items():
                if key == "step":
                    continue
                if not isinstance(v, torch.Tensor):
                    v = torch.tensor(float(v))
                tensors[f"{name}/{key}"] = v.detach().to(torch.float32).contiguous()
    order = extra.get("param_order")
    if order and sorted(order) == sorted(p["name"] for p in params):  # distopt's parameter order, not torch's
        params.sort(key=lambda p: order.index(p["name"]))
    for p in params:
        groups[p["group"]]["params"].append(p["name"])
    steps = max([p["step"] for p in params] + [0])
    gstep = int(extra.get("global_step", steps))
    rank_file = "rank-00000-of-00001.safetensors"
    entries = []
    for name in sorted(tensors):
        t = tensors[name]
        pc = piece(list(t.shape))
        entries.append({"name": name, "dtype": NAMES[t.dtype], "shape": list(t.shape),
                        "pieces": [dict(file=rank_file, key=name + "@0", **pc, bytes=t.numel() * t.element_size(),
                                        sha256=hashlib.sha256(raw_bytes(t)).hexdigest())]})
    index = {"format": FORMAT, "version": VERSION, "optimizer": opt, "wrapper": None, "groups": groups,
             "global_step": gstep, "optimizer_steps": int(extra.get("optimizer_steps", steps)),
             "skipped_steps": int(extra.get("skipped_steps", 0)),
             "world": {"plugin": "torch", "tp": 1, "dp": 1, "zero": 0}, "params": params}
    gen = f"step-{gstep:09d}"
    tmp = os.path.join(ckpt_dir, f".tmp-{gen}")
    os.makedirs(ckpt_dir, exist_ok=True)
    dst = os.path.join(ckpt_dir, gen)
    if os.path.lexists(dst):
        fail(f"{dst} exists")
    remove_flat_dir(tmp)  # a crashed conversion's; a link there goes as a link
    os.makedirs(tmp)
    path = os.path.join(tmp, rank_file)
    st_io.write(path, [(e["pieces"][0]["key"], tensors[e["name"]]) for e in entries],
                metadata={"format": FORMAT, "rank": "0", "nranks": "1"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    size = os.path.getsize(path)
    rank = {"format": FORMAT + "-rank", "version": VERSION, "rank": 0, "nranks": 1, "file": rank_file,
            "file_bytes": size,
            "pieces": [dict(tensor=e["name"], dtype=e["dtype"], shape=e["shape"], **e["pieces"][0]) for e in entries]}
    for pc in rank["pieces"]:
        del pc["file"]
    write_new(os.path.join(tmp, "rank-00000.json"), json.dumps(rank, indent=1).encode())
    index["files"] = [{"name": rank_file, "bytes": size}]
    index["tensors"] = entries
    write_new(os.path.join(tmp, "index.json"), json.dumps(index, indent=1).encode())
    fsync_dir(tmp)
    os.rename(tmp, dst)
    fsync_dir(ckpt_dir)
    latest_tmp, fd = create_temp(os.path.join(ckpt_dir, "latest"))
    write_new(latest_tmp, (gen + "\n").encode(), fd)
    os.rename(latest_tmp, os.path.join(ckpt_dir, "latest"))  # replaces whatever is at `latest`, never followed
    fsync_dir(ckpt_dir)
    return dst


def main(argv):
    if len(argv) >= 3 and argv[1] == "to-torch" and len(argv) == 4:
        sd = to_torch(argv[2])
        write_output(argv[3], lambda f: torch.save(sd, f), inputs=[argv[2]])
    elif len(argv) >= 4 and argv[1] == "from-torch" and len(argv) in (4, 5):
        print(from_torch(torch.load(argv[2]), argv[3], argv[4] if len(argv) == 5 else None))
    elif len(argv) == 3 and argv[1] == "show":
        gen, idx = load_index(argv[2])
        print(f"{gen}: {idx['optimizer']}"
              + (f" in {idx['wrapper']['name']}" if idx.get("wrapper") else "")
              + f", global step {idx['global_step']}, world {idx['world']}")
        for g, grp in enumerate(idx["groups"]):
            print(f"  group {g}: {grp['hparams']} ({len(grp['params'])} parameters)")
        for t in idx["tensors"]:
            print(f"  {t['name']:40s} {t['dtype']:5s} {t['shape']} {len(t['pieces'])} piece(s)")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
