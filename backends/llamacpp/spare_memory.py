"""Memory whose pages are mapped before the engine thread needs them.

The first write to fresh memory faults in every page. On the 2-core AMD EPYC these numbers
come from (a virtual machine), copying a document's 26 MB KV state into a new buffer took
257 ms and into one already written 5 ms (benchmarks/history.md, section J): the save of each
document stalled the engine loop for 140-300 ms, and a chat arriving meanwhile waited for it.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np

from edgeprefill.runtime.core.threads import lowest_thread_priority

PAGE = mmap.PAGESIZE
# A spare is made this much larger than the largest request so far: documents differ.
HEADROOM = 1.25


class SpareMemory:
    """Hands out byte buffers; after each, a low-priority thread maps the pages of the next
    (as large as the largest asked for, with headroom), so a request that fits the spare
    costs no page faults. The part of a spare beyond a request is given back to the OS at
    once, so a buffer holds the memory it reports (`nbytes`), not the spare's size."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spare: tuple[mmap.mmap, np.ndarray] | None = None
        self._want = 0  # the size of the next spare (0: none asked for yet)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="edgeprefill-spare", daemon=True)
        self._thread.start()

    def take(self, nbytes: int) -> np.ndarray:
        with self._cond:
            spare = self._spare if self._spare and self._spare[1].size >= nbytes else None
            if spare is not None:
                self._spare = None
            self._want = max(self._want, -(-int(nbytes * HEADROOM) // PAGE) * PAGE)
            self._cond.notify()
        if spare is None:
            return np.empty(nbytes, dtype=np.uint8)
        mem, arr = spare
        used = -(-nbytes // PAGE) * PAGE
        if used < arr.size and hasattr(mem, "madvise"):  # (Windows' mmap has none)
            mem.madvise(mmap.MADV_DONTNEED, used, arr.size - used)
        return arr[:nbytes]

    def _run(self) -> None:
        lowest_thread_priority()
        while True:
            with self._cond:
                while not self._closed and not self._needed():
                    self._cond.wait()
                if self._closed:
                    return
                size = self._want
            mem = mmap.mmap(-1, size)
            arr = np.frombuffer(mem, dtype=np.uint8)
            arr[::PAGE] = 0  # one write a page maps every page
            with self._cond:
                self._spare = (mem, arr)

    def _needed(self) -> bool:
        return self._want > 0 and (self._spare is None or self._spare[1].size < self._want)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._spare = None
            self._cond.notify()
        self._thread.join()
