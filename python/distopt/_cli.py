"""The `distopt` console command of an installed package: runs the command-line tool built into the wheel
(distopt/bin/distopt) with the same arguments, exit status and streams."""
import os
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
    os.execv(exe, [exe] + sys.argv[1:])
