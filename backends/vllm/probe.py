"""The startup probe on vLLM: a few steps with scripted prompt budgets, timed as every step
is, from which the runtime fits the same cost model as on llama.cpp.

vLLM plans its own batches, so the probe cannot hand it a batch; it steers vLLM's scheduler
with a policy whose budget follows a script: a chat decoding alone, then beside prompt
chunks of several sizes from a document, then both decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.plan import IterationTiming, SchedState
from edgeprefill.runtime.core.request import Request

CHUNKS = (16, 64, 128, 256, 512, 64, 16)


@dataclass
class ScriptedBudget(BudgetPolicy):
    """Budgets from a script while a prompt waits, one per step; 0 until the script is
    started, so the chat decodes alone first."""

    name: ClassVar[str] = "probe-script"
    script: deque[int] = field(default_factory=deque)
    hold: int = 6  # decode-only steps before the script starts
    timings: list[IterationTiming] = field(default_factory=list)

    def budget(self, state: SchedState) -> int | None:
        if state.n_decode == 0:
            return None  # the chat's own prompt
        if self.hold > 0:
            self.hold -= 1
            return 0
        return self.script.popleft() if self.script else None

    def observe(self, timing: IterationTiming) -> None:
        self.timings.append(timing)


def probe_timings(backend: Any, seed: int = 0) -> list[IterationTiming]:
    """Timed steps of a chat and a document on `backend` (a `VllmBackend`)."""
    tok = backend.tokenizer
    rng = np.random.default_rng(seed)
    normal = [t for t in range(min(tok.vocab_size, 4096)) if tok.is_normal(t)]
    doc_len = min(sum(CHUNKS) + 32, backend.settings.n_ctx - 64)
    tokens = [int(t) for t in rng.choice(normal, size=doc_len + 32)]
    policy = ScriptedBudget(deque(min(c, backend.max_num_batched_tokens - 2) for c in CHUNKS))
    engine = backend.engine(policy)
    n_decodes = policy.hold + len(CHUNKS) + 3
    chat = Request("probe-chat", "foreground", 0.0, tokens[:32], n_decodes + 1, ignore_eos=True)
    doc = Request("probe-doc", "background", 0.0, tokens[32:], 4, ignore_eos=True)
    engine.add(chat)
    doc_added = False
    while engine.has_work:
        if chat.output and not doc_added:  # the chat decodes: the document arrives
            doc_added = engine.add(doc)
        if engine.advance() is None:
            break
    return policy.timings
