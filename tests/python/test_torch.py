#!/usr/bin/env python3
"""CTest python_torch: distopt.Optimizer (python/distopt) against torch.optim.AdamW and the C library.

Environment: PYTHONPATH=<source>/python, DISTOPT_LIBRARY=<build>/libdistopt.so, DISTOPT_CLI=<build>/distopt
(the command-line tool; the cross-check that needs it is skipped without it). Exit 77 (skipped) when this
python3 lacks torch or numpy (Debian python3-torch python3-numpy).

Tolerance against torch.optim.AdamW (test_matches_torch_adamw, test_param_groups_and_scheduler,
test_load_torch_state_dict): the normwise relative error max|a - b| / max|b| of every parameter within
1e-6 and of every state within 1e-5 after 20 steps, as test_golden and interop_ckpt_torch use for AdamW
(docs/golden.md, docs/precision.md): the reference mirrors torch's order of operations, but torch's CPU
kernels fuse some multiply-adds (add_ with alpha) where the reference rounds twice, about one ulp
(6e-8 relative) per differing operation, a few per step, damped by lr on the parameters; the two models
also compute their gradients from their own (slightly different) parameters. Everything else is exact:
distopt against the C library through the CLI, two distopt runs, a state_dict round trip, moved storage.
"""
import copy
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.require("torch", "numpy")
import numpy as np  # noqa: E402
import torch  # noqa: E402

import distopt  # noqa: E402

PARAM_TOL, STATE_TOL = 1e-6, 1e-5
torch.set_num_threads(1)
_gen = torch.Generator().manual_seed(1234)
X = torch.randn(64, 6, generator=_gen)
Y = torch.randn(64, 3, generator=_gen)
observed = {}  # the largest errors against torch, printed at the end


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def groups_of(model, bias_opts=None):
    """Two groups (weights; biases with bias_opts) or one list of every parameter."""
    if bias_opts is None:
        return list(model.parameters())
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": w}, dict(params=b, **bias_opts)]


def train(model, opt, steps, start=0, none_at=(), record=None, sched=None):
    """Steps start .. start+steps-1 on mini-batches of 16; at the steps in none_at the last bias has no
    gradient (grad None). record: a list that receives each step's {name: gradient or None}."""
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        b = (s % 4) * 16
        loss = ((model(X[b:b + 16]) - Y[b:b + 16]) ** 2).mean()
        loss.backward()
        if s in none_at:
            model[2].bias.grad = None
        if record is not None:
            record.append({n: (None if p.grad is None else p.grad.detach().clone())
                           for n, p in model.named_parameters()})
        opt.step()
        if sched is not None:
            sched.step()


def bits(t):
    return t.detach().contiguous().numpy().tobytes()


class Base(unittest.TestCase):
    def assert_same_bits(self, a, b, what):
        self.assertEqual(a.shape, b.shape, what)
        self.assertTrue(bits(a) == bits(b), f"{what}: not bitwise equal (max abs diff "
                                            f"{(a.double() - b.double()).abs().max().item():.3g})")

    def assert_state_dicts_equal(self, sa, sb):
        self.assertEqual(sorted(sa["state"]), sorted(sb["state"]))
        for i in sa["state"]:
            self.assertEqual(sorted(sa["state"][i]), sorted(sb["state"][i]), f"state keys of parameter {i}")
            for k, v in sa["state"][i].items():
                w = sb["state"][i][k]
                if isinstance(v, torch.Tensor):
                    self.assert_same_bits(v, w, f"state[{i}][{k}]")
                else:
                    self.assertEqual(v, w, f"state[{i}][{k}]")
        self.assertEqual(sa["param_groups"], sb["param_groups"])

    def assert_close_to_torch(self, model, opt, tmodel, topt, label, extra=()):
        """extra: distopt's state keys upstream keeps elsewhere (schedulefree: its param group's clock)."""
        worst_p = worst_s = 0.0
        for (n, p), q in zip(model.named_parameters(), tmodel.parameters()):
            e = common.normwise_rel(p.detach().numpy(), q.detach().numpy())
            worst_p = max(worst_p, e)
            self.assertLessEqual(e, PARAM_TOL, f"{label}: parameter {n}: normwise relative error {e:.3g}")
        sd, td = opt.state_dict(), topt.state_dict()
        self.assertEqual(sorted(sd["state"]), sorted(td["state"]), f"{label}: parameters with state")
        for i, ts in td["state"].items():
            ds = sd["state"][i]
            self.assertEqual(sorted(ds), sorted(set(ts) | set(extra)), f"{label}: state keys of parameter {i} (upstream's)")
            if "step" in ts:
                self.assertIsInstance(ds["step"], torch.Tensor, "AdamW's step is a tensor, as torch keeps it")
                self.assertEqual(float(ds["step"]), float(ts["step"]), f"{label}: step of parameter {i}")
            for k in ts:
                if k != "step":
                    e = common.normwise_rel(ds[k].numpy(), ts[k].numpy())
                    worst_s = max(worst_s, e)
                    self.assertLessEqual(e, STATE_TOL, f"{label}: state[{i}][{k}]: normwise relative error {e:.3g}")
        observed[label] = (worst_p, worst_s)


class TestRegistry(Base):
    def test_list(self):
        names = distopt.list()
        self.assertIn("adamw", names)
        self.assertEqual(len(names), len(set(names)))
        details = distopt.list(details=True)
        self.assertEqual([d["name"] for d in details], names)
        cli = os.environ.get("DISTOPT_CLI")
        if cli:  # the command-line tool lists the same registry: "name: summary" lines in order
            out = subprocess.run([cli, "list"], check=True, capture_output=True, text=True).stdout
            listed = [ln.split(": ", 1) for ln in out.splitlines() if ln and not ln.startswith(" ")]
            self.assertEqual([n for n, _ in listed], names)
            self.assertEqual([s for _, s in listed], [d["summary"] for d in details])
        self.assertIn("weight_decay", distopt.describe("adamw"))

    def test_version(self):
        header = os.path.join(common.source_dir(), "include", "distopt", "distopt.h")
        ver = {}
        with open(header) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("DOPT_VERSION_"):
                    ver[parts[1]] = parts[2]
        want = ".".join(ver[f"DOPT_VERSION_{k}"] for k in ("MAJOR", "MINOR", "PATCH"))
        self.assertEqual(distopt.__version__, want)
        with open(os.path.join(common.source_dir(), "python", "pyproject.toml")) as f:
            self.assertIn(f'version = "{want}"', f.read())


class TestAgainstTorch(Base):
    def run_pair(self, hp, none_at=(), bias_opts=None, sched=None, steps=20):
        model, tmodel = make_model(), make_model()
        opt = distopt.Optimizer("adamw", groups_of(model, bias_opts), **hp)
        topt = torch.optim.AdamW(groups_of(tmodel, bias_opts), foreach=False, **hp)
        s1 = s2 = None
        if sched:
            s1, s2 = sched(opt), sched(topt)
        init = [p.detach().clone() for p in model.parameters()]
        train(model, opt, steps, none_at=none_at, sched=s1)
        train(tmodel, topt, steps, none_at=none_at, sched=s2)
        moved = max(common.normwise_rel(p.detach().numpy(), q.numpy()) for p, q in zip(model.parameters(), init))
        self.assertGreater(moved, 1e-3, "the parameters did not move")
        return model, opt, tmodel, topt

    def test_matches_torch_adamw(self):
        for label, hp in (("adamw lr=1e-2 betas=(0.9,0.99) wd=0.1", dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)),
                          ("adamw amsgrad eps=1e-6", dict(lr=3e-3, eps=1e-6, amsgrad=True))):
            with self.subTest(label):
                model, opt, tmodel, topt = self.run_pair(hp, none_at=(3, 4, 11))
                self.assert_close_to_torch(model, opt, tmodel, topt, label)
                # the bias without a gradient at 3 steps took 17 steps, as in torch
                self.assertEqual(float(opt.state_dict()["state"][3]["step"]), 17.0)

    def test_param_groups_and_scheduler(self):
        sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5)  # noqa: E731
        model, opt, tmodel, topt = self.run_pair(dict(lr=1e-2, weight_decay=0.05),
                                                 bias_opts=dict(lr=5e-2, weight_decay=0.0), sched=sched)
        self.assertEqual(len(opt.param_groups), 2)
        self.assertEqual(opt.param_groups[0]["lr"], topt.param_groups[0]["lr"])
        self.assertEqual(opt.param_groups[1]["lr"], topt.param_groups[1]["lr"])
        self.assertEqual(opt.param_groups[1]["weight_decay"], 0.0)
        self.assert_close_to_torch(model, opt, tmodel, topt, "adamw two groups + StepLR")
        # the groups' lr matters: one group at the weights' lr ends elsewhere
        other, oopt, _, _ = self.run_pair(dict(lr=1e-2, weight_decay=0.05), bias_opts=dict(weight_decay=0.0),
                                          sched=sched)
        b1, b2 = model[2].bias.detach().numpy(), other[2].bias.detach().numpy()
        self.assertGreater(common.normwise_rel(b1, b2), 1e-3)


class TestExact(Base):
    HP = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    BIAS = dict(lr=3e-2, weight_decay=0.0)

    def test_cli_bitwise_and_determinism(self):
        cli = os.environ.get("DISTOPT_CLI")
        model = make_model()
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = distopt.Optimizer("adamw", groups_of(model, self.BIAS), **self.HP)
        grads = []
        train(model, opt, 20, none_at=(6, 7), record=grads)
        # determinism: a second run of the same
        again = make_model()
        opt2 = distopt.Optimizer("adamw", groups_of(again, self.BIAS), **self.HP)
        train(again, opt2, 20, none_at=(6, 7))
        for (n, p), q in zip(model.named_parameters(), again.parameters()):
            self.assert_same_bits(p, q, f"second run: {n}")
        self.assert_state_dicts_equal(opt.state_dict(), opt2.state_dict())
        if not cli:
            self.skipTest("DISTOPT_CLI is not set (the distopt tool is not built)")
        names = [n for n, _ in model.named_parameters()]
        with tempfile.TemporaryDirectory() as tmp:
            tensors = {n: init[n].numpy() for n in names}
            for t, step in enumerate(grads, 1):
                for n, g in step.items():
                    if g is not None:
                        tensors[f"grad/{t}/{n}"] = g.numpy()
            src, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            common.st_write(src, tensors)
            cmd = [cli, "run", "--params", src, "--optimizer", "adamw", "--hparams",
                   "lr=0.01,beta1=0.9,beta2=0.99,weight_decay=0.1", "--group", "*.bias:lr=0.03,weight_decay=0",
                   "--out", out, "--quiet"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"{' '.join(cmd)}: {r.stderr}")
            res = common.st_read(out)
        sd = opt.state_dict()
        order = [n for n in names if n.endswith("weight")] + [n for n in names if n.endswith("bias")]  # groups
        params = dict(model.named_parameters())
        for i, n in enumerate(order):
            p = params[n]
            self.assert_same_bits(p, torch.from_numpy(res[f"param/{n}"]), f"CLI param/{n}")
            self.assertEqual(int(res[f"state/{n}/step"]), int(sd["state"][i]["step"]), f"CLI step of {n}")
            for k in ("exp_avg", "exp_avg_sq"):
                self.assert_same_bits(sd["state"][i][k], torch.from_numpy(res[f"state/{n}/{k}"]), f"CLI {n}/{k}")

    def test_state_dict_round_trip(self):
        full = make_model()
        fopt = distopt.Optimizer("adamw", groups_of(full, self.BIAS), **self.HP)
        train(full, fopt, 10, none_at=(2, 7))

        first = make_model()
        opt = distopt.Optimizer("adamw", groups_of(first, self.BIAS), **self.HP)
        train(first, opt, 5, none_at=(2, 7))
        buf = io.BytesIO()
        torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf)

        resumed = make_model(seed=99)  # other weights, other hyperparameters: all come from the checkpoint
        resumed.load_state_dict(saved["model"])
        ropt = distopt.Optimizer("adamw", groups_of(resumed, dict(lr=0.5)), lr=0.1)
        ropt.load_state_dict(saved["opt"])
        self.assert_state_dicts_equal(ropt.state_dict(), saved["opt"])
        self.assertEqual(ropt.param_groups[1]["lr"], 3e-2)
        train(resumed, ropt, 5, start=5, none_at=(2, 7))
        for (n, p), q in zip(full.named_parameters(), resumed.parameters()):
            self.assert_same_bits(p, q, f"resumed {n}")
        self.assert_state_dicts_equal(ropt.state_dict(), fopt.state_dict())

    def test_moved_storage(self):
        full = make_model()
        fopt = distopt.Optimizer("adamw", full.parameters(), **self.HP)
        train(full, fopt, 6)
        moved = make_model()
        opt = distopt.Optimizer("adamw", moved.parameters(), **self.HP)
        train(moved, opt, 3)
        for p in moved.parameters():
            p.data = p.data.clone()  # new storage: the optimizer re-registers it at the next step
        train(moved, opt, 3, start=3)
        for (n, p), q in zip(full.named_parameters(), moved.parameters()):
            self.assert_same_bits(p, q, f"moved {n}")
        self.assert_state_dicts_equal(opt.state_dict(), fopt.state_dict())
        moved[0].bias.data = torch.zeros(13)  # another shape: refused, nothing stepped
        before = moved[0].weight.detach().clone()
        with self.assertRaises(ValueError):
            opt.step()
        self.assertTrue(torch.equal(before, moved[0].weight.detach()))

    def test_closure(self):
        model = make_model()
        opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-2)
        before = model[0].weight.detach().clone()

        def closure():
            opt.zero_grad()
            loss = ((model(X) - Y) ** 2).mean()
            loss.backward()
            return loss

        loss = opt.step(closure)
        self.assertIsInstance(loss, torch.Tensor)
        self.assertFalse(torch.equal(before, model[0].weight.detach()))


class TestTorchStateDict(Base):
    def test_load_torch_state_dict(self):
        hp = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.2)
        tmodel = make_model()
        topt = torch.optim.AdamW(groups_of(tmodel, dict(lr=2e-2)), foreach=False, **hp)
        train(tmodel, topt, 5, none_at=(1,))
        model = make_model(seed=5)
        model.load_state_dict(tmodel.state_dict())
        opt = distopt.Optimizer("adamw", groups_of(model, {}))  # defaults: everything comes from torch's dict
        opt.load_state_dict(topt.state_dict())
        for g, tg in zip(opt.param_groups, topt.param_groups):
            for k in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
                self.assertEqual(g[k], tg[k], k)
        sd, td = opt.state_dict(), topt.state_dict()
        for i, ts in td["state"].items():  # loaded bit for bit under torch's keys
            self.assertEqual(sorted(sd["state"][i]), sorted(ts))
            for k, v in ts.items():
                self.assert_same_bits(sd["state"][i][k], v, f"loaded state[{i}][{k}]")
        train(tmodel, topt, 15, start=5)
        train(model, opt, 15, start=5)
        self.assert_close_to_torch(model, opt, tmodel, topt, "adamw resumed from torch's state_dict")
        # and back: torch.optim.AdamW loads distopt's state_dict, both take 5 more steps
        back = torch.optim.AdamW(groups_of(tmodel, {}), foreach=False)
        tmodel.load_state_dict(model.state_dict())
        back.load_state_dict(opt.state_dict())
        train(tmodel, back, 5, start=20)
        train(model, opt, 5, start=20)
        self.assert_close_to_torch(model, opt, tmodel, back, "torch resumed from distopt's state_dict")

    def test_adafactor_names(self):
        model = make_model()
        opt = distopt.Optimizer("adafactor", model.parameters(), lr=1e-3, relative_step=False, beta1=0.9)
        self.assertEqual(opt.param_groups[0]["eps"], (1e-30, 1e-3))  # HF's eps=(eps1, eps2)
        train(model, opt, 3)
        sd = opt.state_dict()
        self.assertEqual(sorted(sd["state"][0]), ["RMS", "exp_avg", "exp_avg_sq_col", "exp_avg_sq_row", "step"])
        self.assertEqual(sorted(sd["state"][1]), ["RMS", "exp_avg", "exp_avg_sq", "step"])
        self.assertIs(type(sd["state"][0]["step"]), int)
        self.assertEqual(sd["state"][0]["step"], 3)
        again = make_model(seed=3)
        again.load_state_dict(model.state_dict())
        aopt = distopt.Optimizer("adafactor", again.parameters(), lr=1e-3, relative_step=False, beta1=0.9)
        aopt.load_state_dict(copy.deepcopy(sd))
        self.assert_state_dicts_equal(aopt.state_dict(), sd)

    def test_muon_names(self):
        """muon-optimizer 0.1.0's SingleDeviceMuonWithAuxAdam groups and state_dict: use_muon a bool, the aux
        Adam's betas, momentum_buffer for a Muon matrix (no step upstream: it loads as 0), exp_avg/exp_avg_sq
        and an int step for aux Adam; a state_dict in upstream's shape loads and the next steps are bitwise."""
        model = make_model()
        groups = [dict(params=[p for p in model.parameters() if p.ndim == 2], use_muon=True, lr=0.02),
                  dict(params=[p for p in model.parameters() if p.ndim == 1], use_muon=False, betas=(0.8, 0.95))]
        opt = distopt.Optimizer("muon", groups)
        self.assertIs(opt.param_groups[0]["use_muon"], True)
        self.assertIs(opt.param_groups[1]["use_muon"], False)
        self.assertEqual(opt.param_groups[1]["betas"], (0.8, 0.95))
        train(model, opt, 3)
        sd = opt.state_dict()
        self.assertEqual(sorted(sd["state"][0]), ["momentum_buffer", "step"])
        self.assertEqual(sorted(sd["state"][2]), ["exp_avg", "exp_avg_sq", "step"])
        upstream = copy.deepcopy(sd)
        for i in (0, 1):  # upstream keeps no step for a Muon matrix
            del upstream["state"][i]["step"]
        again = make_model(seed=3)
        again.load_state_dict(model.state_dict())
        agroups = [dict(params=[p for p in again.parameters() if p.ndim == 2], use_muon=True, lr=0.02),
                   dict(params=[p for p in again.parameters() if p.ndim == 1], use_muon=False, betas=(0.8, 0.95))]
        aopt = distopt.Optimizer("muon", agroups)
        aopt.load_state_dict(upstream)
        train(model, opt, 2, start=3)
        train(again, aopt, 2, start=3)
        for a, b in zip(model.parameters(), again.parameters()):
            self.assertTrue(torch.equal(a, b))

    @unittest.skipUnless(hasattr(torch.optim, "Adafactor"), "torch.optim.Adafactor needs torch >= 2.5")
    def test_torch_adafactor(self):
        """torch.optim.Adafactor as torch_adafactor: its param_groups spelling (eps=(eps1, eps2), d, beta2_decay,
        maximize, foreach), its state_dict (row_var [h, 1], col_var [1, w], variance, a tensor step) loaded both
        ways, the runs within the golden bounds of each other; recorded from the class with no names written and
        verified; maximize=True refused."""
        hp = dict(lr=2e-2, beta2_decay=-0.6, eps=(1e-6, 1e-3), d=1.5, weight_decay=0.05)
        tmodel = make_model()
        topt = torch.optim.Adafactor(tmodel.parameters(), **hp)
        model = make_model()
        opt = distopt.Optimizer("torch_adafactor", model.parameters(), **hp)
        for k in ("lr", "beta2_decay", "eps", "d", "weight_decay", "maximize", "foreach"):
            self.assertEqual(opt.param_groups[0][k], topt.param_groups[0][k], k)
        train(tmodel, topt, 6, none_at=(2,))
        train(model, opt, 6, none_at=(2,))
        self.assert_close_to_torch(model, opt, tmodel, topt, "torch_adafactor against torch.optim.Adafactor")
        sd, td = opt.state_dict(), topt.state_dict()
        for i, ts in td["state"].items():  # upstream's names and shapes
            self.assertEqual(sorted(sd["state"][i]), sorted(ts), i)
            for k, v in ts.items():
                self.assertEqual(tuple(torch.as_tensor(sd["state"][i][k]).shape), tuple(v.shape), (i, k))
        again = make_model(seed=5)
        again.load_state_dict(tmodel.state_dict())
        aopt = distopt.Optimizer("torch_adafactor", again.parameters())
        aopt.load_state_dict(td)  # torch's dict, hyperparameters included
        for i, ts in td["state"].items():
            for k, v in ts.items():
                self.assert_same_bits(aopt.state_dict()["state"][i][k], v, f"loaded state[{i}][{k}]")
        back = torch.optim.Adafactor(make_model(seed=6).parameters())
        back.load_state_dict(opt.state_dict())  # and distopt's dict into torch's class
        self.assertEqual(back.param_groups[0]["eps"], (1e-6, 1e-3))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            rmodel = make_model(2)
            ropt = torch.optim.Adafactor(rmodel.parameters(), **hp)
            with distopt.record(ropt, path, names=rmodel):
                train(rmodel, ropt, 4)
            res = distopt.verify(path)
            self.assertEqual(res.verdict["kind"], "within_tolerance")
        with self.assertRaises(ValueError):
            distopt.Optimizer("torch_adafactor", make_model().parameters(), maximize=True)

    @unittest.skipUnless(importlib.util.find_spec("schedulefree"), "schedulefree is in the torch-2 test set only")
    def test_adamw_schedulefree(self):
        """schedulefree's AdamWScheduleFree as adamw_schedulefree: steps in train mode and eval()/train() swaps
        within the golden bounds of upstream, a step in eval mode refused as upstream refuses it, z and
        exp_avg_sq under upstream's names; recorded from the class with no names written and verified; modes
        refused on an optimizer without them."""
        import schedulefree
        hp = dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.05, warmup_steps=3, r=0.5)
        tmodel, model = make_model(), make_model()
        topt = schedulefree.AdamWScheduleFree(tmodel.parameters(), **hp)
        opt = distopt.Optimizer("adamw_schedulefree", model.parameters(), **hp)
        self.assertEqual(opt.param_groups[0]["betas"], (0.8, 0.99))
        for start in (0, 4):
            topt.train()
            self.assertIs(opt.train(), opt)
            train(tmodel, topt, 4, start=start)
            train(model, opt, 4, start=start)
            topt.eval()
            opt.eval()
            self.assert_close_to_torch(model, opt, tmodel, topt, f"adamw_schedulefree in eval mode after {start + 4}",
                                       extra=("step", "weight_sum", "lr_max"))
        with self.assertRaises(distopt.Error):  # upstream: "Optimizer was not in train mode"
            train(model, opt, 1, start=8)
        opt.train()
        # eval, train, eval, train: four swaps of every parameter (a call in the current mode swaps nothing)
        self.assertEqual(opt.counters(model[0].weight)["schedulefree.swaps"], 4)
        sd = opt.state_dict()
        self.assertEqual(sorted(sd["state"][0]), ["exp_avg_sq", "lr_max", "step", "weight_sum", "z"])
        # upstream's checkpoint, saved in eval mode (its group keeps k, weight_sum, lr_max, train_mode): loaded, the
        # weights are x until train(); both go on and agree; and upstream loads distopt's state_dict
        again = make_model(seed=7)
        again.load_state_dict(tmodel.state_dict())
        aopt = distopt.Optimizer("adamw_schedulefree", again.parameters(), **hp)
        aopt.load_state_dict(topt.state_dict())
        for o in (topt, aopt):
            o.train()
        train(tmodel, topt, 3, start=8)
        train(again, aopt, 3, start=8)
        self.assert_close_to_torch(again, aopt, tmodel, topt, "adamw_schedulefree resumed from upstream's eval-mode "
                                   "state_dict", extra=("step", "weight_sum", "lr_max"))
        back = schedulefree.AdamWScheduleFree(make_model(seed=8).parameters())
        back.load_state_dict(aopt.state_dict())
        self.assertEqual((back.param_groups[0]["k"], back.param_groups[0]["train_mode"]), (11, True))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            rmodel = make_model(2)
            ropt = schedulefree.AdamWScheduleFree(rmodel.parameters(), **hp)
            ropt.train()
            with distopt.record(ropt, path, names=rmodel):
                train(rmodel, ropt, 4)
            res = distopt.verify(path)
            self.assertEqual(res.verdict["kind"], "within_tolerance", res.stderr)
        with self.assertRaises(distopt.Error):
            distopt.Optimizer("adamw", make_model().parameters()).eval()

    @unittest.skipUnless(importlib.util.find_spec("adam_mini"), "adam-mini is in the torch-2 test set only")
    def test_adam_mini(self):
        """adam-mini's Adam_mini as adam_mini: distopt.adam_mini_groups gives each named parameter upstream's
        block (heads of dim*dim/n_heads, neurons, one per tensor, plain Adam for biases) and decay, and the runs
        agree within the golden bounds; recorded from the class (its one-parameter named groups) with no names
        written and verified."""
        from adam_mini import Adam_mini

        class Mini(torch.nn.Module):
            def __init__(self, seed):
                super().__init__()
                torch.manual_seed(seed)
                self.embed = torch.nn.Linear(6, 8, bias=False)
                self.q_proj = torch.nn.Linear(8, 8)
                self.norm = torch.nn.LayerNorm(8)
                self.mlp = torch.nn.Linear(8, 3)

            def forward(self, x):
                h = torch.tanh(self.embed(x))
                return self.mlp(self.norm(h + self.q_proj(h)))

        dims = dict(dim=8, n_heads=2)  # a head: 32 elements, 4 rows of q_proj
        tmodel, model = Mini(3), Mini(3)
        topt = Adam_mini(tmodel.named_parameters(), lr=1e-2, weight_decay=0.1, verbose=False, **dims)
        groups = distopt.adam_mini_groups(model.named_parameters(), weight_decay=0.1, **dims)
        self.assertEqual([(g["block"], g.get("head_numel"), g["weight_decay"], len(g["params"])) for g in groups],
                         [("neuron", None, 0.1, 2), ("head", 32, 0.1, 1), ("elementwise", None, 0.0, 3),
                          ("tensor", None, 0.0, 1)])
        opt = distopt.Optimizer("adam_mini", groups, lr=1e-2)
        train(tmodel, topt, 6)
        train(model, opt, 6)
        for (n, p), q in zip(model.named_parameters(), tmodel.parameters()):
            e = common.normwise_rel(p.detach().numpy(), q.detach().numpy())
            self.assertLessEqual(e, PARAM_TOL, f"adam_mini {n}: {e:.3g}")
        vq = opt.state[model.q_proj.weight]["vmean"]
        self.assertEqual(tuple(vq.shape), (2, 1))  # one second moment per head, upstream's shape
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            rmodel = Mini(4)
            ropt = Adam_mini(rmodel.named_parameters(), lr=1e-2, weight_decay=0.1, verbose=False, **dims)
            with distopt.record(ropt, path, names=rmodel):
                train(rmodel, ropt, 4)
            res = distopt.verify(path)
            self.assertEqual(res.verdict["kind"], "within_tolerance", res.stderr)

    @unittest.skipUnless(importlib.util.find_spec("pytorch_optimizer"), "pytorch-optimizer is in the torch-2 set")
    def test_normuon(self):
        """pytorch-optimizer's NorMuon as normuon: with upstream's own Newton-Schulz in fp32 (its dtype argument)
        and ns_dtype=fp32 the runs agree within the golden bounds (1e-5); a bf16 run (upstream's default),
        recorded from the class with no names written, verifies within Muon's declared bound."""
        import functools
        import pytorch_optimizer
        from pytorch_optimizer.optimizer.muon import normuon as nm
        hp = dict(lr=2e-2, weight_decay=0.01, beta2=0.9)

        def groups(m, fp32):
            mats = [p for p in m.parameters() if p.ndim >= 2]
            vecs = [p for p in m.parameters() if p.ndim < 2]
            extra = dict(ns_dtype="fp32") if fp32 else {}
            return [dict(params=mats, use_muon=True, **hp, **extra),
                    dict(params=vecs, use_muon=False, lr=3e-4, betas=(0.9, 0.95), **extra)]

        orig = nm.zero_power_via_newton_schulz_5
        nm.zero_power_via_newton_schulz_5 = functools.partial(orig, dtype=torch.float32)
        try:
            tmodel, model = make_model(), make_model()
            topt = pytorch_optimizer.NorMuon([{k: v for k, v in g.items() if k != "ns_dtype"}
                                              for g in groups(tmodel, True)], foreach=False)
            opt = distopt.Optimizer("normuon", groups(model, True))
            train(tmodel, topt, 6)
            train(model, opt, 6)
        finally:
            nm.zero_power_via_newton_schulz_5 = orig
        for (n, p), q in zip(model.named_parameters(), tmodel.parameters()):
            e = common.normwise_rel(p.detach().numpy(), q.detach().numpy())
            self.assertLessEqual(e, 1e-5, f"normuon {n}: {e:.3g}")
        self.assertEqual(tuple(opt.state[model[0].weight]["second_momentum_buffer"].shape), (12, 1))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            rmodel = make_model(2)
            ropt = pytorch_optimizer.NorMuon(groups(rmodel, False), foreach=False)
            with distopt.record(ropt, path, names=rmodel):
                train(rmodel, ropt, 4)
            res = distopt.verify(path)
            self.assertEqual(res.verdict["kind"], "within_tolerance", res.stderr)

    @unittest.skipUnless(importlib.util.find_spec("apollo_torch"), "apollo-torch is in the torch-2 set only")
    def test_apollo(self):
        """apollo-torch's APOLLOAdamW as apollo. Upstream draws its projections with torch's generator: a run
        recorded from the class (no names written) records each draw at its refresh (state["projector"]) and
        verify feeds them back (the projector hook), so the rest of the step is checked within the declared
        bounds; the same for APOLLO-Mini (rank 1, tensor scaling, scale 128). distopt's own draws give another
        run: with both sides on distopt's draws (upstream's stable_randn patched, as the golden entry does) the
        runs agree within the golden bound."""
        import sys
        import types
        if "apollo_torch" not in sys.modules:  # the package's __init__ imports bitsandbytes (GaLoreAdamW8bit only)
            pkg = types.ModuleType("apollo_torch")
            pkg.__path__ = list(importlib.util.find_spec("apollo_torch").submodule_search_locations)
            sys.modules["apollo_torch"] = pkg
        apollo = importlib.import_module("apollo_torch.apollo")

        def groups(m, mini):
            mats = [p for p in m.parameters() if p.ndim == 2]
            vecs = [p for p in m.parameters() if p.ndim < 2]
            proj = (dict(rank=1, scale_type="tensor", scale=128.0) if mini else
                    dict(rank=2, scale_type="channel", scale=1.0))
            return [dict(params=mats, proj="random", update_proj_gap=3, proj_type="std", **proj),
                    dict(params=vecs, weight_decay=0.0)]

        for mini in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "run.rec")
                rmodel = make_model(3)
                ropt = apollo.AdamW(groups(rmodel, mini), lr=1e-2, weight_decay=0.01)
                with distopt.record(ropt, path, names=rmodel):
                    train(rmodel, ropt, 8)
                res = distopt.verify(path)
                self.assertEqual((res.verdict or {}).get("kind"), "within_tolerance", res.stderr)
        # distopt's draws on both sides: upstream's generator replaced for this run only
        rp = importlib.import_module("apollo_torch.random_projector")
        tmodel, model = make_model(), make_model()
        # distopt's draw key of a parameter: its index in the optimizer, groups in order (upstream's count too)
        flat = [p for g in groups(tmodel, False) for p in g["params"]]
        order = {id(p): i for i, p in enumerate(flat)}
        spec = importlib.util.spec_from_file_location(  # the golden entry's port of distopt's generator
            "golden_apollo", os.path.join(common.source_dir(), "datasets", "golden", "entries", "apollo.py"))
        entry = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(entry)

        def stable_randn(shape, seed, device=None, dtype=torch.float32):
            t, q = seed & 0xFFFFFFFF, seed >> 32
            rows, cols = shape
            vals = [entry._gauss(0, t, q, e) for e in range(rows * cols)]
            return torch.tensor(vals, dtype=torch.float64).reshape(rows, cols).to(dtype)

        saved = (rp.stable_randn, rp.next_seed)
        rp.stable_randn, rp.next_seed = stable_randn, lambda seed, adv=0xF: seed + (1 << 32)
        try:
            topt = apollo.AdamW(groups(tmodel, False), lr=1e-2, weight_decay=0.01)
            for p in tmodel.parameters():
                topt.state[p]["seed"] = order[id(p)]
            opt = distopt.Optimizer("apollo", [{k: v for k, v in g.items() if k != "proj"}
                                               for g in groups(model, False)], lr=1e-2, weight_decay=0.01)
            train(tmodel, topt, 8)
            train(model, opt, 8)
        finally:
            rp.stable_randn, rp.next_seed = saved
        for (n, p), q in zip(model.named_parameters(), tmodel.parameters()):
            e = common.normwise_rel(p.detach().numpy(), q.detach().numpy())
            self.assertLessEqual(e, 1e-6, f"apollo {n}: {e:.3g}")
        self.assertEqual(tuple(opt.state[model[0].weight]["exp_avg"].shape), (12, 2))
        self.assertEqual(opt.counters(model[0].weight)["galore.refreshes"], 3)

    @unittest.skipUnless(importlib.util.find_spec("pytorch_optimizer"), "pytorch-optimizer is in the torch-2 set")
    def test_soap(self):
        """pytorch-optimizer's SOAP as soap, recorded from the class with no names written: verify adopts each
        recorded basis where it changes (the first: torch's eigh, whose signs and degenerate eigenvectors are its
        LAPACK's; then the QR refreshes, checked against ours) and checks the rest within the declared bounds.
        The model's first layer (12 x 6) has a rank-deficient first preconditioner (G·Gᵀ of rank 6), so without
        the adoption the replay would follow another basis. A basis refreshed at another step is named."""
        import pytorch_optimizer

        def recorded(freq_after_first=None):
            """distopt.verify of a recorded 10-step SOAP run; freq_after_first: upstream's refresh period from
            step 2 on (each parameter's own copy, which upstream reads), distopt's stays 3."""
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "run.rec")
                rmodel = make_model(4)
                ropt = pytorch_optimizer.SOAP(rmodel.parameters(), lr=1e-2, precondition_frequency=3,
                                              weight_decay=0.01)
                with distopt.record(ropt, path, names=rmodel):
                    train(rmodel, ropt, 1)
                    for st in ropt.state.values():
                        st["precondition_frequency"] = freq_after_first or 3
                    train(rmodel, ropt, 9, start=1)
                return distopt.verify(path)

        res = recorded()
        self.assertEqual((res.verdict or {}).get("kind"), "within_tolerance", res.stdout + res.stderr)
        self.assertIn("SOAP bases:", res.stdout)
        print("\n" + "\n".join(l for l in res.stdout.splitlines() if "SOAP bases" in l or "verdict" in l or
                               "bases(Q)" in l))
        # upstream's refreshes on another schedule than distopt's: named as a basis
        res = recorded(freq_after_first=4)
        self.assertEqual((res.verdict or {}).get("kind"), "basis", res.stdout + res.stderr)

    def test_counters(self):
        """Counters through the binding: muon's Newton-Schulz calls per matrix and its aux Adam steps, per
        parameter and summed (docs/api.md "Counters")."""
        model = make_model()
        mats = [p for p in model.parameters() if p.ndim == 2]
        vecs = [p for p in model.parameters() if p.ndim == 1]
        opt = distopt.Optimizer("muon", [dict(params=mats, use_muon=True), dict(params=vecs, use_muon=False)])
        train(model, opt, 3)
        c = opt.counters(mats[0])
        self.assertEqual((c["steps"], c["muon.ns"], c["muon.ns_iterations"], c["muon.adam"]), (3, 3, 15, 0))
        self.assertEqual(opt.counters(len(mats))["muon.adam"], 3)  # the first vector (groups in order)
        total = opt.counters()
        self.assertEqual((total["muon.ns"], total["muon.adam"]), (3 * len(mats), 3 * len(vecs)))
        with self.assertRaises(ValueError):
            opt.counters(torch.zeros(1))


class TestMore(Base):
    def test_docs_example(self):
        """docs/python.md's five-minute block, run as written in a fresh interpreter."""
        code = common.doc_block("yours = torch.optim.AdamW")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("max normwise relative error after 20 steps", r.stdout)
        print(f"  docs/python.md example: {r.stdout.strip()}")

    def test_group_added_after_steps(self):
        model, tmodel = make_model(), make_model()
        opt = distopt.Optimizer("adamw", [model[0].weight, model[0].bias], lr=1e-2)
        topt = torch.optim.AdamW([tmodel[0].weight, tmodel[0].bias], lr=1e-2, foreach=False)
        train(model, opt, 3)
        train(tmodel, topt, 3)
        opt.add_param_group({"params": [model[2].weight, model[2].bias], "lr": 3e-2})
        topt.add_param_group({"params": [tmodel[2].weight, tmodel[2].bias], "lr": 3e-2})
        train(model, opt, 17, start=3)
        train(tmodel, topt, 17, start=3)
        self.assertEqual(float(opt.state_dict()["state"][2]["step"]), 17.0)
        self.assert_close_to_torch(model, opt, tmodel, topt, "adamw group added after 3 steps")

    def test_wrapper_clock_round_trip(self):
        full = make_model()
        fopt = distopt.Optimizer("lisa", full.parameters(), inner="adamw", lr=1e-2, n_layers=1, interval=2)
        train(full, fopt, 6)
        first = make_model()
        opt = distopt.Optimizer("lisa", first.parameters(), inner="adamw", lr=1e-2, n_layers=1, interval=2)
        train(first, opt, 3)
        sd = copy.deepcopy(opt.state_dict())
        self.assertEqual(sd["distopt"], {"gstep": 3})
        again = make_model(seed=4)
        again.load_state_dict(first.state_dict())
        aopt = distopt.Optimizer("lisa", again.parameters(), inner="adamw", lr=1e-2, n_layers=1, interval=2)
        aopt.load_state_dict(sd)
        train(again, aopt, 3, start=3)
        for (n, p), q in zip(full.named_parameters(), again.parameters()):
            self.assert_same_bits(p, q, f"lisa resumed {n}")
        self.assert_state_dicts_equal(aopt.state_dict(), fopt.state_dict())

    def test_hparams(self):
        hp = distopt.hparams("adamw", lr=0.5)
        self.assertEqual(hp["lr"], 0.5)
        self.assertIs(hp["amsgrad"], False)
        inert = set(distopt._upstream.TABLE["adamw"]["defaults"])  # upstream keys with no effect on the step
        group = distopt.Optimizer("adamw", [torch.zeros(1, requires_grad=True)]).param_groups[0]
        self.assertEqual(sorted(hp), sorted(group.keys() - {"params", "betas"} - inert | {"beta1", "beta2"}))
        # the drop-in: every key torch.optim.AdamW's groups carry, at its defaults unless given (foreach=True
        # kept as given, no effect); maximize=True refused in one line
        w = [torch.zeros(2, requires_grad=True)]
        want = torch.optim.AdamW(w).param_groups[0]
        got = distopt.Optimizer("adamw", w).param_groups[0]
        self.assertEqual(sorted(want.keys() - got.keys()), [], "torch.optim.AdamW's group keys")
        for k in want.keys() & inert:
            self.assertEqual(got[k], want[k], k)
        self.assertIs(distopt.Optimizer("adamw", w, foreach=True).param_groups[0]["foreach"], True)
        two = distopt.Optimizer("adamw", w)
        two.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "fused": False})
        self.assertIs(two.param_groups[1]["fused"], False)
        with self.assertRaises(ValueError) as cm:
            distopt.Optimizer("adamw", w, maximize=True)
        self.assertIn("maximize=True is not supported", str(cm.exception))

    def test_state_before_step_and_read_only(self):
        """opt.state[p] is {} before p's first step (torch's defaultdict gives {}); afterwards read-only copies:
        an assignment to the mapping, an in-place write to a tensor (zero_, copy_, +=, item assignment) raise
        one line rather than being lost; reading and out-of-place operations give plain tensors."""
        model = make_model()
        opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-2)
        p = next(model.parameters())
        self.assertEqual(dict(opt.state[p]), {})
        self.assertNotIn(p, opt.state)
        train(model, opt, 1)
        st = opt.state[p]
        self.assertIs(type(st["exp_avg"] * 2), torch.Tensor)
        self.assertTrue(torch.equal(st["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]))
        writes = [lambda: st["exp_avg"].zero_(), lambda: st["exp_avg"].copy_(torch.zeros_like(st["exp_avg"])),
                  lambda: st["exp_avg"].__setitem__(0, 1.0), lambda: st["exp_avg"].__iadd__(1.0)]
        for w in writes:
            with self.assertRaises(RuntimeError) as cm:
                w()
            self.assertIn("read-only copies", str(cm.exception))
            self.assertNotIn("\n", str(cm.exception))
        with self.assertRaises(TypeError):
            st["exp_avg"] = torch.zeros(1)
        self.assertTrue(torch.equal(opt.state[p]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]))


class TestErrors(Base):
    def test_errors(self):
        model = make_model()
        with self.assertRaises(distopt.Error) as cm:
            distopt.Optimizer("adamw", model.parameters(), lr=-1)
        e = cm.exception
        self.assertIsInstance(e, RuntimeError)
        self.assertEqual(e.status_name, "DOPT_ERR_INVALID_ARG")
        self.assertTrue(str(e).startswith("DOPT_ERR_INVALID_ARG: "), str(e))
        self.assertIn("lr=-1", str(e))
        self.assertNotIn("\n", str(e))
        with self.assertRaises(distopt.Error) as cm:
            distopt.Optimizer("adamw", model.parameters(), lr=1e-3, bogus=1)
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_NOT_FOUND")
        self.assertIn("bogus", str(cm.exception))
        with self.assertRaises(distopt.Error) as cm:
            distopt.Optimizer("no_such_optimizer", model.parameters())
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_NOT_FOUND")

        opt = distopt.Optimizer("adamw", [model[0].weight], lr=1e-2)
        with self.assertRaises(distopt.Error) as cm:  # a bad group leaves the optimizer as it was
            opt.add_param_group({"params": [model[0].bias], "betas": (0.9, 1.5)})
        self.assertIn("beta2=1.5", str(cm.exception))
        self.assertEqual(len(opt.param_groups), 1)
        opt.add_param_group({"params": [model[0].bias], "lr": 0.5})
        train(model, opt, 1)
        self.assertEqual(sorted(opt.state_dict()["state"]), [0, 1])
        opt.param_groups[0]["lr"] = -2.0  # a schedule gone wrong: rejected at the next step
        with self.assertRaises(distopt.Error) as cm:
            opt.step()
        self.assertIn("lr=-2", str(cm.exception))
        opt.param_groups[0]["lr"] = 1e-2
        opt.param_groups[0]["amsgrad"] = True  # a state layout change after the first step
        with self.assertRaises(distopt.Error) as cm:
            opt.step()
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_STATE")
        with self.assertRaises(TypeError):
            distopt.Optimizer("adamw", [torch.zeros(3, dtype=torch.float64, requires_grad=True)])
        bad = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], maximize=True).state_dict()
        one = distopt.Optimizer("adamw", [torch.zeros(2, requires_grad=True)])
        with self.assertRaises(ValueError):
            one.load_state_dict(bad)

    def test_state_repr_groups(self):
        """opt.state[p] as torch optimizers keep it; a repr that names the optimizer; group numbers in
        messages as param_groups numbers them; betas= with beta1= refused."""
        model = make_model()
        opt = distopt.Optimizer("adamw", groups_of(model, {"weight_decay": 0.0}), lr=1e-2)
        self.assertEqual(len(opt.state), 0)
        train(model, opt, 2)
        sd = opt.state_dict()
        params = [p for g in opt.param_groups for p in g["params"]]
        self.assertEqual(len(opt.state), len(params))
        for i, p in enumerate(params):
            st = opt.state[p]
            self.assertEqual(sorted(st), sorted(sd["state"][i]))
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(st[k].shape, p.shape)
                self.assertTrue(torch.equal(st[k], sd["state"][i][k]))
            self.assertEqual(float(st["step"]), 2.0)
            self.assertIn(p, opt.state)
        self.assertEqual(list(opt.state), params)
        self.assertEqual(opt.state.get(torch.zeros(1), {}), {})  # not a parameter of it
        g = distopt.Optimizer("galore_adamw8bit", model.parameters(), rank=4).param_groups[0]
        for key, want in (("rank", 4), ("update_proj_gap", 200), ("block_size", 256), ("min_8bit_size", 4096),
                          ("percentile_clipping", 100), ("oversample", -1), ("seed", 0)):
            self.assertIs(type(g[key]), int, key)  # integers stay integers, as upstream keeps them
            self.assertEqual(g[key], want, key)
        for key in ("lr", "eps", "weight_decay", "scale"):
            self.assertIs(type(g[key]), float, key)
        self.assertIs(type(distopt.Optimizer("adafactor", model.parameters()).param_groups[0]["clip_threshold"]),
                      float)
        r = repr(opt)
        self.assertTrue(r.startswith("distopt.Optimizer('adamw') ("), r)
        self.assertIn(f"Parameter Group 1 ({len(opt.param_groups[1]['params'])} parameter", r)
        opt.param_groups[1]["lr"] = -3.0
        with self.assertRaises(distopt.Error) as cm:
            opt.step()
        self.assertIn("param_groups[1]: adamw: lr=-3", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            distopt.Optimizer("adamw", model.parameters(), betas=(0.9, 0.99), beta1=0.5)
        self.assertIn("both set beta1", str(cm.exception))

    def test_lamb_state_dict_with_diagnostics(self):
        """torch_optimizer.Lamb (and ColossalAI's) keep weight_norm, adam_norm and trust_ratio per parameter as
        diagnostics of the last step: such a state_dict loads, the diagnostics ignored, and resumes exactly."""
        model = make_model(5)
        a = distopt.Optimizer("lamb", model.parameters(), lr=1e-2, weight_decay=0.01)
        train(model, a, 3)
        sd = a.state_dict()
        for st in sd["state"].values():
            st.update(weight_norm=torch.tensor(1.5), adam_norm=torch.tensor(0.5), trust_ratio=torch.tensor(3.0))
        for g in sd["param_groups"]:
            g.update(clamp_value=10, debias=False)  # torch_optimizer's other keys stay in the group
        saved = [p.detach().clone() for p in model.parameters()]
        b = distopt.Optimizer("lamb", model.parameters(), lr=1e-2, weight_decay=0.01)
        b.load_state_dict(sd)
        self.assertEqual(b.param_groups[0]["clamp_value"], 10)
        for i, st in b.state_dict()["state"].items():
            self.assertEqual(sorted(st), ["exp_avg", "exp_avg_sq", "step"])
        train(model, a, 1, start=3)
        after_a = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p, s0 in zip(model.parameters(), saved):
                p.copy_(s0)
        train(model, b, 1, start=3)
        for x, y in zip(after_a, model.parameters()):
            self.assertEqual(bits(x), bits(y))

    def test_low_precision_and_channels_last(self):
        """bf16 and fp16 parameters step an fp32 master kept by distopt.Optimizer and are written back rounded
        to nearest even; a channels_last convolution is copied in and out and stays channels_last. Against
        torch AdamW stepping the same fp32 master on the same fp32 gradients: masters within PARAM_TOL (the
        AdamW tolerance of docs/golden.md), and every low-precision weight exactly its master rounded."""
        for dt in (torch.bfloat16, torch.float16):
            torch.manual_seed(11)
            model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3)).to(dt)
            masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
            opt = distopt.Optimizer("adamw", model.parameters(), lr=1e-2)
            topt = torch.optim.AdamW(masters, lr=1e-2, foreach=False)
            m32 = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
            opt32 = distopt.Optimizer("adamw", m32, lr=1e-2)  # the same step on fp32 masters: bitwise
            for s in range(6):
                if s == 3:  # every 5th weight written outside: those masters follow, the others keep their bits
                    with torch.no_grad():
                        w = model[0].weight.view(-1)
                        new = torch.linspace(-0.5, 0.5, w[::5].numel()).to(dt)
                        changed = new != m32[0].detach().view(-1)[::5].to(dt)
                        w[::5] = new
                        m32[0].view(-1)[::5][changed] = new[changed].float()
                        masters[0].view(-1)[::5][changed] = new[changed].float()
                    self.assertTrue(bool(changed.any()))
                opt.zero_grad(set_to_none=True)
                if dt == torch.bfloat16:  # a real backward in bf16
                    ((model(X[:16].to(dt)).float() - Y[:16]) ** 2).mean().backward()
                else:  # torch 1.13 has no fp16 matmul on the CPU: fp16 gradients drawn
                    for p in model.parameters():
                        p.grad = (0.1 * torch.randn(p.shape)).to(dt)
                for p, m, q in zip(model.parameters(), masters, m32):
                    m.grad = p.grad.float()
                    q.grad = p.grad.float()
                opt.step()
                topt.step()
                opt32.step()
            sd = opt.state_dict()
            for i, (p, m) in enumerate(zip(model.parameters(), masters)):
                self.assertEqual(p.dtype, dt)
                mine = sd["state"][i]["master"]
                self.assertTrue(torch.equal(p.detach().view(torch.int16), mine.to(dt).view(torch.int16)),
                                f"{dt} parameter {i}: not its master rounded")
                self.assertEqual(bits(mine), bits(m32[i].detach()), f"{dt} master {i}: not the fp32 step's bits")
                e = common.normwise_rel(mine.numpy(), m.detach().numpy())
                self.assertLessEqual(e, PARAM_TOL, f"{dt} master {i}: {e:.3g}")
                self.assertIn("exp_avg", opt.state[p])
            # the master survives a state_dict round trip; weights changed outside re-seed it
            b = distopt.Optimizer("adamw", model.parameters(), lr=1e-2)
            b.load_state_dict(sd)
            self.assertEqual(bits(b.state_dict()["state"][0]["master"]), bits(sd["state"][0]["master"]))
            with torch.no_grad():
                model[0].weight.fill_(0.5)
            model[0].weight.grad = torch.zeros_like(model[0].weight)
            b.step()
            moved = (b.state_dict()["state"][0]["master"] - 0.5).abs().max().item()
            self.assertLess(moved, 0.02, "the master did not follow the weights")  # one step of lr 1e-2 from 0.5
        # channels_last: a 4-D convolution weight whose strides are NHWC
        torch.manual_seed(12)
        conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        ref = torch.nn.Conv2d(3, 4, 3)
        ref.load_state_dict(conv.state_dict())
        self.assertFalse(conv.weight.is_contiguous())
        opt = distopt.Optimizer("adamw", conv.parameters(), lr=1e-2)
        topt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        img = torch.randn(2, 3, 8, 8)
        for _ in range(5):
            for m, o in ((conv, opt), (ref, topt)):
                o.zero_grad(set_to_none=True)
                m(img).pow(2).mean().backward()
                o.step()
        self.assertTrue(conv.weight.is_contiguous(memory_format=torch.channels_last))
        for p, q in zip(conv.parameters(), ref.parameters()):
            e = common.normwise_rel(p.detach().contiguous().numpy(), q.detach().numpy())
            self.assertLessEqual(e, PARAM_TOL, f"channels_last: {e:.3g}")
        with self.assertRaises(TypeError):  # still refused: other dtypes
            distopt.Optimizer("adamw", [torch.zeros(3, dtype=torch.float64, requires_grad=True)])

    def test_record_float_state(self):
        """A state an optimizer keeps as a Python float (HF-style running scalars, ColossalAI's RMS) is recorded as
        a 0-d F32 tensor, not dropped; verify shows it as not compared where the reference keeps no such state,
        and the recording still verifies within tolerance."""
        class ScaledAdamW(torch.optim.AdamW):
            def step(self, closure=None):
                loss = super().step(closure)
                for group in self.param_groups:
                    for p in group["params"]:
                        st = self.state[p]
                        st["scale"] = 0.5 * float(st["step"]) + 0.25  # a Python float
                return loss

        model = make_model(5)
        opt = ScaledAdamW(model.parameters(), lr=1e-2, foreach=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            with distopt.record(opt, path, names=model, name="adamw",
                                hparams=dict(lr=0.01, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.01,
                                             amsgrad=False)):
                train(model, opt, 3)
            found = []
            for f in sorted(os.listdir(os.path.join(path, "rank0"))):
                with open(os.path.join(path, "rank0", f), "rb") as fh:
                    head = fh.read(65536)
                found += [k for k in (b"state/3/0.weight/scale", b"state/2/2.bias/scale") if k in head]
            self.assertEqual(len(found), 2, f"float states recorded: {found}")
            res = distopt.verify(path)
            self.assertEqual(res.verdict["kind"], "within_tolerance")

    def test_record_distopt_optimizer(self):
        """distopt.record knows distopt.Optimizer by its name and records its states (opt.state)."""
        model = make_model(3)
        opt = distopt.Optimizer("adamw", groups_of(model, {"weight_decay": 0.0}), lr=1e-2)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.rec")
            with distopt.record(opt, path, names=model):
                train(model, opt, 4)
            block = sorted(os.listdir(os.path.join(path, "rank0")))[0]
            with open(os.path.join(path, "rank0", block), "rb") as f:
                head = f.read(16384)
            for key in (b"state/1/0.weight/exp_avg_sq", b"state/4/2.bias/exp_avg", b"state/4/2.bias/step"):
                self.assertIn(key, head)
            self.assertEqual(distopt.verify(path).verdict["kind"], "within_tolerance")

    def test_no_crash_no_wrap(self):
        """What used to crash or wrap is a one-line distopt.Error; p.data reassigned by another thread during
        step() 1 000 times never crashes."""
        import threading
        p = torch.nn.Parameter(torch.randn(64, 8))
        opt = distopt.Optimizer("adamw", [p], lr=1e-3)
        stop = threading.Event()

        def reassign():
            while not stop.is_set():
                p.data = torch.randn(64, 8)

        th = threading.Thread(target=reassign)
        th.start()
        refused = 0
        try:
            for _ in range(1000):
                p.grad = torch.randn(64, 8)
                try:
                    opt.step()
                except distopt.Error as e:
                    # Rarely (seen ~1 in 10^4 steps on a loaded 2-core machine, also with the C step replaced by
                    # a no-op) torch 1.13 presents the fresh gradient with a 4-byte storage while the other
                    # thread reassigns p.data; the library must refuse that step, not read past the storage.
                    self.assertIn("the gradient of parameter 0: its storage holds", str(e))
                    refused += 1
        finally:
            stop.set()
            th.join()
        self.assertLessEqual(refused, 10)
        self.assertEqual(opt.state_dict()["state"][0]["step"].item(), 1000.0 - refused)

        def one_line(cm, *needles):
            self.assertNotIn("\n", str(cm.exception))
            for n in needles:
                self.assertIn(n, str(cm.exception))

        q = torch.nn.Parameter(torch.randn(16))
        opt = distopt.Optimizer("adamw", [q])
        q.grad = torch.randn(16)
        opt.step()
        q.data.storage().resize_(4)  # the registered storage shrank under the optimizer
        with self.assertRaises(distopt.Error) as cm:
            opt.step()
        one_line(cm, "parameter 0", "storage holds 16 bytes", "needs 64")
        w = torch.nn.Parameter(torch.randn(3, 2))
        w.grad = torch.randn(3, 2)
        opt = distopt.Optimizer("adamw", [w])
        opt.step()
        for bad in (torch.tensor(1e30), 2**70, -1, 2.5, "7"):
            sd = opt.state_dict()
            sd["state"][0]["step"] = bad
            with self.assertRaises(distopt.Error) as cm:
                opt.load_state_dict(sd)
            one_line(cm, "the step of parameter 0")
        self.assertEqual(opt.state_dict()["state"][0]["step"].item(), 1.0)  # nothing loaded
        lisa = distopt.Optimizer("lisa", [w], inner="adamw", n_layers=1)
        sd = lisa.state_dict()
        sd["distopt"] = {"gstep": 2**70}
        with self.assertRaises(distopt.Error) as cm:
            lisa.load_state_dict(sd)
        one_line(cm, "gstep", "outside [0, 2^63 - 1]")
        with self.assertRaises(distopt.Error) as cm:
            distopt.Optimizer("adamw", None)
        one_line(cm, "params is None")
        ada = distopt.Optimizer("adafactor", [torch.nn.Parameter(torch.randn(3, 2))])
        ada.param_groups[0]["params"][0].grad = torch.randn(3, 2)
        ada.step()
        with self.assertRaises(distopt.Error) as cm:  # another optimizer's state_dict
            opt.load_state_dict(ada.state_dict())
        one_line(cm, "param_groups[0]", "eps=(1e-30, 0.001)", "another optimizer")
        with self.assertRaises(distopt.Error):
            opt.load_state_dict([1, 2])


def tearDownModule():
    for label, (p, s) in observed.items():
        print(f"observed vs torch: {label}: parameters {p:.3g} (tolerance {PARAM_TOL:g}), "
              f"states {s:.3g} (tolerance {STATE_TOL:g})")


if __name__ == "__main__":
    print(f"distopt {distopt.__version__} from {distopt.library_path}; torch {torch.__version__}, numpy {np.__version__}")
    common.main()
