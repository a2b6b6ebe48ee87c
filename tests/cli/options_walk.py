"""Walks docs/cli.md's table "Every option used or refused": for each row, runs the command with the row's
arguments added to the baseline and checks the declared effect; runs the row's YAML form (compare --config)
and requires the command line's final digest; fails on an option `--help` lists that the table lacks.

    options_walk.py DISTOPT SOURCE_DIR WORK_DIR

Effects (docs/cli.md): result, same, file X, tty, stdout, rerun, resume, mode: ... (not walked here)."""
import hashlib
import os
import pty
import re
import shutil
import subprocess
import tempfile
import sys

EXE, SRC, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
BASE = {"compare": ["compare", "--optimizer", "adamw", "--steps", "3"],
        "run": ["run", "--params", "datasets/golden/inputs.safetensors", "--optimizer", "adamw", "--steps", "3",
                "--out", "W/o.st"]}
BASE_YAML = {"optimizer": "{type: adamw}", "steps": "3"}
fails = []


def table():
    text = open(os.path.join(SRC, "docs", "cli.md"), encoding="utf-8").read()
    body = text.split("<!-- options-walk: begin -->")[1].split("<!-- options-walk: end -->")[0]
    rows = []
    for line in body.strip().splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        cmd, opt, base, tried, yaml, effect = cells
        rows.append({"cmd": cmd, "opt": re.sub(r"`", "", opt).split()[0], "base": base.strip("`"),
                     "tried": tried.strip("`"), "yaml": re.findall(r"`([^`]+)`", yaml), "effect": effect})
    return rows


def w(arg):
    return arg.replace("W/", WORK + "/")


def argv(*parts):
    out = []
    for p in parts:
        out += [w(a) for a in (p.split() if isinstance(p, str) else p)]
    return out


def fresh():
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)


def run(args, tty=False):
    """(exit code, stdout, stderr) of distopt ARGS in SOURCE_DIR; tty: stderr is a terminal (the progress line's,
    shown from the first step: DOPT_PROGRESS_AFTER=0)."""
    if not tty:
        p = subprocess.run([EXE] + args, cwd=SRC, capture_output=True, text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    env = dict(os.environ, DOPT_PROGRESS_AFTER="0")
    sink = tempfile.TemporaryFile()  # standard output (a pipe nobody reads while the terminal is read could fill)
    p = subprocess.Popen([EXE] + args, cwd=SRC, stdout=sink, stderr=slave, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    p.wait(timeout=300)
    os.close(master)
    sink.seek(0)
    text = sink.read().decode(errors="replace")
    sink.close()
    return p.returncode, text, out.decode(errors="replace")


def digest(cmd, rc, out, err, what, args=None):
    """The final digest of a run: compare's digest line, run's output file (its last --out) hashed."""
    if rc != 0:
        fails.append(f"{what}: exit {rc}: {err.strip()[:300]}")
        return None
    if cmd == "run":
        outs = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--out"]
        with open(outs[-1], "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    m = re.search(r"^digest sha256:([0-9a-f]{64}) \(reference: equal\)$", out, re.M)
    if not m or "verdict: EQUIVALENT" not in out:
        fails.append(f"{what}: no equivalent verdict and digest: {out[-300:]}")
        return None
    return m.group(1)


def yaml_text(fragments):
    top = dict(BASE_YAML)
    for f in fragments:
        k, v = f.split(":", 1)
        top[k.strip()] = v.strip()
    # paths in a YAML file are its folder's (docs/cli.md): the datasets' given from the source tree
    return "".join(f"{k}: {w(v).replace('path: datasets/', 'path: ' + SRC + '/datasets/')}\n" for k, v in top.items())


def walk(row):
    cmd, eff, what = row["cmd"], row["effect"], f"{row['cmd']} {row['opt']}"
    if eff.startswith("mode"):
        return "mode"
    fresh()
    base = argv(BASE[cmd], row["base"])
    if eff == "resume":  # a run to step 2 saved into W/rs; resumed, the bytes of the uninterrupted run
        rc, _, err = run(argv(BASE[cmd], "--steps 2 --save W/rs --out W/half.st"))
        ref = digest(cmd, *run(base), what + " (uninterrupted)", base)
        tried = argv(base, row["tried"])
        got = digest(cmd, *run(tried), what, tried)
        if ref is None or got != ref:
            fails.append(f"{what}: resumed bytes differ from the uninterrupted run's")
        return eff
    if eff == "rerun":
        with_it = argv(base, row["tried"])
        r1, r2 = run(with_it), run(with_it)
        r3 = run(base)  # the same folder again, without the option: refused
        if r1[0] or r2[0] or r3[0] != 2:
            fails.append(f"{what}: rerun exits {r1[0]}, {r2[0]}, without it {r3[0]} (want 0, 0, 2): {r3[2].strip()}")
        return eff
    if eff == "tty":
        r_without, r_with = run(base, tty=True), run(argv(base, row["tried"]), tty=True)
        if "step 1/" not in r_without[2] or "step 1/" in r_with[2]:
            fails.append(f"{what}: on a terminal the progress line is {'kept' if 'step 1/' in r_with[2] else 'absent without it'}")
        return eff
    if eff == "stdout":
        r_without, r_with = run(base), run(argv(base, row["tried"]))
        if not r_without[1].strip() or r_with[1].strip() or r_with[0]:
            fails.append(f"{what}: stdout {len(r_without[1])} bytes without, {len(r_with[1])} with (exit {r_with[0]})")
        return eff
    ref = digest(cmd, *run(base), what + " (baseline)", base)
    fresh()
    tried = argv(base, row["tried"])
    got = digest(cmd, *run(tried), what, tried)
    if eff.startswith("file "):
        path = os.path.join(WORK, eff.split(" ", 1)[1])
        if not os.path.exists(path):
            fails.append(f"{what}: {path} not written")
    elif eff == "result" and (got is None or got == ref):
        fails.append(f"{what}: declared to change the result, the digest is the baseline's")
    elif eff == "same" and got != ref:
        fails.append(f"{what}: declared no effect on results, the digest differs ({got} vs {ref})")
    elif eff not in ("result", "same") and not eff.startswith("file "):
        fails.append(f"{what}: unknown effect '{eff}'")
    if row["yaml"] and got is not None:
        fresh()
        cfg = os.path.join(WORK + "_cfg.yaml")
        with open(cfg, "w") as f:
            f.write(yaml_text(row["yaml"]))
        yd = digest(cmd, *run(["compare", "--config", cfg]), what + " as YAML " + " ".join(row["yaml"]))
        if yd is not None and yd != got:
            fails.append(f"{what}: the YAML form gives digest {yd}, the command line {got}")
    return eff


def help_options(cmd):
    rc, out, err = run([cmd, "--help"])
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", out + err))


rows = table()
done = {}
for row in rows:
    done.setdefault(walk(row), []).append(row["opt"])
for cmd in ("compare", "run"):
    listed = {r["opt"] for r in rows if r["cmd"] == cmd}
    missing = sorted(help_options(cmd) - listed - {"--help"})
    if missing:
        fails.append(f"{cmd} --help lists options the table lacks: {', '.join(missing)}")
for line in fails:
    print("FAIL:", line)
print(f"{len(rows)} rows: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(done.items())))
sys.exit(1 if fails else 0)
