"""Saved KV states of prompt prefixes: in memory up to one budget, then on disk up to
another, least recently used evicted first, each checked before it is used again.

Why: a desktop assistant's indexer computes a document's KV cache once; a question about
that document later should start from it instead of computing the document again (on a
2-core CPU a 4,000-token document is 5-20 s of prefill). A state is only valid for the
exact tokens it was computed from, with the same model file, llama.cpp build and KV layout:
that is the `identity` every file's header carries, with the token count, the tokens' hash
and the payload's checksum. A file that is truncated, corrupted or made for another
identity is ignored with a warning and the prompt is computed again; a cache folder that
cannot be written, or a full disk, leaves the store working from memory only.

File layout: MAGIC, a 4-byte little-endian header length, the JSON header, the tokens
(int32, little-endian), the payload.

The states hold what documents said: the folder is the user's alone (0700, refused if
another user owns it) and its files too (0600, never opened through a symbolic link).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from filelock import FileLock

from edgeprefill.runtime.core.parked import common_prefix
from edgeprefill.runtime.core.private import private_folder
from edgeprefill.runtime.core.resource import Closeable
from edgeprefill.runtime.core.threads import lowest_thread_priority

log = logging.getLogger(__name__)

MAGIC = b"EPKV"
FORMAT = 1
SUFFIX = ".kvstate"
# Two processes (two assistants) may share one folder. Files appear whole (written aside,
# then renamed), and a file is read, renamed into place or deleted only under this lock,
# so one process never evicts a file while the other reads it.
LOCK_NAME = ".lock"


def _glibc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None


_TRIM = _glibc_trim()


def _return_freed_memory() -> None:
    """Hand the pages of freed payloads back to the OS. glibc keeps freed multi-MB blocks
    in its arenas (its mmap threshold grows after such frees), so a long-running assistant's
    RSS crept up ~4 MiB a minute in the soak; trimming after each write kept it flat
    (benchmarks/history.md, section A). Runs on the writer thread, never the engine's."""
    if _TRIM is not None:
        _TRIM(0)


# llama-server keeps up to 8 GiB of prompts in host memory by default (--cache-ram).
MAX_DEFAULT_RAM = 8 << 30


def default_kv_ram() -> int:
    """Memory for saved states when none is given: a quarter of what is available now (a
    laptop's assistant shares it with everything else the person runs), at most 8 GiB."""
    return min(MAX_DEFAULT_RAM, psutil.virtual_memory().available // 4)


def token_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


@dataclass
class _Entry:
    n_tokens: int
    nbytes: int
    ram: np.ndarray | None = None  # the payload, while held in memory
    on_disk: bool = False
    writing: bool = False  # queued for the disk writer


@dataclass(frozen=True)
class Loaded:
    """A stored prefix ready to restore: its length and the backend's state bytes."""

    n_tokens: int
    payload: np.ndarray
    source: str  # "memory" or "disk"
    common: int  # of its first tokens, those the prompt begins with (at most n_tokens)


@dataclass
class StoreStats:
    saved: int = 0
    restored: int = 0
    rejected: int = 0  # files ignored: damaged, truncated or for another identity
    evicted_ram: int = 0
    evicted_disk: int = 0
    disk_errors: list[str] = field(default_factory=list)


class StateStore(Closeable):
    """Prefix states for one identity (model file, llama.cpp build, KV layout)."""

    def __init__(
        self,
        identity: dict[str, Any],
        *,
        ram_bytes: int,
        disk_bytes: int,
        folder: Path | None,
    ) -> None:
        self.identity = identity
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._tokens: dict[str, np.ndarray] = {}  # of entries saved by this process
        self._ram_used = 0
        self._folder: Path | None = None
        self._folder_lock: FileLock | None = None
        self._folder_seen = 0  # the folder's mtime when its files were last indexed
        self._writes: queue.Queue[str | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if folder is not None and disk_bytes > 0:
            try:
                private_folder(folder)
                probe = folder / f".write-test-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as e:
                self._disk_failed(f"cannot write the KV cache folder {folder}: {e.strerror}")
            else:
                self._folder = folder
                self._folder_lock = FileLock(folder / LOCK_NAME, mode=0o600)
                self._index_folder()
                self._writer = threading.Thread(
                    target=self._write_loop, name="edgeprefill-kv-writer", daemon=True
                )
                self._writer.start()

    # --- describing -----------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        with self._lock:
            disk = [e for e in self._entries.values() if e.on_disk]
            return {
                "folder": None if self._folder is None else str(self._folder),
                "ram_budget_bytes": self.ram_bytes,
                "disk_budget_bytes": self.disk_bytes if self._folder is not None else 0,
                "entries": len(self._entries),
                "ram_bytes": self._ram_used,
                "disk_bytes": sum(e.nbytes for e in disk),
                "saved": self.stats.saved,
                "restored": self.stats.restored,
                "rejected_files": self.stats.rejected,
                "evicted_from_ram": self.stats.evicted_ram,
                "evicted_from_disk": self.stats.evicted_disk,
                "disk_errors": list(self.stats.disk_errors),
            }

    # --- saving ---------------------------------------------------------------------
    def put(self, tokens: Sequence[int], payload: np.ndarray) -> None:
        """Keep `payload` (the state of exactly `tokens`) in memory; written to disk by a
        background thread, so the caller's thread only pays for the copy it made."""
        key = token_hash(tokens)
        entry = _Entry(len(tokens), payload.nbytes, ram=payload)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None and old.ram is not None:
                self._ram_used -= old.nbytes
            entry.on_disk = old is not None and old.on_disk and old.nbytes == entry.nbytes
            self._entries[key] = entry
            self._ram_used += entry.nbytes
            self.stats.saved += 1
            if self._folder is not None and not entry.on_disk:
                entry.writing = True
                self._writes.put(key)
            self._tokens[key] = np.asarray(tokens, dtype="<i4")
            self._evict_ram()

    # --- restoring ------------------------------------------------------------------
    def lookup(
        self,
        prompt: Sequence[int],
        boundary: Callable[[int], int] = int,
        cuttable: Callable[[int, int], bool] = lambda n_tokens, common: True,
    ) -> Loaded | None:
        """The stored state sharing the longest prefix with `prompt`, checked and ready:
        one whose tokens all begin the prompt (found by their hash, whichever process saved
        it), or, of those this process saved, the one sharing the most first tokens (a
        conversation's earlier turn). `Loaded.common` says how many tokens to keep: the
        shared ones cut down by `boundary` (a piece boundary), never the whole prompt (its
        last token is always computed, for its logits); none at all gives None. A state of
        n tokens is cut back to fewer only where `cuttable(n, common)`."""
        arr = np.asarray(prompt, dtype="<i4")
        self._index_new_files()
        with self._lock:
            lengths = sorted({e.n_tokens for e in self._entries.values()}, reverse=True)
            known = list(self._tokens.items())
        usable = []
        for key, tokens in known:
            common = boundary(min(common_prefix(tokens, arr), len(arr) - 1))
            if common >= len(tokens) or cuttable(len(tokens), common):
                usable.append((common, key))
        common, best = max(usable, default=(0, ""))
        for n in lengths:
            if n >= len(arr) or boundary(n) <= common or not cuttable(n, boundary(n)):
                continue
            key = hashlib.sha256(arr[:n].tobytes()).hexdigest()
            loaded = self._load(key, arr[:n], boundary(n))
            if loaded is not None:
                return loaded
        kept = self._tokens.get(best)
        return None if not common or kept is None else self._load(best, kept, common)

    def _load(self, key: str, tokens: np.ndarray, common: int) -> Loaded | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            if entry.ram is not None:
                self.stats.restored += 1
                return Loaded(entry.n_tokens, entry.ram, "memory", common)
        payload = self._read(key, tokens)
        with self._lock:
            if payload is None:
                if self._entries.get(key) is entry:
                    del self._entries[key]
                    self._tokens.pop(key, None)
                return None
            self.stats.restored += 1
            if self._entries.get(key) is entry and entry.ram is None:
                entry.ram = payload
                self._ram_used += entry.nbytes
                self._evict_ram(keep=key)
        return Loaded(entry.n_tokens, payload, "disk", common)

    # --- memory budget --------------------------------------------------------------
    def _evict_ram(self, keep: str | None = None) -> None:
        """Drop payloads from memory, least recently used first, until under budget; one
        not yet on disk (or being written) is forgotten only if no disk holds it."""
        for key in list(self._entries):
            if self._ram_used <= self.ram_bytes:
                return
            entry = self._entries[key]
            if key == keep or entry.ram is None or entry.writing:
                continue
            self._ram_used -= entry.nbytes
            entry.ram = None
            self.stats.evicted_ram += 1
            if not entry.on_disk:
                del self._entries[key]
                self._tokens.pop(key, None)

    # --- disk -----------------------------------------------------------------------
    def _path(self, key: str) -> Path:
        assert self._folder is not None
        return self._folder / f"{key[:32]}{SUFFIX}"

    def _header(self, entry: _Entry, tokens: np.ndarray, payload: np.ndarray) -> bytes:
        header = {
            "format": FORMAT,
            "identity": self.identity,
            "n_tokens": entry.n_tokens,
            "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
            "payload_bytes": payload.nbytes,
            "payload_sha256": hashlib.sha256(payload.data).hexdigest(),
            "written_at": time.time(),
        }
        raw = json.dumps(header, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(raw)) + raw

    def _write_loop(self) -> None:
        # Its hash and copy of tens of MB otherwise took a core from llama.cpp's threads:
        # iterations in the half second after a save ran at up to 2.7x their predicted time
        # (benchmarks/history.md, section J). The disk copy backs up one in memory: it can wait.
        lowest_thread_priority()
        while True:
            key = self._writes.get()
            try:
                if key is None:
                    return
                self._write_one(key)
            except Exception:  # the thread must live on: `flush` waits for the queue
                log.exception("KV cache: saving a state failed")
            finally:
                self._writes.task_done()

    def _write_one(self, key: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            tokens = self._tokens.get(key)
            payload = None if entry is None else entry.ram
        if entry is None or tokens is None or payload is None:
            if entry is not None:
                entry.writing = False
            return
        ok = self._write(key, entry, tokens, payload)
        with self._lock:
            entry.writing = False
            entry.on_disk = ok
            if ok:
                self._evict_disk()
            self._evict_ram()
        del payload
        _return_freed_memory()

    def _write(self, key: str, entry: _Entry, tokens: np.ndarray, payload: np.ndarray) -> bool:
        if self._folder is None or entry.nbytes > self.disk_bytes:
            return False
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open(tmp, flags, 0o600), "wb") as f:
                f.write(self._header(entry, tokens, payload))
                f.write(tokens.tobytes())
                f.write(payload.data)
            with self._shared():
                os.replace(tmp, path)
            return True
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self._disk_failed(f"cannot write {path}: {e.strerror}")
            return False

    def _disk_failed(self, why: str) -> None:
        """No more disk: keep working from memory (a warning, never a failed request)."""
        log.warning("KV cache: %s; keeping saved states in memory only", why)
        with self._lock:
            self.stats.disk_errors.append(why)
            self._folder = None

    def _evict_disk(self) -> None:
        """Delete files, least recently used first, until the folder is under budget."""
        on_disk = [(k, e) for k, e in self._entries.items() if e.on_disk]
        used = sum(e.nbytes for _, e in on_disk)
        for key, entry in on_disk:
            if used <= self.disk_bytes:
                return
            if self._folder is not None:
                with self._shared():
                    self._path(key).unlink(missing_ok=True)
            entry.on_disk = False
            used -= entry.nbytes
            self.stats.evicted_disk += 1
            if entry.ram is None:
                del self._entries[key]
                self._tokens.pop(key, None)

    def _index_folder(self) -> None:
        """Learn the files a previous run left, oldest use first, reading headers only."""
        assert self._folder is not None
        for tmp in self._folder.glob("*.tmp*"):  # a write cut short (kill -9, power loss)
            pid = tmp.suffix.removeprefix(".tmp")
            if pid.isdigit() and not psutil.pid_exists(int(pid)):
                tmp.unlink(missing_ok=True)  # its writer is gone; a live one's is left alone
        self._index_new_files()

    def _index_new_files(self) -> None:
        """Add the files of this identity that are not known yet (another process sharing
        the folder wrote them), when the folder changed since it was last read."""
        folder = self._folder
        if folder is None:
            return
        try:
            changed = folder.stat().st_mtime_ns
        except OSError:
            return
        if changed == self._folder_seen:
            return
        self._folder_seen = changed
        with self._lock:
            known = {key[:32] for key in self._entries}
        found = []
        for path in folder.glob(f"*{SUFFIX}"):
            if path.stem in known:
                continue
            try:
                found.append((path.stat().st_mtime, path))
            except OSError:
                continue  # evicted by another process meanwhile
        for _, path in sorted(found):
            header = _read_header(path)
            if header is None or header.get("format") != FORMAT:
                continue
            if header.get("identity") != self.identity:
                continue  # another model or build: left alone, never loaded
            key = header["tokens_sha256"]
            if path.name != f"{key[:32]}{SUFFIX}":
                continue
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = _Entry(
                        header["n_tokens"], header["payload_bytes"], on_disk=True
                    )
                    self._entries.move_to_end(key, last=False)  # no use of it seen here yet

    def _shared(self) -> Any:
        """The folder's lock (another process may read, rename or delete its files)."""
        assert self._folder_lock is not None
        return self._folder_lock

    def _read(self, key: str, tokens: np.ndarray) -> np.ndarray | None:
        """The payload of a file, if every check passes; else None, with a warning."""
        folder = self._folder  # once: the writer thread may give the disk up meanwhile
        if folder is None:
            return None
        path = folder / f"{key[:32]}{SUFFIX}"
        with self._shared():
            try:
                with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                    data = f.read()
                os.utime(path)  # recently used: evicted last
            except FileNotFoundError:
                return None  # evicted by another process sharing the folder
            except OSError as e:
                self._reject(path, f"cannot be read ({e.strerror})", delete=False)
                return None
        header = _parse_header(data)
        if header is not None and (
            header.get("format") != FORMAT or header.get("identity") != self.identity
        ):
            self._reject(path, "was written for another model, build or KV layout", False)
            return None
        payload = _payload(data, header, tokens)
        if isinstance(payload, str):
            self._reject(path, payload)
            return None
        return payload

    def _reject(self, path: Path, why: str, delete: bool = True) -> None:
        log.warning("KV cache: %s %s; computing the prompt instead", path, why)
        self.stats.rejected += 1
        if delete:
            with self._shared():
                path.unlink(missing_ok=True)

    def clear(self) -> None:
        """Forget every saved state, in memory and this identity's files on disk (a replay
        that must start from nothing)."""
        with self._lock:
            keys = list(self._entries)
            for key in keys:
                entry = self._entries.pop(key)
                if entry.on_disk and self._folder is not None:
                    with self._shared():
                        self._path(key).unlink(missing_ok=True)
            self._tokens.clear()
            self._ram_used = 0
            self.stats = StoreStats(disk_errors=self.stats.disk_errors)

    def flush(self) -> None:
        """Wait until every state saved so far is on disk (or failed to get there)."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        """Finish the writes already queued, then stop the writer."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None


def _read_header(path: Path) -> dict[str, Any] | None:
    try:
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + 4)
            if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
                return None
            (n,) = struct.unpack("<I", head[len(MAGIC) :])
            return _parse_header(head + f.read(n))
    except OSError:
        return None


def _parse_header(data: bytes) -> dict[str, Any] | None:
    if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
        return None
    (n,) = struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])
    try:
        header = json.loads(data[len(MAGIC) + 4 : len(MAGIC) + 4 + n])
    except (ValueError, RecursionError):  # RecursionError: a header nested thousands deep
        return None
    return header if isinstance(header, dict) else None


def _payload(data: bytes, header: dict[str, Any] | None, tokens: np.ndarray) -> np.ndarray | str:
    """The KV state a file of this identity holds for `tokens`, or why it is not to be
    trusted."""
    if header is None:
        return "has no valid header"
    start = len(MAGIC) + 4 + struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])[0]
    n = header.get("n_tokens")
    body = start + 4 * n if isinstance(n, int) else -1
    if n != len(tokens) or len(data) < body:
        return "is truncated or holds another prefix"
    if not np.array_equal(np.frombuffer(data, dtype="<i4", count=n, offset=start), tokens):
        return "holds other tokens than its name says"
    payload = np.frombuffer(data, dtype=np.uint8, offset=body)
    if payload.nbytes != header.get("payload_bytes"):
        return "is truncated"
    if hashlib.sha256(payload.data).hexdigest() != header.get("payload_sha256"):
        return "is corrupted (checksum mismatch)"
    return payload
