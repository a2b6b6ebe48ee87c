"""The `distopt` console command of an installed package: runs the command-line tool built into the wheel
(distopt/bin/distopt) with the same arguments, exit status and streams."""
import os
import signal
import sys


def packaged_cli():
    """The CLI installed inside this package, or None (a source tree run through PYTHONPATH has none)."""
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "distopt")
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def main():
    exe = packaged_cli()
    if exe is None:
        sys.exit("distopt: this installation has no command-line tool (distopt/bin/distopt); reinstall with "
                 "pip install ./python, or build it: cmake --build build (build/cli/distopt)")
    # Python ignores SIGPIPE and an exec keeps that: restore the default, so that `distopt list | head -1` ends
    # the tool as it ends any command (a closed pipe is otherwise an I/O failure, exit 2: docs/cli.md)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.execv(exe, [exe] + sys.argv[1:])
