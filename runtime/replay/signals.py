"""Ctrl-C and SIGTERM as the runner and the embedding API take them."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def on_stop_signals(handler: Callable[[int], None]) -> Iterator[None]:
    """While the block runs, `handler(signum)` takes SIGINT and SIGTERM; the program's own
    handlers come back after it. Only on the main thread: elsewhere Python delivers no
    signals (and cannot install handlers), so nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda signum, frame: handler(signum)) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
