"""A simulated backend: a virtual clock and a fitted cost model instead of a device.

It answers "what would this policy do on this workload at 10x the load" in seconds, and
makes policy tests deterministic. Iteration times come from a `CostModel` (fitted from a
real run with `edgeprefill calibrate`), optionally with seeded noise: Gaussian, or the
fitted run's own residuals drawn at random (a shared machine's stalls are rare and long, not
Gaussian, and they are what a tail target must absorb); sampled tokens are a
hash of the sequence's last token and position, so every policy sees the same outputs.
Every result it produces is labelled simulated.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from edgeprefill.runtime.core.contract import (
    Backend,
    Capacity,
    IterationResult,
    SeqWork,
    plain_transcript,
)
from edgeprefill.runtime.core.costs.costmodel import CostModel

BOS, EOG, FIRST_NORMAL = 1, 2, 10


class SimClock:
    """Virtual seconds: advanced by each simulated iteration and by idle waits.

    Its time passes only inside `sleep`/`advance`, so an alarm cannot be a thread waiting on
    it (as a real clock's is): the clock rings its alarms itself when it passes their time."""

    def __init__(self) -> None:
        self.t = 0.0
        self._alarms: list[SimAlarm] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float, stop: threading.Event | None = None) -> float:
        """Move `seconds` on, ringing each alarm due on the way at its time; stop early at
        a ring that sets `stop`. Returns the seconds moved."""
        start, end = self.t, self.t + seconds
        for alarm in sorted(
            (a for a in self._alarms if a.deadline is not None and a.deadline <= end),
            key=lambda a: a.deadline or 0.0,
        ):
            self.t = max(self.t, alarm.deadline or 0.0)
            alarm.ring()
            if stop is not None and stop.is_set():
                return self.t - start
        self.t = end
        return seconds

    def alarm(self, fire: Callable[[], None]) -> SimAlarm:
        """An alarm that calls `fire` once when this clock passes its deadline (the
        replay's arrival alarm, in virtual time)."""
        alarm = SimAlarm(fire, self._alarms.remove)
        self._alarms.append(alarm)
        return alarm


class SimAlarm:
    def __init__(self, fire: Callable[[], None], forget: Callable[[SimAlarm], None]) -> None:
        self._fire = fire
        self._forget = forget
        self.deadline: float | None = None

    def set(self, deadline: float | None) -> None:
        """Ring once at `deadline` (clock seconds); None disarms."""
        self.deadline = deadline

    def ring(self) -> None:
        self.deadline = None
        self._fire()

    def close(self) -> None:
        self._forget(self)


class SimTokenizer:
    """Words and punctuation hashed to ids: exact-length prompts without a model."""

    def __init__(self, vocab_size: int = 32000) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        span = self.vocab_size - FIRST_NORMAL
        ids = [
            FIRST_NORMAL + zlib.crc32(w.encode()) % span for w in re.findall(r"\w+|[^\w\s]", text)
        ]
        return ([BOS] if add_bos else []) + ids

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        return ((system + "\n\n" if system else "") + "User: ", "\nAssistant:")

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        return plain_transcript(messages)

    def tool_calls_form(self) -> str:
        return "json"

    def piece(self, token: int) -> bytes:
        return f" w{token}".encode()

    def decode(self, tokens: list[int]) -> str:
        return b"".join(map(self.piece, tokens)).decode()

    def is_normal(self, token: int) -> bool:
        return token >= FIRST_NORMAL

    def is_eog(self, token: int) -> bool:
        return token == EOG


class SimBackend(Backend):
    name = "sim"

    def __init__(
        self,
        cost: CostModel,
        capacity: Capacity,
        *,
        noise: float = 0.0,
        residuals: Sequence[float] = (),
        seed: int = 0,
        clock: SimClock | None = None,
    ) -> None:
        if noise < 0:
            raise ValueError(f"noise must not be negative, got {noise}")
        self.cost = cost
        self.capacity = capacity
        self.tokenizer = SimTokenizer()
        self.clock = clock or SimClock()
        self.noise = noise
        self.residuals = np.asarray(residuals, dtype=float)
        self._rng = np.random.default_rng(seed)

    supports_abort = True

    def execute(
        self, work: Sequence[SeqWork], abort: threading.Event | None = None
    ) -> IterationResult:
        """Price the batch with the cost model and move the clock on by it. With an `abort`
        flag, as llama.cpp: the decodes finish first; an alarm ringing during the prompt work
        stops it there, keeping the prompt tokens computed by then (in the scheduler's
        quantum; a chunk completed before it is sampled)."""
        decodes = [w for w in work if w.is_decode]
        chunks = [w for w in work if not w.is_decode]
        predicted = self._predict(work)
        duration = self._noisy(predicted)
        if abort is None or not chunks:
            self.clock.sleep(duration)
            return IterationResult(duration_s=duration, sampled=self._sampled(work))
        decoding = duration * self._predict(decodes) / predicted if decodes else 0.0
        self.clock.advance(decoding)
        if abort.is_set():
            return IterationResult(decoding, self._sampled(decodes), {w.seq_id: 0 for w in chunks})
        computing = self.clock.advance(duration - decoding, abort)
        if not abort.is_set():
            return IterationResult(duration_s=duration, sampled=self._sampled(work))
        kept = self._kept(chunks, computing / (duration - decoding))
        done = [w for w in chunks if kept[w.seq_id] == len(w.tokens)]
        return IterationResult(decoding + computing, self._sampled(decodes + done), kept)

    def _predict(self, work: Sequence[SeqWork]) -> float:
        n_decode = sum(w.is_decode for w in work)
        return self.cost.predict(
            n_decode,
            sum(len(w.tokens) for w in work if not w.is_decode),
            len(work) - n_decode,
            sum(w.ctx_work for w in work),
            n_sampled=sum(w.sample is not None for w in work),
        )

    def _noisy(self, duration: float) -> float:
        if self.noise:
            duration *= max(0.0, 1.0 + self.noise * float(self._rng.normal()))
        if self.residuals.size:
            # No iteration is free: one a residual would make shorter than a tenth of its
            # prediction takes that tenth.
            duration = max(duration / 10, duration + float(self._rng.choice(self.residuals)))
        return duration

    def _kept(self, chunks: list[SeqWork], done: float) -> dict[int, int]:
        """The prompt tokens computed in `done` of the prompt work, chunk after chunk; the
        chunk it stopped in keeps whole quanta only."""
        left = int(done * sum(len(w.tokens) for w in chunks))
        q = self.capacity.chunk_quantum
        kept = {}
        for w in chunks:
            n = min(left, len(w.tokens))
            kept[w.seq_id] = n if n == len(w.tokens) else n // q * q
            left -= n
        return kept

    def _sampled(self, work: Sequence[SeqWork]) -> dict[int, int]:
        span = self.tokenizer.vocab_size - FIRST_NORMAL
        return {
            w.seq_id: FIRST_NORMAL
            + zlib.crc32(f"{w.tokens[-1]}@{w.pos + len(w.tokens)}".encode()) % span
            for w in work
            if w.sample is not None
        }

    def release(self, seq_id: int) -> None:
        """No cache to free; the capacity accounting lives in the scheduler."""

    def describe(self) -> dict[str, Any]:
        c = self.capacity
        return {
            "name": self.name,
            "simulated": True,
            "clock": "virtual",  # iteration times from the cost model
            "preemption": "a foreground arrival stops background-only prompt work at once",
            "cost_model": self.cost.to_dict(),
            "noise": self.noise,
            "residuals": int(self.residuals.size),
            "n_batch": c.n_batch,
            "n_ctx_seq": c.n_ctx_seq,
            "n_seq_max": c.n_seq_max,
            "min_chunk": c.min_chunk,
            "chunk_quantum": c.chunk_quantum,
        }

    def close(self) -> None:
        """Nothing native to free."""
