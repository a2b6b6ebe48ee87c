"""The torch >= 2 clients of tests/verify (run_client.py dtensor_torch2): DTensor layouts held against the data
torch places on each rank, and FSDP2 / tensor-parallel runs recorded with distopt.record unchanged. One spawned
job of 4 gloo ranks runs every setup in sequence (torch is imported once per rank). Each rank collects its
failures instead of raising (a rank that raised would leave the others waiting in a collective); the parent
reads them from the ranks' result files and fails with the first."""
import itertools
import json
import os

import torch

import harness as H

# tensor shapes of the sweep: uneven, fewer rows than ranks (empty shards), 1-D, 3-D
SHAPES = [[1, 3], [2, 5], [3, 4], [5, 3], [7, 2], [8, 6], [10, 4], [6], [3], [7, 2, 5], [4, 5, 3]]
MESHES = [(4,), (2, 2), (1, 4), (4, 1)]


def _placements(mesh_shape, ndim):
    """Every combination of Replicate, Shard(d) (each d) per mesh dimension; on a 2-D mesh also FSDP2 over a
    TP-split dimension 0 (_StridedShard(0, sf=tp), Shard(0)) and its uneven forms."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    one = [Replicate()] + [Shard(d) for d in range(ndim)]
    out = [list(c) for c in itertools.product(one, repeat=len(mesh_shape))]
    if len(mesh_shape) == 2:
        for sf in (mesh_shape[1], 3):
            out.append([_StridedShard(0, split_factor=sf), Shard(0)])
        out.append([_StridedShard(0, split_factor=mesh_shape[1]), Replicate()])  # not one block: refused
    return out


def layout_sweep(rank, world, fails):
    """For every mesh, shape and placements: the global tensor arange(n) distributed by torch; the rank's local
    tensor must hold exactly the global elements dtensor_layout's piece names, in order (an empty shard: no
    piece), and torch's compute_local_shape_and_global_offset must give the piece's box. Returns the number of
    (mesh, shape, placements) cases checked on this rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from distopt import dtensor_layout
    from distopt.record import _layout_piece
    from distopt.replay import _piece_index
    n_cases = strided = 0
    for mesh_shape in MESHES:
        mesh = init_device_mesh("cpu", mesh_shape)
        coord = mesh.get_coordinate()
        for shape in SHAPES:
            glob = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
            for pls in _placements(mesh_shape, len(shape)):
                what = f"mesh {list(mesh_shape)} shape {shape} {pls} coordinate {coord}"
                # every rank holds the same global tensor: torch splits it locally (src_data_rank=None), which
                # also takes the uneven _StridedShard its padded scatter asserts against
                local = distribute_tensor(glob, mesh, pls, src_data_rank=None).to_local()
                n_cases += 1
                strided += "_S" in str(pls)
                try:
                    spec = dtensor_layout("w", shape, mesh_shape, pls, coord)
                except ValueError as e:
                    idx_local = local.reshape(-1).long().tolist()
                    # refused: right only when the rank's elements are no block and flat range of one
                    if "not one contiguous range" not in str(e) and "are split" not in str(e):
                        fails.append(f"{what}: refused: {e}")
                    elif _is_piece(shape, idx_local):
                        fails.append(f"{what}: refused ({e}) but the local tensor is one piece")
                    continue
                if spec is None:
                    if local.numel() != 0:
                        fails.append(f"{what}: no piece, but the local tensor has {local.numel()} elements")
                    continue
                lp, _ = _layout_piece(shape, spec.get("block"), spec.get("lo", 0), local.numel())
                idx = _piece_index(shape, lp.lo, lp.len, spec.get("block"))
                if not torch.equal(glob.reshape(-1)[idx], local.reshape(-1)):
                    fails.append(f"{what}: the piece {spec} is not the local tensor's elements")
                    continue
                lshape, off = compute_local_shape_and_global_offset(shape, mesh, pls)
                if list(lshape) != list(local.shape):
                    fails.append(f"{what}: torch's local shape {list(lshape)}, the local tensor's {list(local.shape)}")
                box_lo = [0] * len(shape)
                if spec.get("block"):
                    box_lo[spec["block"]["dim"]] = spec["block"]["lo"]
                if "lo" in spec:  # rows of dimension 0 as a flat range of the block
                    per_row = lp.len // max(1, local.shape[0])
                    box_lo[0] = spec["lo"] // per_row
                if list(off) != box_lo and local.numel():
                    fails.append(f"{what}: torch's global offset {list(off)}, the piece's {box_lo}")
    return n_cases, strided


def states_placed_otherwise(rank, world, fails):
    """The recorder's rule for a DTensor state placed otherwise than its parameter (record._plain): of the
    parameter's shape, redistributed to the parameter's placements (a replicated state of a Shard(0) parameter:
    the rank's rows); of another shape (a factored statistic), one ValueError line naming the placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from distopt.record import _plain
    mesh = init_device_mesh("cpu", (world,))
    H.seeded()
    full, row = torch.randn(7, 6), torch.randn(7, 1)
    p = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    st = distribute_tensor(full * 2, mesh, [Replicate()], src_data_rank=None)
    got = _plain(st, p, "state exp_avg of w")
    if not torch.equal(got, (full * 2).chunk(world)[rank] if rank < len(full.chunk(world)) else full[:0]):
        fails.append(f"a replicated state of a Shard(0) parameter: rank {rank} got rows {list(got.shape)}")
    try:
        _plain(distribute_tensor(row, mesh, [Replicate()], src_data_rank=None), p, "state row_var of w")
        fails.append("a factored DTensor state of another shape was not refused")
    except ValueError as e:
        if "\n" in str(e) or "(Replicate())" not in str(e) or "(Shard(dim=0))" not in str(e) or "[7, 1]" not in str(e):
            fails.append(f"the factored state's refusal: {e}")


def _is_piece(shape, idx):
    """Whether flat global indices, in local order, are one block of one dimension and a flat range of it."""
    import math
    for d in range(len(shape)):
        for lo in range(shape[d]):
            for ln in range(1, shape[d] - lo + 1):
                inner = math.prod(shape[d + 1:])
                blk = [o * shape[d] * inner + (lo + r) * inner + i for o in range(math.prod(shape[:d]))
                       for r in range(ln) for i in range(inner)]
                for a in range(len(blk)):
                    if blk[a:a + len(idx)] == idx:
                        return True
    return False


class Two(torch.nn.Module):
    """A small MLP whose middle layer has 3 output rows: FSDP2 over 4 ranks leaves rank 3 an empty shard."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(12, 10)
        self.b = torch.nn.Linear(10, 3)
        self.c = torch.nn.Linear(3, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def fsdp2_adamw(rank, world, out, variant, steps=6):
    """FSDP2 (fully_shard over all ranks) + torch AdamW (variant: default, foreach, fused), recorded as it is."""
    from torch.distributed.fsdp import fully_shard
    from distopt.record import record
    H.seeded()
    model = Two()
    for m in (model.a, model.b, model.c):
        fully_shard(m)
    fully_shard(model)
    kw = {"foreach": True} if variant == "foreach" else {"fused": True} if variant == "fused" else {"foreach": False}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05, **kw)
    with record(opt, out, names=model, flush_every=4):
        for t in range(1, steps + 1):
            H.train_step(model, opt, t, rank)


def _fsdp2_model():
    from torch.distributed.fsdp import fully_shard
    H.seeded()
    model = Two()
    for m in (model.a, model.b, model.c):
        fully_shard(m)
    fully_shard(model)
    return model


def _layout_of(model):
    """The documented layout= of a DTensor model: dtensor_layout of each parameter (None: an empty shard)."""
    from distopt import dtensor_layout
    return {p: dtensor_layout(n, list(p.shape), tuple(p.device_mesh.mesh.shape), tuple(p.placements),
                              p.device_mesh.get_coordinate()) for n, p in model.named_parameters()}


def fsdp2_layout_arg(rank, world, out, steps=4):
    """FSDP2 + AdamW recorded with layout= from dtensor_layout, as docs/verify.md shows (rank 3's entries of b.weight,
    b.bias, c.weight and c.bias are None: empty shards, 3 and 5 rows over 4 ranks)."""
    from distopt.record import record
    model = _fsdp2_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    lay = _layout_of(model)
    with record(opt, out, layout=lay, flush_every=4):
        for t in range(1, steps + 1):
            H.train_step(model, opt, t, rank)
    return sum(v is None for v in lay.values())


def refusal_everywhere(rank, world, out):
    """A layout= that lacks an entry on rank 3 only: every rank raises the same line (none waits)."""
    from distopt.record import record
    model = _fsdp2_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lay = _layout_of(model)
    if rank == 3:
        del lay[model.a.weight]
    try:
        record(opt, out, layout=lay)
    except ValueError as e:
        return str(e)
    return "no refusal"


def fsdp2_mixed(rank, world, out, steps=4):
    """FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on a and b, c left a plain tensor
    (DTensor and plain parameters in one optimizer, the same data on every rank so that c's replicas agree):
    the optimizer holds fp32 shards and fp32 sharded gradients, recorded as they are."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from distopt.record import record
    H.seeded()
    model = Two()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for m in (model.a, model.b):
        fully_shard(m, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    with record(opt, out, names=model, flush_every=4):
        for t in range(1, steps + 1):
            x, y = H.batch(t, 0)
            opt.zero_grad()
            ((model(x).float() - y) ** 2).mean().backward()
            for p in model.c.parameters():  # c is plain: its gradient averaged by hand, as DDP would
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
            opt.step()
    return sorted(type(p).__name__ for p in model.parameters())


def _hsdp_model():
    """Two under HSDP: fully_shard per layer and the root over a (replicate 2, shard 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    H.seeded()
    model = Two()
    for m in (model.a, model.b, model.c):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hsdp_adamw(rank, world, out, steps=4, skip_reduce_rank=None):
    """HSDP: fully_shard over a (replicate 2, shard 2) mesh, placements (Replicate(), Shard(0)); each replica
    group its own data. The replicas' pieces are identical: the lowest rank's gradient drives the replay, every
    rank's values are compared."""
    from distopt.record import record
    model = _hsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    with record(opt, out, names=model, flush_every=4):
        for t in range(1, steps + 1):
            x, y = H.batch(t, rank)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            if rank == skip_reduce_rank and t >= 2:  # as if its replicate all-reduce was skipped from step 2:
                for p in model.parameters():         # the gradient of its own replica group only (x 2 after AVG)
                    p.grad.to_local().mul_(2.0)
            opt.step()
    return [str(pl) for pl in model.a.weight.placements]


def experts_ep(rank, world, out, steps=3):
    """Experts over an ep mesh dimension: a stack of 4 experts [4, 12, 5] placed (Shard(0), Shard(1)) on a
    (ep 2, dp 2) mesh (each ep rank its 2 experts, their input rows split over dp) and the router sharded over
    dp as FSDP2 shards the dense rest (Replicate(), Shard(0)), a soft mixture computed by DTensor's own
    operations (they gather what they need; the gradients come back placed otherwise: Replicate for the stack,
    Partial over dp for the router, which the recorder redistributes to the parameters' placements). The same
    data on every rank. Returns the gradients' placements at step 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from distopt.record import record
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "dp"))
    H.seeded()
    rep = [Replicate(), Replicate()]
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 12, 5) * 0.3, mesh, [Shard(0), Shard(1)]))
    gate = torch.nn.Parameter(distribute_tensor(torch.randn(12, 4) * 0.3, mesh, [Replicate(), Shard(0)]))
    opt = torch.optim.AdamW([w, gate], lr=3e-3, foreach=False)
    seen = None
    with record(opt, out, names={"experts.w": w, "router": gate}):
        for t in range(1, steps + 1):
            x, y = H.batch(t, 0)
            x, y = distribute_tensor(x, mesh, rep), distribute_tensor(y, mesh, rep)
            mix = torch.softmax(x @ gate, dim=-1)
            o = (torch.einsum("bi,eio->beo", x, w) * mix.unsqueeze(-1)).sum(1)
            opt.zero_grad()
            ((o - y) ** 2).mean().backward()
            seen = seen or [repr(w.grad.placements), repr(gate.grad.placements)]
            opt.step()
    return seen


def partial_grad(rank, world, out, steps=3):
    """A replicated DTensor parameter given a Partial gradient (each rank's term of a sum, as during
    accumulation): the recorder redistributes it to the parameter's placements (the sum, what the step's
    DTensor ops use)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from distopt.record import record
    mesh = init_device_mesh("cpu", (world,))
    H.seeded()
    w = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Replicate()]))
    opt = torch.optim.AdamW([w], lr=1e-2, foreach=False)
    with record(opt, out, names={"w": w}):
        for t in range(1, steps + 1):
            g = torch.Generator().manual_seed(1000 * t + rank)
            w.grad = DTensor.from_local(torch.randn(4, 3, generator=g), mesh, [Partial()])
            opt.step()
    return str(w.grad.placements)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(12, 16)
        self.down = torch.nn.Linear(16, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def tp_fsdp2_adamw(rank, world, out, steps=6):
    """The 2-D recipe on a (dp 2, tp 2) mesh: ColwiseParallel / RowwiseParallel over tp, then fully_shard over
    dp (the column-parallel weight becomes (_StridedShard(0, sf=2), Shard(0))); torch AdamW, recorded as it is.
    The data of a dp rank is its own, the same over its tp pair."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from distopt.record import record
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    H.seeded()
    model = Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.05, foreach=False)
    placed = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()}
    dp = mesh.get_coordinate()[0]
    with record(opt, out, names=model, flush_every=4):
        for t in range(1, steps + 1):
            H.train_step(model, opt, t, dp)
    return placed


def agree_pieces(rank, world, out):
    """Schema 5's gradient digests: the 2-D recipe recorded with a digest of every piece. Returns {param: [lo,
    len, block, digest hex]} of this rank at step 1, for the parent to compare over ranks."""
    from distopt._safetensors import read_torch
    tp_fsdp2_adamw(rank, world, out, steps=2)
    torch.distributed.barrier()  # rank 0 writes the index after the last collective: read it after rank 0 did
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    files = [os.path.join(out, e["path"]) for e in index["ranks"][rank]["files"]]
    tensors = {}
    for fp in files:
        tensors.update(read_torch(fp))
    got = {}
    for pc in index["ranks"][rank]["pieces"]:
        d = tensors.get(f"grad_agree/1/{pc['param']}")
        got[pc["param"]] = [pc.get("lo", 0), pc.get("len", -1), pc.get("block"),
                            None if d is None else bytes(d.tolist()).hex()]
    return {"grad_agree": index["record"]["grad_agree"], "pieces": got}


def pipeline_fsdp2(rank, world, out, steps=4):
    """A 2-stage pipeline (torch.distributed.pipelining, GPipe, 2 micro-batches) on a (dp 2, pp 2) mesh, each
    stage fully_shard over dp; torch AdamW per stage, recorded with stage= (the one addition a pipeline needs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from distopt.record import record
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    dp, pp = mesh.get_coordinate()
    H.seeded()
    model = H.mlp()
    part = model[0:2] if pp == 0 else model[2:5]
    fully_shard(part, mesh=mesh["dp"])
    stage = PipelineStage(part, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, y: ((o - y) ** 2).mean())
    opt = torch.optim.AdamW(part.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    with record(opt, out, names=model, stage=pp, stages=2):
        for t in range(1, steps + 1):
            x, y = H.batch(t, dp)
            opt.zero_grad()
            if pp == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])
            opt.step()


class FSDP2Muon(torch.optim.Optimizer):
    """torch.optim.Muon's step by hand on FSDP2 shards (Shard(0) over all ranks): the momentum on the local rows
    (elementwise: torch's operations), the Nesterov update gathered whole (DTensor.full_tensor), torch's own
    Newton-Schulz on it, and the rank's rows of the result (torch's chunk rule: ceil(rows / ranks) per rank).
    bad_offset=True takes them at rank x local rows, right except after a short shard (the planted bug)."""

    def __init__(self, params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, bad_offset=False):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov))
        self.bad_offset = bad_offset

    @torch.no_grad()
    def step(self, closure=None):
        from torch.distributed.tensor import DTensor
        from torch.optim import _muon
        coeffs = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, w = p.grad.to_local(), p.to_local()
                st = self.state[p]
                if not st:
                    st["momentum_buffer"] = torch.zeros_like(g)
                buf = st["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                upd = g.lerp(buf, mu) if group["nesterov"] else buf
                full = DTensor.from_local(upd, p.device_mesh, p.placements, shape=p.shape,
                                          stride=p.stride()).full_tensor()
                o = _muon._zeropower_via_newtonschulz(full, coeffs, _muon.DEFAULT_NS_STEPS, _muon.EPS)
                r, k = p.device_mesh.get_local_rank(), p.device_mesh.size()
                lo = r * w.shape[0] if self.bad_offset else min(r * -(-p.shape[0] // k), p.shape[0])
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(o[lo:lo + w.shape[0]].to(w.dtype), alpha=-_muon._adjust_lr(group["lr"], None, p.shape))


# FSDP2Muon's hyperparameters as distopt's muon: torch.optim.Muon's arithmetic and lr rule (flavor torch)
MUON_HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, use_muon=True, flavor="torch")


def muon_model():
    """Matrices only (Muon's): [10, 12] in rows 3, 3, 3, 1 over 4 ranks; [6, 10] in 2, 2, 2, 0; [5, 6] in 2, 2, 1, 0."""
    L = torch.nn.Linear
    return torch.nn.Sequential(L(12, 10, bias=False), torch.nn.Tanh(), L(10, 6, bias=False), torch.nn.Tanh(),
                               L(6, 5, bias=False))


def make_muon(params):
    """The single-device reference of muon_fsdp2's recordings (distopt.replay): torch.optim.Muon itself."""
    return torch.optim.Muon(params, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def muon_fsdp2(rank, world, out, bad_offset, steps=20):
    from torch.distributed.fsdp import fully_shard
    from distopt.record import record
    H.seeded()
    model = muon_model()
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    opt = FSDP2Muon(model.parameters(), bad_offset=bad_offset)
    # recorded as distopt's muon with torch's arithmetic (verify's reference), and replayable as it is
    with record(opt, out, names=model, flush_every=10, name="muon", hparams=MUON_HPARAMS):
        for t in range(1, steps + 1):
            H.train_step(model, opt, t, rank)


class FSDP2Lamb(torch.optim.Optimizer):
    """distopt's lamb (ColossalAI's: moments not debiased, u = m/(sqrt(v)+eps) + wd*p, trust = |p|/|u|) by hand on
    FSDP2 shards: the moments on the local tensors, the two norms of each parameter summed over its mesh
    (all_reduce of the local sums of squares, in double). local_norms=True: over the local shard only."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, local_norms=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.local_norms = local_norms

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                w, g = p.to_local(), p.grad.to_local()
                st = self.state[p]
                if not st:
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(w), torch.zeros_like(w)
                st["step"] += 1
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(b1).add_(g * (1 - b1))
                v.mul_(b2).add_(g * (1 - b2) * g)
                u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * w
                sums = torch.stack([(w.double() ** 2).sum(), (u.double() ** 2).sum()])
                if not self.local_norms:
                    dist.all_reduce(sums, group=p.device_mesh.get_group())
                wn, un = float(sums[0].sqrt()), float(sums[1].sqrt())
                w.add_(u, alpha=-group["lr"] * (wn / un if wn > 0 and un > 0 else 1.0))


def lamb_fsdp2(rank, world, out, local_norms, steps=4):
    from distopt.record import record
    model = _fsdp2_model()
    opt = FSDP2Lamb(model.parameters(), local_norms=local_norms)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, adam=False, bias_correction=False)
    with record(opt, out, names=model, name="lamb", hparams=hp):
        for t in range(1, steps + 1):
            H.train_step(model, opt, t, rank)


def reshard(rank, world, first, second, bad):
    """A run resumed on another layout: FSDP2 over 4 ranks for 3 steps (recorded: `first`), its parameters and
    AdamW states gathered whole, then HSDP on a (replicate 2, shard 2) mesh from them (a window from step 3:
    `second`) for 3 more. bad=True: exp_avg_sq rebuilt from the old shards in the mesh-transposed rank order
    (0, 2, 1, 3), the same wrong tensor on every rank (the planted bug: the second recording alone is
    consistent; verify --continues names it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor
    from distopt.record import record
    model = _fsdp2_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    with record(opt, first, names=model):
        for t in range(1, 4):
            H.train_step(model, opt, t, rank)
    saved = {}
    for n, p in model.named_parameters():
        st = opt.state[p]
        sq = st["exp_avg_sq"].full_tensor()
        if bad:
            parts = [None] * world
            dist.all_gather_object(parts, st["exp_avg_sq"].to_local())
            sq = torch.cat([parts[r] for r in (0, 2, 1, 3)])
        saved[n] = (p.detach().full_tensor(), st["exp_avg"].full_tensor(), sq, st["step"].clone())
    model2 = _hsdp_model()
    mesh = model2.a.weight.device_mesh
    opt2 = torch.optim.AdamW(model2.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    with torch.no_grad():
        for n, p in model2.named_parameters():
            w, m1, m2, step = saved[n]
            place = lambda full: distribute_tensor(full, mesh, p.placements, src_data_rank=None)  # noqa: E731
            p.to_local().copy_(place(w).to_local())
            opt2.state[p] = {"step": step, "exp_avg": place(m1), "exp_avg_sq": place(m2)}
    with record(opt2, second, names=model2, start_step=3):
        for t in range(4, 7):
            H.train_step(model2, opt2, t, rank)


def worker(rank, world, work):
    fails, info = [], {}
    info["layout_cases"], info["strided_cases"] = layout_sweep(rank, world, fails)
    states_placed_otherwise(rank, world, fails)
    for variant in ("default", "foreach", "fused"):
        try:
            fsdp2_adamw(rank, world, os.path.join(work, f"fsdp2_{variant}.rec"), variant)
        except Exception as e:  # noqa: BLE001
            fails.append(f"fsdp2 {variant}: {type(e).__name__}: {e}")
            break  # the ranks may now disagree on where they are: stop meeting
    else:
        try:
            info["placements_2d"] = tp_fsdp2_adamw(rank, world, os.path.join(work, "tp_fsdp2.rec"))
            info["empty_entries"] = fsdp2_layout_arg(rank, world, os.path.join(work, "fsdp2_layout.rec"))
            info["refusal"] = refusal_everywhere(rank, world, os.path.join(work, "refused.rec"))
            info["mixed"] = fsdp2_mixed(rank, world, os.path.join(work, "fsdp2_mixed.rec"))
            info["partial"] = partial_grad(rank, world, os.path.join(work, "partial.rec"))
            info["agree"] = agree_pieces(rank, world, os.path.join(work, "agree_v5.rec"))
            info["hsdp"] = hsdp_adamw(rank, world, os.path.join(work, "hsdp.rec"))
            hsdp_adamw(rank, world, os.path.join(work, "hsdp_planted.rec"), skip_reduce_rank=3)
            import logging  # DTensor's note on two sequential all_reduces over (ep, dp), once per rank
            logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
            info["experts"] = experts_ep(rank, world, os.path.join(work, "experts.rec"))
            pipeline_fsdp2(rank, world, os.path.join(work, "pipeline.rec"))
            for bad in (False, True):
                muon_fsdp2(rank, world, os.path.join(work, f"muon_{int(bad)}.rec"), bad)
                lamb_fsdp2(rank, world, os.path.join(work, f"lamb_{int(bad)}.rec"), bad)
                reshard(rank, world, os.path.join(work, f"reshard_{int(bad)}_a.rec"),
                        os.path.join(work, f"reshard_{int(bad)}_b.rec"), bad)
        except Exception as e:  # noqa: BLE001
            fails.append(f"2-D, layout=, refusal: {type(e).__name__}: {e}")
    with open(os.path.join(work, f"result{rank}.json"), "w") as f:
        json.dump({"fails": fails, **info}, f)
