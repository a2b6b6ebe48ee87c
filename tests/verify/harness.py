"""Shared code of the `distopt verify` client tests (tests/verify/run_client.py): models and data, the gloo
launcher, the hand-written sharded Adafactor (correct and with the planted local-statistics bug), and running
the CLI. Everything is seeded and single-threaded: a rerun records the same bits.

Environment (set by tests/verify/CMakeLists.txt): PYTHONPATH (python/), DISTOPT_LIBRARY (libdistopt.so of the
build), DISTOPT_CLI (the distopt binary), VERIFY_WORK (a scratch folder of this test)."""
import gc
import json
import math
import os
import shutil
import subprocess
import warnings
import sys

import torch

SEED = 20240611


def work_dir(name):
    base = os.environ.get("VERIFY_WORK") or os.path.join(os.getcwd(), "verify_work")
    d = os.path.join(base, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def cli():
    exe = os.environ.get("DISTOPT_CLI")
    if not exe or not os.path.isfile(exe):
        sys.exit(f"DISTOPT_CLI={exe!r} is not the distopt binary (tests/verify/CMakeLists.txt sets it)")
    return exe


def run_verify(trace, *extra, expect):
    """Runs `distopt verify trace --json J`; prints its output; fails unless the exit code is `expect`.
    Returns (stdout, parsed JSON or None)."""
    jp = os.path.join(os.path.dirname(os.path.abspath(trace)), os.path.basename(trace) + ".verify.json")
    if os.path.exists(jp):
        os.remove(jp)
    cmd = [cli(), "verify", trace, "--json", jp, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    print("$ " + " ".join(cmd))
    print(p.stdout, end="")
    if p.stderr:
        print(p.stderr, end="")
    print(f"(exit {p.returncode})")
    if p.returncode != expect:
        sys.exit(f"FAIL: distopt verify exited {p.returncode}, expected {expect}")
    report = None
    if os.path.exists(jp):
        with open(jp) as f:
            report = json.load(f)
        check(report.get("schema_version") == 8, f"verify JSON schema_version {report.get('schema_version')}")
    return p.stdout, report


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")


def seeded(rank=0):
    torch.manual_seed(SEED + 1000 * rank)
    torch.set_num_threads(1)


def mlp():
    """A few Linear layers (seeded)."""
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(),
                               torch.nn.Linear(24, 5))


def batch(step, rank=0, n=16):
    g = torch.Generator().manual_seed(SEED + 7919 * step + 104729 * rank)
    x = torch.randn(n, 12, generator=g)
    y = torch.randn(n, 5, generator=g)
    return x, y


def train_step(model, opt, step, rank=0):
    x, y = batch(step, rank)
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def tensors_by_rank(report):
    out = {}
    for t in report["tensors"]:
        out.setdefault(t["rank"], []).append(t)
    return out


# ---- torch.distributed on the CPU (gloo), N processes ----------------------------------------------------

def _entry(rank, world, store, fn, args):
    import torch.distributed as dist
    # a file rendezvous, private to this launch: a TCP port picked free and closed before the ranks bind it could
    # be taken in between by another test's group (ctest runs the gloo tests side by side)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        gc.collect()  # the run's DDP/ZeRO objects (reference cycles holding the group) freed while the group lives
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and synchronised: leave without the interpreter's teardown, where torch's gloo threads have aborted a
    # rank now and then under load ("terminate called without an active exception", SIGABRT at exit; seen in
    # verify_zero_adamw and verify_moe_adafactor under ctest -j2). A failure above still raises to mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, world, *args):
    """Runs fn(rank, world, *args) in `world` spawned processes joined in a gloo group; raises if one fails."""
    import tempfile
    import torch.multiprocessing as mp
    d = tempfile.mkdtemp(prefix="distopt-gloo-")
    try:
        mp.spawn(_entry, args=(world, os.path.join(d, "store"), fn, args), nprocs=world, join=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- ZeroRedundancyOptimizer(AdamW) under DDP ------------------------------------------------------------

def zero_worker(rank, world, trace, steps, inner="torch", sync=True, agree=None):
    """inner: "torch" (torch.optim.AdamW) or "distopt" (distopt.Optimizer("adamw") as ZeRO's optimizer_class);
    sync=False: no DDP, each rank steps its owned parameters on its own micro-batch's gradient (the bug);
    agree: record's grad_agree (None: its default)."""
    import functools
    import distopt
    from distopt.record import record  # (not `import distopt.record as`: see docs/verify.md)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    seeded()  # the same initial model on every rank
    model = mlp()
    ddp = DDP(model) if sync else model
    cls = torch.optim.AdamW if inner == "torch" else functools.partial(distopt.Optimizer, "adamw")
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, lr=3e-3, betas=(0.9, 0.99),
                                  weight_decay=0.05)
    seeded(rank)
    with record(opt, trace, names=model, flush_every=6, **({} if agree is None else {"grad_agree": agree})):
        for t in range(1, steps + 1):
            x, y = batch(t, rank)  # each rank its own micro-batch; DDP averages the gradients
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()


def ddp_worker(rank, world, trace, steps):
    """A plain AdamW under DDP: every rank steps (and records) every parameter, replicas of each other."""
    from distopt.record import record
    from torch.nn.parallel import DistributedDataParallel as DDP
    seeded()
    model = mlp()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    with record(opt, trace, names=model, flush_every=8):
        for t in range(1, steps + 1):
            x, y = batch(t, rank)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()


# ---- a hand-written sharded Adafactor: 2 ranks, each half of the rows of W ---------------------------------

ROWS, COLS = 8, 6


class ShardedAdafactor(torch.optim.Optimizer):
    """HF transformers' Adafactor (relative_step=False, lr given, scale_parameter, no momentum, no decay) on a
    row shard of each parameter, in HF's order of operations. Every statistic over elements the rank does not
    hold goes through an all_reduce (sum) of the group: the parameter's RMS, the update's RMS (clipping), the
    column means of the squared gradient and the mean of the row statistics. With local_stats=True the two
    means of the factored second moment are taken over the LOCAL rows only (the bug class of running the
    unsharded algorithm on a shard); everything else stays global."""

    def __init__(self, params, lr, global_rows, global_numel, local_stats):
        super().__init__(params, dict(lr=lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8))
        self.global_rows, self.global_numel, self.local_stats = global_rows, global_numel, local_stats

    @staticmethod
    def _sum(x):
        import torch.distributed as dist
        x = x.clone()
        dist.all_reduce(x)
        return x

    def _rms(self, x, numel):
        return (self._sum((x * x).sum()) / numel).sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                g = p.grad
                numel = self.global_numel[p]
                factored = p.dim() >= 2
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    if factored:
                        st["exp_avg_sq_row"] = torch.zeros(p.shape[:-1])
                        st["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:])
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(g)
                    st["RMS"] = 0
                st["step"] += 1
                st["RMS"] = self._rms(p, numel)
                lr = max(eps2, st["RMS"]) * group["lr"]  # as HF: a tensor product when RMS wins the max
                beta2t = 1.0 - math.pow(st["step"], group["decay_rate"])
                update = g ** 2 + eps1
                if factored:
                    row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                    row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)  # whole rows: local is global
                    if self.local_stats:
                        col_mean = update.mean(dim=-2)
                    else:
                        col_mean = self._sum(update.sum(dim=-2)) / self.global_rows
                    col.mul_(beta2t).add_(col_mean, alpha=1.0 - beta2t)
                    if self.local_stats:
                        row_mean = row.mean(dim=-1, keepdim=True)
                    else:
                        row_mean = self._sum(row.sum(dim=-1, keepdim=True)) / self.global_rows
                    r_factor = (row / row_mean).rsqrt_().unsqueeze(-1)
                    c_factor = col.unsqueeze(-2).rsqrt()
                    update = torch.mul(r_factor, c_factor)
                else:
                    st["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = st["exp_avg_sq"].rsqrt()
                update.mul_(g)
                update.div_((self._rms(update, numel) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                p.add_(-update)


def row_shard(rank, world):
    """This rank's rows of the seeded W [ROWS, COLS] and b [ROWS]: (first row, rows, w, bias)."""
    seeded()
    W = torch.randn(ROWS, COLS) * 0.5
    b = torch.randn(ROWS) * 0.5
    per = ROWS // world
    lo = rank * per
    return lo, per, W[lo:lo + per].clone().requires_grad_(True), b[lo:lo + per].clone().requires_grad_(True)


def train_rows(opt, w, bias, lo, per, rank, steps):
    """Seeded least squares on this rank's rows (the shards differ in scale)."""
    for t in range(1, steps + 1):
        g = torch.Generator().manual_seed(SEED + 31 * t)
        x = torch.randn(10, COLS, generator=g)
        target = torch.randn(10, ROWS, generator=g)[:, lo:lo + per] * (1 + 3 * rank)
        opt.zero_grad()
        ((x @ w.T + bias - target) ** 2).mean().backward()  # the gradient of this rank's rows
        opt.step()


def sharded_worker(rank, world, trace, steps, local_stats):
    from distopt.record import record  # (not `import distopt.record as`: see docs/verify.md)
    lo, per, w, bias = row_shard(rank, world)
    opt = ShardedAdafactor([w, bias], lr=1e-2, global_rows=ROWS, global_numel={w: ROWS * COLS, bias: ROWS},
                           local_stats=local_stats)
    layout = {
        w: {"param": "w", "shape": [ROWS, COLS], "lo": lo * COLS,
            "states": {"exp_avg_sq_row": (lo, per), "exp_avg_sq_col": (0, COLS), "RMS": (0, 1)}},
        bias: {"param": "b", "shape": [ROWS], "lo": lo, "states": {"RMS": (0, 1)}},
    }
    hp = dict(lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False, eps1=1e-30, eps2=1e-3,
              clip_threshold=1.0, decay_rate=-0.8, beta1=None, weight_decay=0.0)
    with record(opt, trace, name="adafactor", hparams=hp, layout=layout, flush_every=5):
        train_rows(opt, w, bias, lo, per, rank, steps)


# ---- Megatron-style tensor parallelism: a column-parallel and a row-parallel Linear on 2 ranks ---------------

H_TP, D_TP, O_TP = 8, 6, 5  # hidden, input, output


class _ReduceOut(torch.autograd.Function):
    """Megatron's g: the row-parallel layer's partial outputs summed over the TP group; the gradient passes."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class TPAdafactor(ShardedAdafactor):
    """ShardedAdafactor on tensor-parallel blocks: spec[p] = (dim, global shape), dim the split dimension (None:
    replicated, every statistic local). A 2-D block split on dim 1 (a row-parallel weight's input columns) holds
    part of every row: its row means go through an all_reduce; split on dim 0 its column means and the mean of
    its row statistics do. local_stats=True takes the row means of a dim-1 block over the local columns (the
    bug: the unsharded algorithm on a row-parallel shard)."""

    def __init__(self, params, lr, spec, local_stats):
        numel = {p: math.prod(shape) for p, (_, shape) in spec.items()}
        super().__init__(params, lr, None, numel, local_stats)
        self.spec = spec

    def _rms(self, x, numel):
        if self._split is None:
            return ((x * x).sum() / numel).sqrt()
        return super()._rms(x, numel)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                g, (dim, shape) = p.grad, self.spec[p]
                self._split = dim
                st = self.state[p]
                if not st:
                    st["step"], st["RMS"] = 0, 0
                    if p.dim() >= 2:
                        st["exp_avg_sq_row"], st["exp_avg_sq_col"] = torch.zeros(p.shape[0]), torch.zeros(p.shape[1])
                    else:
                        st["exp_avg_sq"] = torch.zeros_like(g)
                st["step"] += 1
                st["RMS"] = self._rms(p, self.global_numel[p])
                lr = max(eps2, st["RMS"]) * group["lr"]
                beta2t = 1.0 - math.pow(st["step"], group["decay_rate"])
                update = g ** 2 + eps1
                if p.dim() >= 2:
                    rows, cols = shape
                    row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                    if dim == 1 and not self.local_stats:
                        row_mean_g = self._sum(update.sum(dim=-1)) / cols
                    else:
                        row_mean_g = update.mean(dim=-1)
                    col_mean_g = self._sum(update.sum(dim=-2)) / rows if dim == 0 else update.mean(dim=-2)
                    row.mul_(beta2t).add_(row_mean_g, alpha=1.0 - beta2t)
                    col.mul_(beta2t).add_(col_mean_g, alpha=1.0 - beta2t)
                    row_mean = self._sum(row.sum(dim=-1, keepdim=True)) / rows if dim == 0 else row.mean(dim=-1, keepdim=True)
                    update = torch.mul((row / row_mean).rsqrt_().unsqueeze(-1), col.unsqueeze(-2).rsqrt())
                else:
                    st["exp_avg_sq"].mul_(beta2t).add_(update, alpha=1.0 - beta2t)
                    update = st["exp_avg_sq"].rsqrt()
                update.mul_(g)
                update.div_((self._rms(update, self.global_numel[p]) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                p.add_(-update)


class TPLamb(torch.optim.Optimizer):
    """LAMB as FlatLamb (distopt's lamb) on tensor-parallel blocks: spec[p] = (dim, global shape) as TPAdafactor's.
    The trust ratio is per logical tensor: the two sums of squares of a split one go through an all_reduce (in
    double). local_stats=True takes them over the local block (the bug: LAMB's norms on a TP shard)."""

    def __init__(self, params, lr, spec, local_stats, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.spec, self.local_stats = spec, local_stats

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        for group in self.param_groups:
            for p in group["params"]:
                u = _lamb_direction(self.state[p], p, group)
                sums = torch.stack([(p.double() ** 2).sum(), (u.double() ** 2).sum()])
                if self.spec[p][0] is not None and not self.local_stats:
                    dist.all_reduce(sums)
                wn, un = float(sums[0].sqrt()), float(sums[1].sqrt())
                p.add_(u, alpha=-group["lr"] * (wn / un if wn > 0 and un > 0 else 1.0))


def tp_worker(rank, world, trace, steps, local_stats, kind="adafactor"):
    """A column-parallel Linear (w1 [H, D] and b1 split on dim 0: this rank's hidden units) and a row-parallel
    one (w2 [O, H] split on dim 1: its input columns; b2 replicated, added after the all_reduce), trained on the
    same batch on every rank; TPAdafactor (kind "adafactor") or TPLamb ("lamb") on the blocks, recorded with
    block layouts."""
    from distopt.record import record
    seeded()
    W1, B1, W2, B2 = (torch.randn(H_TP, D_TP) * 0.5, torch.randn(H_TP) * 0.5, torch.randn(O_TP, H_TP) * 0.5,
                      torch.randn(O_TP) * 0.5)
    per = H_TP // world
    lo = rank * per
    w1 = W1[lo:lo + per].clone().requires_grad_(True)
    b1 = B1[lo:lo + per].clone().requires_grad_(True)
    w2 = W2[:, lo:lo + per].clone().requires_grad_(True)
    b2 = B2.clone().requires_grad_(True)
    spec = {w1: (0, [H_TP, D_TP]), b1: (0, [H_TP]), w2: (1, [O_TP, H_TP]), b2: (None, [O_TP])}
    if kind == "lamb":  # elementwise states: they follow the pieces
        opt = TPLamb([w1, b1, w2, b2], lr=1e-2, spec=spec, local_stats=local_stats)
    else:
        opt = TPAdafactor([w1, b1, w2, b2], lr=1e-2, spec=spec, local_stats=local_stats)
    blk = {"dim": 0, "lo": lo, "len": per}
    layout = {
        w1: {"param": "w1", "shape": [H_TP, D_TP], "block": blk,
             "states": {"exp_avg_sq_row": (lo, per), "exp_avg_sq_col": (0, D_TP), "RMS": (0, 1)}},
        b1: {"param": "b1", "shape": [H_TP], "block": blk, "states": {"RMS": (0, 1)}},
        w2: {"param": "w2", "shape": [O_TP, H_TP], "block": {"dim": 1, "lo": lo, "len": per},
             "states": {"exp_avg_sq_row": (0, O_TP), "exp_avg_sq_col": (lo, per), "RMS": (0, 1)}},
        b2: {"param": "b2", "shape": [O_TP]},
    }
    hp = dict(lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False, eps1=1e-30, eps2=1e-3,
              clip_threshold=1.0, decay_rate=-0.8, beta1=None, weight_decay=0.0)
    if kind == "lamb":
        for q in layout.values():
            q.pop("states", None)
        hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, adam=False, bias_correction=False)
    with record(opt, trace, name=kind, hparams=hp, layout=layout, flush_every=5):
        for t in range(1, steps + 1):
            gen = torch.Generator().manual_seed(SEED + 17 * t)
            x, target = torch.randn(10, D_TP, generator=gen), torch.randn(10, O_TP, generator=gen)
            opt.zero_grad()
            h = torch.relu(x @ w1.T + b1)
            y = _ReduceOut.apply(h @ w2.T) + b2
            ((y - target) ** 2).mean().backward()
            opt.step()


# ---- expert parallelism: a top-1 MoE block, experts split over 2 ranks (ep 2), dense layers data-parallel ----

E_MOE, D_MOE, H_MOE, F_MOE, O_MOE, N_MOE = 4, 6, 8, 5, 4, 6  # experts, input, hidden, expert hidden, output, tokens


class _GatherTokens(torch.autograd.Function):
    """Every rank's tokens to every rank (the all-to-all dispatch, simplified to an all_gather); the backward
    sums the gradients of all ranks' experts and keeps this rank's tokens' (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.clone()
        dist.all_reduce(g)
        return g[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


class EPAdafactor(ShardedAdafactor):
    """Adafactor (as ShardedAdafactor) on an expert-parallel MoE: stack[p] True for the expert stack [E, O, F]
    split over the ranks by experts (dim 0): its factored statistics are per expert (local), its parameter and
    update RMS span the whole stack (an all_reduce); every other tensor is whole on its rank. local_rms=True
    takes the stack's RMS over the local experts only (the bug: the unsharded algorithm on an expert shard)."""

    def __init__(self, params, lr, stack, numel, local_rms):
        super().__init__(params, lr, None, numel, False)
        self.stack, self.local_rms = stack, local_rms

    def _rms_of(self, p, x):
        if self.stack.get(p) and not self.local_rms:
            return self._rms(x, self.global_numel[p])
        return ((x * x).sum() / x.numel()).sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                g, st = p.grad, self.state[p]
                if not st:
                    st["step"], st["RMS"] = 0, 0
                    st["exp_avg_sq_row"] = torch.zeros(p.shape[:-1])
                    st["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:])
                st["step"] += 1
                st["RMS"] = self._rms_of(p, p)
                lr = max(eps2, st["RMS"]) * group["lr"]
                beta2t = 1.0 - math.pow(st["step"], group["decay_rate"])
                update = g ** 2 + eps1
                row, col = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)  # per expert: local
                col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
                r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
                update = torch.mul(r_factor, col.unsqueeze(-2).rsqrt())
                update.mul_(g)
                update.div_((self._rms_of(p, update) / group["clip_threshold"]).clamp_(min=1.0))
                update.mul_(lr)
                p.add_(-update)


def moe_worker(rank, world, trace, steps, bug):
    """A top-1 MoE block on 2 gloo ranks: dense w0 [H, D] and router [E, D] replicated, each rank its own tokens,
    their gradients averaged over the ranks (data parallel); experts 2r, 2r + 1 on rank r: experts.<e>.w1
    [F, H] as separate tensors and its block of the stack experts.w2 [E, O, F]; tokens gathered to every rank's
    experts and the outputs summed back. EPAdafactor, recorded with expert ids and a dim-0 block of the stack.
    bug: "local_rms" (the stack's RMS over the local experts), "unsynced" (dense gradients not averaged)."""
    import torch.distributed as dist
    from distopt.record import record
    seeded()
    W0, WR = torch.randn(H_MOE, D_MOE) * 0.5, torch.randn(E_MOE, D_MOE) * 0.5
    W1 = [torch.randn(F_MOE, H_MOE) * 0.5 for _ in range(E_MOE)]
    W2 = torch.randn(E_MOE, O_MOE, F_MOE) * 0.5
    per = E_MOE // world
    mine = range(rank * per, (rank + 1) * per)
    w0, wr = W0.clone().requires_grad_(True), WR.clone().requires_grad_(True)
    w1 = {e: W1[e].clone().requires_grad_(True) for e in mine}
    w2 = W2[rank * per:(rank + 1) * per].clone().requires_grad_(True)
    params = [w0, wr] + [w1[e] for e in mine] + [w2]
    numel = {q: q.numel() for q in params}
    numel[w2] = W2.numel()
    opt = EPAdafactor(params, lr=1e-2, stack={w2: True}, numel=numel, local_rms=bug == "local_rms")
    layout = {w0: {"param": "w0", "shape": [H_MOE, D_MOE]}, wr: {"param": "router", "shape": [E_MOE, D_MOE]},
              w2: {"param": "experts.w2", "shape": [E_MOE, O_MOE, F_MOE], "block": {"dim": 0, "lo": rank * per, "len": per},
                   "states": {"exp_avg_sq_row": (rank * per * O_MOE, per * O_MOE),
                              "exp_avg_sq_col": (rank * per * F_MOE, per * F_MOE), "RMS": (0, 1)}}}
    layout.update({w1[e]: {"param": f"experts.{e}.w1", "shape": [F_MOE, H_MOE], "expert": e} for e in mine})
    hp = dict(lr=1e-2, relative_step=False, scale_parameter=True, warmup_init=False, eps1=1e-30, eps2=1e-3,
              clip_threshold=1.0, decay_rate=-0.8, beta1=None, weight_decay=0.0)
    with record(opt, trace, name="adafactor", hparams=hp, layout=layout, experts=E_MOE, flush_every=5):
        for t in range(1, steps + 1):
            gen = torch.Generator().manual_seed(SEED + 23 * t)
            xs = [torch.randn(N_MOE, D_MOE, generator=gen) for _ in range(world)]
            target = torch.randn(world * N_MOE, O_MOE, generator=gen)
            opt.zero_grad()
            h_all = _GatherTokens.apply(torch.tanh(xs[rank] @ w0.T))
            gate_all = _GatherTokens.apply(torch.softmax(xs[rank] @ wr.T, dim=-1))
            top = gate_all.argmax(dim=-1)
            y = torch.zeros(world * N_MOE, O_MOE)
            for e in mine:  # this rank's experts on every token routed to them
                sel = (top == e).float().unsqueeze(-1) * gate_all[:, e:e + 1]
                y = y + sel * (torch.tanh(h_all @ w1[e].T) @ w2[e - rank * per].T)
            y = _ReduceOut.apply(y)
            ((y - target) ** 2).mean().backward()
            if bug != "unsynced":
                for q in (w0, wr):  # data parallel: the dense gradients averaged over the ranks
                    dist.all_reduce(q.grad)
                    q.grad /= world
            opt.step()


# ---- a 2-stage pipeline: each rank its stage's parameters and its own optimizer --------------------------------

def pipeline_worker(rank, world, trace, steps, lagging):
    """The MLP cut in two stages (Linear-Tanh | Linear-Tanh-Linear) over 2 gloo ranks: activations forward and
    their gradients back by send/recv; each stage its own AdamW and lr schedule, every rank recording its own
    stage under the model's names. lagging=True: stage 1 skips its scheduler's step after step 3 (its lr lags
    from step 4 on: each stage steps its own scheduler, one of them off by one)."""
    import torch.distributed as dist
    from distopt.record import record
    seeded()
    model = mlp()
    stage = model[0:2] if rank == 0 else model[2:5]
    mine = {id(q) for q in stage.parameters()}
    # each parameter whole on its stage's rank (the layout says which stage)
    layout = {q: {"param": n, "shape": list(q.shape), "stage": rank} for n, q in model.named_parameters() if id(q) in mine}
    opt = torch.optim.AdamW(list(stage.parameters()), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.1 * e))
    with warnings.catch_warnings(record=True) as caught, record(opt, trace, layout=layout, stages=2, flush_every=4):
        warnings.simplefilter("always")
        for t in range(1, steps + 1):
            x, y = batch(t)
            opt.zero_grad()
            if rank == 0:
                h = stage(x)
                dist.send(h.detach().contiguous(), 1)
                dh = torch.empty_like(h)
                dist.recv(dh, 1)
                h.backward(dh)
            else:
                h = torch.empty(x.shape[0], 32)
                dist.recv(h, 0)
                h.requires_grad_(True)
                ((stage(h) - y) ** 2).mean().backward()
                dist.send(h.grad.contiguous(), 0)
            opt.step()
            if not (lagging and rank == 1 and t == 3):
                sched.step()
    with open(f"{trace}.warnings{rank}", "w") as f:  # what the recorder warned on this rank, for the test
        f.writelines(str(w.message) + "\n" for w in caught)


# ---- FSDP-style: every parameter in one flat buffer, padded, a contiguous shard per rank --------------------

def _lamb_direction(st, p, group):
    """distopt's lamb's update direction of p (its moments in st advanced, not debiased): m/(sqrt(v)+eps) + wd*p."""
    b1, b2 = group["betas"]
    if not st:
        st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
    st["step"] += 1
    g, m, v = p.grad, st["exp_avg"], st["exp_avg_sq"]
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * (1 - b2) * g)
    return m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p


class FlatLamb(torch.optim.Optimizer):
    """LAMB (ColossalAI's, distopt's lamb: moments not debiased, u = m/(sqrt(v)+eps) + wd*p, trust = |p|/|u|) on
    a rank's shard of a flat buffer that spans several tensors: segs = [(at, len)] the shard's run of each tensor.
    The trust ratio is per tensor: its two sums of squares over the tensor's runs on every rank (all_reduce, in
    double). local_norms=True takes them over this rank's runs only (the bug: the norms of a flat shard)."""

    def __init__(self, params, segs, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, local_norms=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.segs, self.local_norms = segs, local_norms

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        for group in self.param_groups:
            for p in group["params"]:
                u = _lamb_direction(self.state[p], p, group)
                sums = torch.zeros(2 * len(self.segs), dtype=torch.float64)
                for k, (at, n) in enumerate(self.segs):
                    if n:
                        sums[2 * k] = (p[at:at + n].double() ** 2).sum()
                        sums[2 * k + 1] = (u[at:at + n].double() ** 2).sum()
                if not self.local_norms:
                    dist.all_reduce(sums)
                for k, (at, n) in enumerate(self.segs):
                    wn, un = float(sums[2 * k].sqrt()), float(sums[2 * k + 1].sqrt())
                    trust = wn / un if wn > 0 and un > 0 else 1.0
                    p[at:at + n].add_(u[at:at + n], alpha=-group["lr"] * trust)


def fsdp_worker(rank, world, trace, steps, local_norms):
    """The MLP's parameters flattened into one buffer padded to a multiple of the ranks, each rank its contiguous
    shard (a tensor may span two ranks); gradients averaged (all_reduce), FlatLamb on the shard, the shards
    gathered back into the model; recorded with one piece per tensor run of the shard (its "at")."""
    import torch.distributed as dist
    from distopt.record import record
    seeded()
    model = mlp()
    named = list(model.named_parameters())
    offs, total = [], 0
    for _, q in named:
        offs.append(total)
        total += q.numel()
    per = -(-total // world)
    r0, r1 = rank * per, (rank + 1) * per
    flat = torch.zeros(per * world)
    flat[:total] = torch.cat([q.detach().reshape(-1) for _, q in named])
    shard = torch.nn.Parameter(flat[r0:r1].clone())
    segs, pieces = [], []
    for (name, q), off in zip(named, offs):
        a, b = max(off, r0), min(off + q.numel(), r1)
        segs.append((a - r0, b - a) if b > a else (0, 0))
        if b > a:
            pieces.append({"param": name, "shape": list(q.shape), "lo": a - off, "len": b - a, "at": a - r0})
    opt = FlatLamb([shard], segs, local_norms=local_norms)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, adam=False, bias_correction=False)
    with record(opt, trace, name="lamb", hparams=hp, layout={shard: pieces}, flush_every=4):
        for t in range(1, steps + 1):
            x, y = batch(t, rank)
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            g = torch.zeros(per * world)
            g[:total] = torch.cat([q.grad.reshape(-1) for _, q in named])
            dist.all_reduce(g)
            shard.grad = g[r0:r1] / world
            opt.step()
            parts = [torch.zeros(per) for _ in range(world)]
            dist.all_gather(parts, shard.detach().clone())
            full = torch.cat(parts)
            with torch.no_grad():
                for (_, q), off in zip(named, offs):
                    q.copy_(full[off:off + q.numel()].reshape(q.shape))


# ---- a custom optimizer distopt does not implement, sharded by hand (distopt.replay) -------------------------

def with_grads(opt):
    """(group, parameter) of every parameter with a gradient, in param_groups order (a step's loop)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield group, p


class NormalizedMomentum(torch.optim.Optimizer):
    """Heavy-ball momentum normalised by its RMS over the whole tensor: m = mu·m + g; p -= lr·m / (rms(m) + eps).
    States: step (int), momentum_buffer, rms (0-d: a statistic over every element). Sharded (numel given: the
    global element count of each local piece): the sum of squares is all_reduced; from step `local_from` on it
    is taken over the local rows only (the planted bug: a shard-local statistic)."""

    def __init__(self, params, lr=1e-2, momentum=0.9, eps=1e-8, numel=None, local_from=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, eps=eps))
        self.numel, self.local_from = numel, local_from

    @torch.no_grad()
    def step(self, closure=None):
        for group, p in with_grads(self):
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["momentum_buffer"] = torch.zeros_like(p)
            st["step"] += 1
            buf = st["momentum_buffer"].mul_(group["momentum"]).add_(p.grad)
            ss = (buf * buf).sum()
            n = p.numel()
            if self.numel is not None and not (self.local_from and st["step"] >= self.local_from):
                import torch.distributed as dist
                dist.all_reduce(ss)
                n = self.numel[p]
            st["rms"] = (ss / n).sqrt()
            p.add_(buf / (st["rms"] + group["eps"]), alpha=-group["lr"])


def make_normalized(params):
    """The single-device reference of the recordings below (python3 -m distopt.replay REC harness:make_normalized)."""
    return NormalizedMomentum(params, lr=1e-2, momentum=0.9)


def normalized_worker(rank, world, trace, steps, local_from):
    from distopt.record import record
    lo, per, w, bias = row_shard(rank, world)
    opt = NormalizedMomentum([w, bias], lr=1e-2, momentum=0.9, numel={w: ROWS * COLS, bias: ROWS},
                             local_from=local_from)
    layout = {w: {"param": "w", "shape": [ROWS, COLS], "lo": lo * COLS, "states": {"rms": (0, 1)}},
              bias: {"param": "b", "shape": [ROWS], "lo": lo, "states": {"rms": (0, 1)}}}
    with record(opt, trace, layout=layout, flush_every=5):  # no name=: recorded as it is, for distopt.replay
        train_rows(opt, w, bias, lo, per, rank, steps)


# ---- a GaLore-AdamW written here under galore_torch's names (CI has no galore_torch) ----------------------------

class _Projector:
    """galore_torch's projector object's interface as record() reads it: ortho_matrix (the projector)."""

    def __init__(self):
        self.ortho_matrix = None


class GaLoreAdamWStandIn(torch.optim.Optimizer):
    """galore_torch 1.0's GaLoreAdamW semantics (docs/galore.md: HF AdamW on the projected gradient, projector
    from torch.linalg.svd's top-r vectors at 0-based steps 0, T, 2T, ..., std projection), its state keys (step
    int, exp_avg, exp_avg_sq, projector object) and param_groups keys (rank, update_proj_gap, scale, proj_type).
    Named galore_torch.adamw.AdamW below so that record() maps it as it maps the real class. bad_refresh: at that
    step's refresh the projector is a rotation of the right one out of the gradient's top subspace (the planted
    bug the sin theta check must catch)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, correct_bias=True,
                 bad_refresh=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))
        self.bad_refresh = bad_refresh

    @torch.no_grad()
    def step(self, closure=None):
        for group, p in with_grads(self):
            g, st = p.grad, self.state[p]
            if "step" not in st:
                st["step"] = 0
            proj, right = None, g.dim() == 2 and g.shape[0] >= g.shape[1]  # std: project the smaller side
            if "rank" in group:
                proj = st.setdefault("projector", _Projector())
                if proj.ortho_matrix is None or st["step"] % group["update_proj_gap"] == 0:
                    U, S, Vh = torch.linalg.svd(g, full_matrices=False)
                    r = group["rank"]
                    q = Vh[:r].clone() if right else U[:, :r].clone()
                    if self.bad_refresh == st["step"] + 1:  # mix in the next singular vector: another subspace
                        nxt = Vh[r] if right else U[:, r]
                        if right:
                            q[0] = 0.6 * q[0] + 0.8 * nxt
                        else:
                            q[:, 0] = 0.6 * q[:, 0] + 0.8 * nxt
                    proj.ortho_matrix = q
                Q = proj.ortho_matrix
                g = g @ Q.t() if right else Q.t() @ g
            if "exp_avg" not in st:
                st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(g), torch.zeros_like(g)
            b1, b2 = group["betas"]
            st["step"] += 1
            st["exp_avg"].mul_(b1).add_(g, alpha=1.0 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1.0 - b2)
            size = group["lr"]
            if group["correct_bias"]:
                size = size * math.sqrt(1.0 - b2 ** st["step"]) / (1.0 - b1 ** st["step"])
            n = st["exp_avg"] / st["exp_avg_sq"].sqrt().add_(group["eps"])
            if proj is not None:
                Q = proj.ortho_matrix
                n = (n @ Q if right else Q @ n) * group["scale"]
            p.add_(n, alpha=-size)
            if group["weight_decay"] > 0.0:
                p.add_(p, alpha=-group["lr"] * group["weight_decay"])


GaLoreAdamWStandIn.__module__ = "galore_torch.adamw"
GaLoreAdamWStandIn.__name__ = GaLoreAdamWStandIn.__qualname__ = "AdamW"
