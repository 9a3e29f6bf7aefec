"""Start a Python program the way a shell in a terminal does, for tests that press Ctrl-C."""

from __future__ import annotations

import sys

# A suite started in the background of a non-interactive shell (`make test &`, some CI
# runners) inherits SIGINT ignored, POSIX shells do that to background jobs, and a Python
# started so leaves it ignored: Ctrl-C would mean nothing to the program under test. The
# launcher restores its default action and then becomes the program (exec keeps it).
_LAUNCH = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def python_from_a_terminal(*args: str) -> list[str]:
    """The command line that runs `python *args` with Ctrl-C delivered as in a terminal."""
    return [sys.executable, "-c", _LAUNCH, *args]
