#!/usr/bin/env python3
"""CTest python_numpy: distopt.NumpyOptimizer with torch blocked (sys.modules["torch"] = None, so any
import of torch fails): the package imports and steps numpy arrays without it.

Environment as test_torch.py (PYTHONPATH, DISTOPT_LIBRARY, optionally DISTOPT_CLI). Exit 77 (skipped) when
this python3 lacks numpy.

Exactness: AdamW's reference step (ref/adamw.c) is elementwise fp32 arithmetic, each operation rounded
once (no contraction, -ffp-contract=off), with the step's scalars computed in double and rounded to fp32
once. numpy's float32 +, *, / and sqrt are the same correctly rounded IEEE operations, so the same
formula written here in numpy, in the same order, must give the same bits; and the CLI (the C library
through another path) too.
"""
import os
import subprocess
import sys
import tempfile
import unittest

sys.modules["torch"] = None  # blocks torch: `import torch` raises ImportError from here on
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

common.require("numpy")
import numpy as np  # noqa: E402

os.environ.setdefault("DOPT_NUM_THREADS", "2")  # the library's step pool (TestMisuse: threads sharing it)
import distopt  # noqa: E402

F = np.float32
SHAPES = {"w1": (4, 5), "b1": (5,), "w2": (5, 3), "scale": ()}


def problem(seed=7):
    rng = np.random.default_rng(seed)
    init = {n: rng.standard_normal(s).astype(F) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(F) for n, s in SHAPES.items()} for _ in range(20)]
    for t in (4, 5, 13):
        grads[t]["b1"] = None  # no gradient at these steps
    return init, grads


def adamw_numpy(w, m, v, g, t, lr, b1, b2, eps, wd):
    """One torch-AdamW step in fp32 numpy, in ref/adamw.c's order of operations (in place)."""
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    decay, neg_step = F(1.0 - lr * wd), F(-(lr / bc1))
    bc2_sqrt = F(np.sqrt(bc2))
    wi = w * decay
    mi = m * F(b1) + F(1.0 - b1) * g
    vi = v * F(b2) + (F(1.0 - b2) * g) * g
    denom = np.sqrt(vi) / bc2_sqrt + F(eps)
    w[...] = wi + (neg_step * mi) / denom
    m[...] = mi
    v[...] = vi


class TestNumpy(unittest.TestCase):
    HP = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    GROUP1 = dict(lr=3e-2, weight_decay=0.0)  # b1 and scale

    def build(self, init, hp=None):
        opt = distopt.NumpyOptimizer("adamw", **(hp or self.HP))
        g1 = opt.add_group(**self.GROUP1)
        arrays = {n: a.copy() for n, a in init.items()}
        for n in SHAPES:
            opt.add_param(arrays[n], group=g1 if n in ("b1", "scale") else 0, name=n)
        return opt, arrays

    def run_steps(self, opt, grads, start, stop):
        for t in range(start, stop):
            opt.step([grads[t][n] for n in SHAPES])

    def test_torch_is_blocked(self):
        self.assertIsNone(sys.modules["torch"])
        with self.assertRaises(ImportError):
            distopt.Optimizer  # noqa: B018 (the torch frontend needs torch)
        self.assertIn("adamw", distopt.list())

    def test_bitwise_vs_numpy_formula_and_cli(self):
        init, grads = problem()
        opt, arrays = self.build(init)
        ids = [id(a) for a in arrays.values()]
        self.run_steps(opt, grads, 0, 20)
        self.assertEqual(ids, [id(a) for a in opt.params])  # the same arrays, updated in place
        ref = {n: (a.copy(), np.zeros_like(a), np.zeros_like(a), [0]) for n, a in init.items()}
        for t in range(20):
            for n, (w, m, v, steps) in ref.items():
                g = grads[t][n]
                if g is None:
                    continue
                steps[0] += 1
                hp = dict(self.HP, **self.GROUP1) if n in ("b1", "scale") else self.HP
                adamw_numpy(w, m, v, g, steps[0], hp["lr"], hp["beta1"], hp["beta2"], hp["eps"], hp["weight_decay"])
        for i, n in enumerate(SHAPES):
            w, m, v, steps = ref[n]
            st = opt.state(i)
            self.assertEqual(st["step"], steps[0], n)
            self.assertEqual(arrays[n].tobytes(), w.tobytes(), f"{n}: parameter differs from the numpy formula")
            self.assertEqual(st["exp_avg"].tobytes(), m.tobytes(), f"{n}: exp_avg")
            self.assertEqual(st["exp_avg_sq"].tobytes(), v.tobytes(), f"{n}: exp_avg_sq")
            moved = np.abs(w.astype(np.float64) - init[n]).max()
            self.assertGreater(moved, 1e-3, f"{n} did not move")
        self.assertEqual(opt.state(1)["step"], 17)
        cli = os.environ.get("DISTOPT_CLI")
        if not cli:
            self.skipTest("DISTOPT_CLI is not set")
        with tempfile.TemporaryDirectory() as tmp:
            tensors = dict(init)
            for t, step in enumerate(grads, 1):
                for n, g in step.items():
                    if g is not None:
                        tensors[f"grad/{t}/{n}"] = g
            src, out = os.path.join(tmp, "in.safetensors"), os.path.join(tmp, "out.safetensors")
            common.st_write(src, tensors)
            hp = ",".join(f"{k}={v!r}" for k, v in self.HP.items())
            r = subprocess.run([cli, "run", "--params", src, "--optimizer", "adamw", "--hparams", hp,
                                "--group", "b1:lr=0.03,weight_decay=0", "--group", "scale:lr=0.03,weight_decay=0",
                                "--out", out, "--quiet"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            res = common.st_read(out)
        for i, n in enumerate(SHAPES):
            self.assertEqual(res[f"param/{n}"].tobytes(), arrays[n].tobytes(), f"CLI param/{n}")
            st = opt.state(i)
            for k in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(res[f"state/{n}/{k}"].tobytes(), st[k].tobytes(), f"CLI state/{n}/{k}")

    def test_state_round_trip(self):
        init, grads = problem(11)
        full, farr = self.build(init)
        self.run_steps(full, grads, 0, 10)
        first, arr = self.build(init)
        self.run_steps(first, grads, 0, 5)
        saved = [first.state(i) for i in range(len(SHAPES))]
        second, arr2 = self.build(arr, hp=dict(self.HP, lr=0.5))  # group 0's lr set back below
        second.set_hparam("lr", self.HP["lr"])
        for k in self.HP:
            self.assertEqual(second.get_hparam(k), self.HP[k], k)
        for i, st in enumerate(saved):
            second.load_state(i, st)
        self.run_steps(second, grads, 5, 10)
        for i, n in enumerate(SHAPES):
            self.assertEqual(arr2[n].tobytes(), farr[n].tobytes(), f"resumed {n}")
            a, b = second.state(i), full.state(i)
            self.assertEqual(sorted(a), sorted(b))
            for k in a:
                if k == "step":
                    self.assertEqual(a[k], b[k])
                else:
                    self.assertEqual(a[k].tobytes(), b[k].tobytes(), f"resumed {n}/{k}")
        allocated, full_bytes = second.state_bytes()
        want = sum(v.nbytes for i in range(len(SHAPES)) for k, v in second.state(i).items() if k != "step")
        self.assertEqual((allocated, full_bytes), (want, want))

    def test_groups_and_hparams(self):
        opt = distopt.NumpyOptimizer("adafactor", lr=1e-3, relative_step=False)
        self.assertEqual(opt.hparams()["lr"], 1e-3)
        self.assertIs(opt.hparams()["relative_step"], False)
        self.assertIsNone(opt.hparams()["beta1"])
        g = opt.add_group(beta1=0.9)
        self.assertEqual(opt.num_groups, 2)
        self.assertEqual(opt.get_hparam("beta1", group=g), 0.9)
        w = np.ones((3, 4), F)
        opt.add_param(w, group=g)
        opt.step([np.full((3, 4), 0.5, F)])
        self.assertEqual(sorted(opt.state(0)), ["RMS", "exp_avg", "exp_avg_sq_col", "exp_avg_sq_row", "step"])
        # an enum key by name: the default's name, a choice given at creation, one set later
        self.assertEqual(distopt.hparams("galore_adamw")["proj_type"], "std")
        ga = distopt.NumpyOptimizer("galore_adamw", proj_type="reverse_std")
        self.assertEqual(ga.get_hparam("proj_type"), "reverse_std")
        ga.set_hparam("proj_type", "left")
        self.assertEqual(ga.get_hparam("proj_type"), "left")
        with self.assertRaises(distopt.Error):
            ga.set_hparam("proj_type", "sideways")

    def test_docs_example(self):
        """docs/python.md's numpy block, as written (here, with torch blocked)."""
        scope = {}
        exec(compile(common.doc_block("NumpyOptimizer"), "docs/python.md", "exec"), scope)
        opt = scope["opt"]
        self.assertEqual(opt.get_step(0), 1)
        self.assertEqual(opt.get_step(1), 0)  # b had no gradient
        self.assertEqual((opt.counters(0)["steps"], opt.counters(1)["steps"]), (1, 0))  # the counters agree
        self.assertEqual(opt.gstep, 1)
        self.assertEqual(opt.param_names, ["param0", "fc.bias"])
        self.assertEqual(opt.hparams(1)["weight_decay"], 0.0)
        with distopt.NumpyOptimizer("adamw") as o:
            o.add_param(np.zeros(2, F))
        with self.assertRaises(ValueError):
            o.step([None])  # closed

    def test_errors(self):
        with self.assertRaises(distopt.Error) as cm:
            distopt.NumpyOptimizer("adamw", lr=-1)
        self.assertIsInstance(cm.exception, RuntimeError)
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_INVALID_ARG")
        self.assertIn("lr=-1", str(cm.exception))
        with self.assertRaises(distopt.Error) as cm:
            distopt.NumpyOptimizer("adamw", bogus=2)
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_NOT_FOUND")
        opt = distopt.NumpyOptimizer("adamw")
        with self.assertRaises(TypeError):
            opt.add_param(np.zeros(3))  # float64
        with self.assertRaises(ValueError):
            opt.add_param(np.zeros((4, 4), F)[:, ::2])  # not contiguous
        w = np.zeros(3, F)
        opt.add_param(w)
        with self.assertRaises(ValueError):
            opt.step([])
        with self.assertRaises(ValueError):
            opt.step([np.zeros(4, F)])
        with self.assertRaises(distopt.Error) as cm:
            opt.set_hparam("beta2", 1.0)
        self.assertIn("beta2=1", str(cm.exception))
        opt.step([np.ones(3, F)])
        with self.assertRaises(distopt.Error) as cm:
            opt.set_hparam("amsgrad", True)
        self.assertEqual(cm.exception.status_name, "DOPT_ERR_STATE")
        with self.assertRaises(ValueError):
            opt.load_state(0, {"step": 1, "exp_avg": np.zeros(3, F)})  # exp_avg_sq missing
        for bad in (5, -1, 1.0, True):  # no such parameter: an error, not {}
            with self.assertRaises(distopt.Error) as cm:
                opt.state(bad)
            self.assertIn("out of range [0, 1)", str(cm.exception))
        good = opt.state(0)
        for bad in (2**70, 1e30, -3, 1.5):  # a step that ctypes would wrap or truncate
            with self.assertRaises(distopt.Error) as cm:
                opt.load_state(0, dict(good, step=bad))
            self.assertIn("step", str(cm.exception))
        self.assertEqual(opt.state(0)["step"], 1)


class TestMisuse(unittest.TestCase):
    """Misuse never crashes, hangs or loses an update (each case failed before: a deadlock or a lost update from
    threads, a segfault on close() during step(), heap corruption from a resized parameter, C ints wrapped, a
    name cut at a NUL, NaN read as "the default")."""

    def test_threads_serialised(self):
        """4 threads x 50 steps of a 200 000-element parameter (the library's pool of 2 threads splits it):
        without the handle's lock 2 of 3 runs hung; with it every step counts once, bitwise one thread's 200."""
        import threading
        w = np.zeros(200_000, np.float32)
        o = distopt.NumpyOptimizer("adamw", lr=1e-3, weight_decay=0.0)
        o.add_param(w)
        g = np.ones(200_000, np.float32)
        ts = [threading.Thread(target=lambda: [o.step([g]) for _ in range(50)]) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        self.assertFalse(any(t.is_alive() for t in ts), "a thread is still stepping after 60 s (a deadlock)")
        self.assertEqual(o.get_step(0), 200, "4 threads x 50 steps: every step counted once")
        # the same 200 steps on one thread give the same bits
        v = np.zeros(200_000, np.float32)
        one = distopt.NumpyOptimizer("adamw", lr=1e-3, weight_decay=0.0)
        one.add_param(v)
        for _ in range(200):
            one.step([g])
        self.assertTrue(np.array_equal(w.view(np.uint32), v.view(np.uint32)))

    def test_close_during_step(self):
        import threading
        big = np.zeros(2_000_000, np.float32)
        o = distopt.NumpyOptimizer("adamw")
        o.add_param(big)
        gb = np.ones_like(big)
        seen = []

        def stepper():
            try:
                for _ in range(50):
                    o.step([gb])
            except ValueError as e:  # closed: one line
                seen.append(str(e))

        t = threading.Thread(target=stepper)
        t.start()
        o.close()  # waits for a step under way, then destroys; the next step is refused
        t.join(60)
        self.assertFalse(t.is_alive())
        self.assertTrue(not seen or "the optimizer is closed" in seen[0], seen)

    def test_resized_parameter(self):
        a = np.zeros(10, np.float32)
        o = distopt.NumpyOptimizer("adamw")
        o.add_param(a)
        a.resize(100000, refcheck=False)  # the buffer the library holds is freed
        with self.assertRaises(distopt.Error) as cm:
            o.step([np.zeros(100000, np.float32)])
        self.assertIn("moved or was resized since add_param", str(cm.exception))

    def test_ranges_nul_nan(self):
        o = distopt.NumpyOptimizer("adamw")
        o.add_param(np.zeros(3, np.float32))
        cases = [(lambda: o.get_hparam("lr", group=2**40), "is not an index in [0, 2^31)"),
                 (lambda: o.set_hparam("lr", 0.1, group=-1), "is not an index in [0, 2^31)"),
                 (lambda: distopt.NumpyOptimizer("adamw\0x"), "holds a NUL character"),
                 (lambda: o.get_hparam("l\0r"), "holds a NUL character"),
                 (lambda: distopt.NumpyOptimizer("muon", lr=float("nan")), "lr=nan is NaN"),
                 (lambda: o.set_hparam("lr", float("nan")), "lr=nan is NaN"),
                 (lambda: o.set_hparam("weight_decay", float("nan")), "weight_decay=nan is NaN")]
        for fn, needle in cases:
            with self.assertRaises(distopt.Error) as cm:
                fn()
            self.assertIn(needle, str(cm.exception))
            self.assertNotIn("\n", str(cm.exception))
        o.set_hparam("lr", 0.5)
        self.assertEqual(o.get_hparam("lr"), 0.5)


if __name__ == "__main__":
    print(f"distopt {distopt.__version__} from {distopt.library_path}; numpy {np.__version__}; torch blocked")
    common.main()
