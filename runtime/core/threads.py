"""The lowest thread priority, for helper work that must not take a core from the device's
compute threads (saving KV states, tokenizing a long document): on few cores llama.cpp's
threads use every one, and a helper running beside them stalls a whole graph at its next
barrier."""

from __future__ import annotations

import contextlib
import os
import sys
import threading


def lowest_thread_priority() -> None:
    """Run the calling thread at the lowest priority. Linux applies a thread id's priority
    to that thread alone; elsewhere this is not tried."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
