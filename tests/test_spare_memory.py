"""A save's copy goes into pages mapped beforehand, off the engine thread."""

from __future__ import annotations

import resource
import sys
import time

import numpy as np
import pytest

from edgeprefill.backends.llamacpp.spare_memory import PAGE, SpareMemory

MIB = 1 << 20
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread fault counts are Linux's"
)


def faults_writing(buf: np.ndarray) -> int:
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buf[::PAGE] = 7
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def wait_for_spare(mem: SpareMemory, nbytes: int) -> None:
    for _ in range(200):  # bounded: 10 s
        if mem._spare is not None and mem._spare[1].size >= nbytes:
            return
        time.sleep(0.05)
    raise AssertionError("no spare was made within 10 s")


def test_after_the_first_buffer_the_next_ones_cost_the_engine_thread_no_page_faults():
    mem = SpareMemory()
    try:
        first = mem.take(8 * MIB)  # nothing asked for before: fresh memory
        assert first.nbytes == 8 * MIB and first.flags.writeable
        wait_for_spare(mem, 10 * MIB)
        for size in (6 * MIB, 9 * MIB + 123):  # smaller, and larger within the headroom
            buf = mem.take(size)
            assert buf.nbytes == size and buf.flags.writeable
            # 1,500-2,300 pages: a fresh buffer faults on every one of them.
            assert faults_writing(buf) < 16, size
            wait_for_spare(mem, 10 * MIB)
        first[:] = 1  # buffers handed out stay independent of later spares
        assert int(first.sum()) == 8 * MIB
    finally:
        mem.close()


def test_a_request_larger_than_the_spare_still_gets_its_buffer_and_grows_the_next():
    mem = SpareMemory()
    try:
        mem.take(MIB)
        wait_for_spare(mem, MIB)
        big = mem.take(20 * MIB)
        assert big.nbytes == 20 * MIB
        wait_for_spare(mem, 25 * MIB)
        assert faults_writing(mem.take(20 * MIB)) < 16
    finally:
        mem.close()
