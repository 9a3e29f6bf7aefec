"""The device probe's results, kept in the user's cache folder per CPU, llama.cpp build,
model and thread count, so the probe runs once per machine setup and not once per run.

A file that cannot be read, or that was written for another key or format, is measured
again (with a warning), never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import llama_cpp as lc

from edgeprefill.backends.cache import cache_dir
from edgeprefill.backends.llamacpp.native import LlamaModel, release_openmp_threads
from edgeprefill.backends.llamacpp.probe import measure
from edgeprefill.backends.llamacpp.shapes import AttentionFacts

log = logging.getLogger(__name__)

FORMAT = 2  # bump when what the probe measures changes: older files are measured again


def _cpu() -> tuple[str, str]:
    """(model name, instruction-set flags) of this CPU."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Hardware") and name in ("", platform.machine()):
                name = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return name, flags


def model_identity(model: LlamaModel, path: Path) -> str:
    """The weights: their description, bytes and parameters, and a hash of the file's last
    MiB (tensor data), without reading the whole file. Not the metadata at the file's
    start: a chat template set on a copy of the weights changes no measured shape and no
    saved state's meaning."""
    size = path.stat().st_size
    with path.open("rb") as f:
        f.seek(max(0, size - (1 << 20)))
        tail = hashlib.sha256(f.read()).hexdigest()[:16]
    weights = lc.llama_model_size(model.ptr), lc.llama_model_n_params(model.ptr)
    return f"{model.description()}:{weights[0]}:{weights[1]}:{tail}"


def probe_key(model: LlamaModel, path: Path, n_threads: int, kv_unified: bool) -> dict[str, Any]:
    cpu, flags = _cpu()
    return {
        "format": FORMAT,
        "cpu": cpu,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "llama_cpp": lc.__version__,
        "ggml_features": lc.llama_print_system_info().decode(errors="replace").strip(),
        "model": model_identity(model, path),
        "n_threads": n_threads,
        "kv_unified": kv_unified,
        "weights_repacked": model.repacked,
    }


@dataclass(frozen=True)
class ProbeResult:
    facts: list[AttentionFacts]
    key: dict[str, Any]
    source: str  # "measured" (now) or "cache"
    path: Path
    seconds: float  # how long the measurement took (when it was made)
    measured_at: str

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "path": str(self.path),
            "measured_at": self.measured_at,
            "seconds": round(self.seconds, 1),
            "key": self.key,
            "facts": [f.to_dict() for f in self.facts],
        }


def probe(
    model: LlamaModel,
    path: Path,
    *,
    n_threads: int,
    kv_unified: bool,
    refresh: bool = False,
    folder: Path | None = None,
) -> ProbeResult:
    """The cached facts for this setup, or measure them now and cache them."""
    key = probe_key(model, path, n_threads, kv_unified)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    file = (folder or cache_dir()) / "probes" / f"{digest}.json"
    if not refresh and file.exists():
        cached = _read(file, key)
        if cached is not None:
            return cached
    log.info(
        "measuring this CPU's batch shapes once for this model and %d threads "
        "(half a minute to several on a 2-core CPU); the result is kept in %s",
        n_threads,
        file.parent,
    )
    t0 = time.perf_counter()
    facts = measure(model, n_threads=n_threads, kv_unified=kv_unified)
    release_openmp_threads()  # the engine may compute from another thread
    result = ProbeResult(
        facts, key, "measured", file, time.perf_counter() - t0, datetime.now(UTC).isoformat()
    )
    _write(file, result)
    return result


def _read(file: Path, key: dict[str, Any]) -> ProbeResult | None:
    try:
        d = json.loads(file.read_text())
        if d["key"] != key:
            raise ValueError("written for another setup")
        return ProbeResult(
            [AttentionFacts.from_dict(f) for f in d["facts"]],
            key,
            "cache",
            file,
            float(d["seconds"]),
            str(d["measured_at"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the device probe file %s (%s); measuring again", file, e)
        return None


def _write(file: Path, result: ProbeResult) -> None:
    """Best effort: an unwritable cache folder costs a probe next time, not this run."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps(result.describe(), indent=1) + "\n")
        tmp.replace(file)
    except OSError as e:
        log.warning("could not keep the device probe in %s (%s)", file, e)
