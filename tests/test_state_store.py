"""The saved-prefix store alone (no model): lookup, budgets, integrity, a failing disk."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from edgeprefill.backends.llamacpp.state_store import SUFFIX, StateStore

IDENTITY = {"model": "m:1", "llama_cpp": "0.3.36", "flash_attn": False}
MIB = 1 << 20


def payload(n_bytes: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n_bytes, dtype=np.uint8)


def store(folder: Path | None, ram: int = 64 * MIB, disk: int = 64 * MIB, **kw) -> StateStore:
    return StateStore(kw.get("identity", IDENTITY), ram_bytes=ram, disk_bytes=disk, folder=folder)


DOC = list(range(1000, 1400))  # a document's 400 tokens


def test_the_saved_state_sharing_the_longest_prefix_is_found():
    with store(None) as s:
        s.put(DOC[:100], payload(10, 1))
        s.put(DOC[:300], payload(30, 3))
        hit = s.lookup(DOC[:300] + [7, 8, 9])
        assert hit is not None and hit.n_tokens == 300 and hit.common == 300
        assert hit.source == "memory" and np.array_equal(hit.payload, payload(30, 3))
        whole = s.lookup(DOC[:300])  # the last prompt token is always computed: cut there
        assert whole is not None and whole.n_tokens == 300 and whole.common == 299
        assert s.lookup([5] + DOC) is None  # another start: nothing in common
        longer = s.lookup(DOC[:50] + [7])  # a longer state, to be cut back to what is shared
        assert longer is not None and longer.n_tokens == 100 and longer.common == 50
        pieces = s.lookup(DOC[:50] + [7], boundary=lambda n: n // 16 * 16)
        assert pieces is not None and pieces.common == 48
        assert s.lookup(DOC[:10] + [7], boundary=lambda n: n // 16 * 16) is None


def test_saved_states_outlive_the_process_on_disk(tmp_path):
    with store(tmp_path) as s:
        s.put(DOC, payload(2 * MIB))
    with store(tmp_path) as again:  # a later run: its memory is empty
        hit = again.lookup(DOC + [1])
        assert hit is not None and hit.source == "disk" and hit.n_tokens == len(DOC)
        assert np.array_equal(hit.payload, payload(2 * MIB))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priority is Linux's")
def test_the_disk_writer_runs_at_the_lowest_priority_and_the_engine_thread_does_not(tmp_path):
    """Its hash and copy of tens of MB must not take a core from llama.cpp's threads."""
    with store(tmp_path) as s:
        s.put(DOC, payload(MIB))
        s.flush()
        writer = s._writer
        assert writer is not None and writer.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == 19
        assert os.getpriority(os.PRIO_PROCESS, 0) < 19  # the process itself is untouched


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) - 100]))
    elif how == "corrupted":
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "garbage":
        path.write_bytes(b"not a state file at all")


@pytest.mark.parametrize("how", ["truncated", "corrupted", "garbage"])
def test_a_damaged_file_is_ignored_with_a_warning_never_loaded(tmp_path, how, caplog):
    with store(tmp_path) as s:
        s.put(DOC, payload(MIB))
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    damage(path, how)
    with caplog.at_level(logging.WARNING), store(tmp_path) as again:
        assert again.lookup(DOC + [1]) is None
        assert again.describe()["rejected_files"] == (0 if how == "garbage" else 1)
    if how != "garbage":  # a garbage file has no header: never indexed at all
        assert "computing the prompt instead" in caplog.text
        assert not path.exists()  # removed, so it is not read again


def test_a_state_for_another_model_or_build_is_never_loaded(tmp_path):
    with store(tmp_path, identity={**IDENTITY, "model": "other:2"}) as other:
        other.put(DOC, payload(MIB))
    with store(tmp_path) as ours:
        assert ours.lookup(DOC + [1]) is None
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1  # left for the model it belongs to


def test_eviction_keeps_the_disk_under_its_budget_least_recently_used_first(tmp_path):
    docs = [[d] * 50 + list(range(100)) for d in range(5)]
    with store(tmp_path, ram=MIB, disk=int(2.5 * MIB)) as s:
        for i, doc in enumerate(docs):
            s.put(doc, payload(MIB, i))
            s.flush()
            if i == 1:
                assert s.lookup(docs[0] + [1]) is not None  # doc 0 used: doc 1 is older
        stats = s.describe()
    sizes = [p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}")]
    assert sum(sizes) <= 2.5 * MIB + 4096 * len(sizes)  # payloads under budget (+ headers)
    assert stats["evicted_from_disk"] >= 2 and stats["ram_bytes"] <= MIB
    with store(tmp_path) as later:
        assert later.lookup(docs[4] + [1]) is not None  # the newest stayed
        assert later.lookup(docs[1] + [1]) is None  # the least recently used went first


def test_memory_over_budget_spills_to_disk(tmp_path):
    with store(tmp_path, ram=MIB, disk=16 * MIB) as s:
        s.put(DOC[:100], payload(MIB, 1))
        s.put(DOC[:200], payload(MIB, 2))
        s.flush()  # on disk now, and memory keeps at most 1 MiB: the older one left it
        assert s.lookup(DOC[:100] + [1]).source == "disk"


def test_an_unwritable_folder_or_a_full_disk_degrades_to_memory_only(tmp_path, caplog, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING), store(blocked / "kv") as s:
        s.put(DOC, payload(1000))
        assert s.lookup(DOC + [1]).source == "memory"  # still works, from memory
        assert s.describe()["folder"] is None and s.describe()["disk_errors"]
    assert "keeping saved states in memory only" in caplog.text

    def full(*args, **kw):
        raise OSError(28, "No space left on device")

    caplog.clear()
    with caplog.at_level(logging.WARNING), store(tmp_path / "kv") as s:
        monkeypatch.setattr(os, "fdopen", full)  # the store writes through os.open/fdopen
        s.put(DOC, payload(1000))
        s.flush()  # the writer met the full disk
        monkeypatch.undo()
        assert s.lookup(DOC + [1]).source == "memory"
        assert "No space left on device" in s.describe()["disk_errors"][0]
    assert "keeping saved states in memory only" in caplog.text


def test_clear_forgets_memory_and_files(tmp_path):
    with store(tmp_path) as s:
        s.put(DOC, payload(1000))
        s.flush()
        s.clear()
        assert s.lookup(DOC + [1]) is None
    assert not list(tmp_path.glob(f"*{SUFFIX}"))


def test_a_write_cut_short_by_kill_9_is_removed_at_the_next_start(tmp_path):
    with store(tmp_path) as s:
        s.put(DOC, payload(1000))
        s.flush()
    (saved,) = tmp_path.glob(f"*{SUFFIX}")
    dead = psutil.Popen(["true"])
    dead.wait()  # a pid that no process holds now
    half = tmp_path / f"{saved.stem}.tmp{dead.pid}"
    half.write_bytes(saved.read_bytes()[:100])  # what kill -9 mid-write leaves
    live = tmp_path / f"{saved.stem}.tmp{os.getpid()}"  # another process still writing
    live.write_bytes(b"...")
    with store(tmp_path) as s:
        assert not half.exists() and live.exists()
        assert s.lookup(DOC + [1]).n_tokens == len(DOC)  # the finished file still loads


SHARER = """
import json, sys, time
from pathlib import Path
import numpy as np
from edgeprefill.backends.llamacpp.state_store import StateStore

folder, me, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
docs = [list(range(k * 1000, k * 1000 + 40 + k)) for k in range(10)]  # both index these
size = 256 * 1024
store = StateStore({"model": "m:1"}, ram_bytes=0, disk_bytes=4 * size, folder=folder)
rng = np.random.default_rng(me)
hits = 0
for _ in range(steps):
    k = int(rng.integers(len(docs)))
    if rng.random() < 0.4:
        store.put(docs[k], np.full(size, k, dtype=np.uint8))
    else:
        got = store.lookup(docs[k] + [7])
        if got is not None:
            assert got.n_tokens == len(docs[k]) and (got.payload == k).all(), "mixed up"
            hits += got.source == "disk"
    time.sleep(0.002)  # an assistant between requests: its disk writer catches up
store.flush()
print(json.dumps({"hits": hits, "rejected": store.stats.rejected}))
store.close()
"""


def test_two_processes_sharing_a_folder_never_read_a_half_file_or_lose_one_mid_read(tmp_path):
    """Two assistants on one KV-state folder, each saving, evicting (a 4-state disk budget)
    and restoring the same documents: every restore is whole and right, none is refused,
    and each restores states the other wrote."""
    import json
    import subprocess
    import sys

    folder = tmp_path / "shared"
    script = tmp_path / "sharer.py"
    script.write_text(SHARER)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(folder), str(me), "400"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for me in (1, 2)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "KV cache:" not in err, err  # no file refused as damaged or unreadable
        results.append(json.loads(out))
    assert all(r["rejected"] == 0 and r["hits"] > 0 for r in results), results
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(SUFFIX)) == [".lock"]
