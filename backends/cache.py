"""Where backends keep what they measured or converted once per machine."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

CACHE_ENV = "EDGEPREFILL_CACHE_DIR"
KV_CACHE_ENV = "EDGEPREFILL_KV_CACHE_DIR"


def cache_dir() -> Path:
    """$EDGEPREFILL_CACHE_DIR, else the platform's user cache folder (~/.cache/edgeprefill
    on Linux)."""
    return Path(os.environ.get(CACHE_ENV) or platformdirs.user_cache_path("edgeprefill"))


def kv_cache_dir() -> Path:
    """Where saved prompt-prefix KV states go: $EDGEPREFILL_KV_CACHE_DIR, else
    `cache_dir()/kv-states`."""
    return Path(os.environ.get(KV_CACHE_ENV) or cache_dir() / "kv-states")
