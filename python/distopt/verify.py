"""distopt.verify: run the `distopt verify` command-line tool on a recording (distopt.record) and return what it
found (docs/verify.md).

    res = distopt.verify("run.rec")          # the CLI: cli=, else $DISTOPT_CLI, else the package's, else PATH
    res.ok, res.returncode                     # True / 0: within tolerance; 1: diverged; 2: bad input
    res.report["verdict"]                      # the CLI's --json record ("schema_version": 1), None on exit 2
    print(res.stdout)                          # the table

The CLI does the replay (the C reference, no ctypes): this module needs neither the library nor torch.
"""
import json
import os
import shutil
import subprocess
import tempfile

from ._cli import packaged_cli

__all__ = ["verify", "run_verify", "VerifyResult", "find_cli"]

JSON_SCHEMA_VERSION = 8  # the verify record's schema_version this module reads (2: mode, reference, window; 3: events; 4: stage, expert; 5: gradients_compared a count; 6: continues; 7: tolerance.update; 8: gradient_side)


class VerifyResult:
    """returncode (0 within tolerance, 1 diverged, 2 bad input), ok, diverged, report (the parsed --json record,
    or None), stdout (the table), stderr (the one-line error on exit 2), command."""

    def __init__(self, returncode, report, stdout, stderr, command):
        self.returncode, self.report, self.stdout, self.stderr, self.command = \
            returncode, report, stdout, stderr, command

    @property
    def ok(self):
        return self.returncode == 0

    @property
    def diverged(self):
        return self.returncode == 1

    @property
    def verdict(self):
        return self.report.get("verdict") if self.report else None

    def __bool__(self):
        return self.ok

    def __repr__(self):
        v = self.verdict or {}
        return (f"VerifyResult(returncode={self.returncode}, verdict={v.get('kind')!r}, step={v.get('step')!r}, "
                f"tensor={v.get('tensor')!r}, rank={v.get('rank')!r})")


def find_cli(cli=None):
    """The `distopt` executable: cli, else $DISTOPT_CLI, else the one installed in this package (pip install
    ./python), else `distopt` on PATH."""
    for cand, where in ((cli, "cli="), (os.environ.get("DISTOPT_CLI"), "DISTOPT_CLI")):
        if cand:
            if not (os.path.isfile(cand) and os.access(cand, os.X_OK)):
                raise FileNotFoundError(f"distopt.verify: {where} {cand!r} is not an executable file")
            return cand
    found = packaged_cli() or shutil.which("distopt")
    if not found:
        raise FileNotFoundError("distopt.verify: the `distopt` command-line tool was not found: pass cli=, set "
                                "DISTOPT_CLI, install the package (pip install ./python ships it), or put it on "
                                "PATH (cmake --build build: build/cli/distopt)")
    return found


def run_verify(path, extra=(), cli=None, rtol=None, json_path=None, plot=None, timeout=None):
    """`distopt verify path EXTRA... --json J [--rtol X] [--plot FILE.svg]` -> VerifyResult (distopt.verify,
    distopt.replay)."""
    exe = find_cli(cli)
    with tempfile.TemporaryDirectory(prefix="distopt-verify-") as tmp:
        jp = os.fspath(json_path) if json_path else os.path.join(tmp, "verify.json")
        cmd = [exe, "verify", os.fspath(path), *extra, "--json", jp]
        if rtol is not None:
            cmd += ["--rtol", repr(float(rtol))]
        if plot:
            cmd += ["--plot", os.fspath(plot)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        report = None
        if p.returncode in (0, 1) and os.path.isfile(jp):
            with open(jp) as f:
                report = json.load(f)
            if report.get("schema_version") != JSON_SCHEMA_VERSION:
                raise RuntimeError(f"distopt.verify: {exe} wrote schema_version {report.get('schema_version')!r}; "
                                   f"this module reads {JSON_SCHEMA_VERSION}")
        return VerifyResult(p.returncode, report, p.stdout, p.stderr, cmd)


def verify(path, cli=None, rtol=None, json_path=None, plot=None, timeout=None):
    """Runs `distopt verify path [--rtol X] --json ... [--plot FILE.svg]`; returns a VerifyResult (never raises
    for a divergence or bad input: look at returncode / ok; raises FileNotFoundError without the CLI)."""
    return run_verify(path, (), cli, rtol, json_path, plot, timeout)
