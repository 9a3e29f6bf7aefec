"""Batch shapes for the CPU at hand: what the device probe measured, and the settings chosen
from it.

ggml picks its CPU kernels by shape, and which kernel computes a row changes its rounding:
with repacked Q4_K weights a matmul computes rows in blocks of four with one kernel and the
rest with another, and attention computes short query pieces differently from long ones.
Which shapes are affected differs between instruction sets (an AVX-512 Xeon without
repacking: decode groups up to 7 and prompt pieces of 8+ were bit-identical; a Zen 5 EPYC
with repacking: groups up to 3 and pieces in multiples of 4). So nothing here is a constant:
`AttentionFacts` holds what the probe measured for one flash-attention setting, and
`choose_settings` turns the facts into the settings a run uses, with its reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from edgeprefill.runtime.core.load import ExpectedLoad

Mode = Literal["exact", "fast"]
Batching = Literal["auto", "exact", "fast"]

# `auto` batches exactly when that costs less than this on the CPU at hand.
EXACT_COST_LIMIT = 0.03
# A piece rule needs this many passing sizes in a row to count as measured, so that one
# lucky size (rounding can agree by chance) does not become a rule.
MIN_PASSING_PIECES = 3
# The probe times a chunk beside decodes, DEEP_CHUNK tokens DEEP_DEPTH into its sequence.
DEEP_DEPTH = 2048
DEEP_CHUNK = 64


@dataclass(frozen=True)
class AttentionFacts:
    """Measured with one flash-attention setting on this CPU, llama.cpp build, model and
    thread count."""

    flash_attn: bool
    decode_group_ok: dict[int, bool]  # g decode rows in one pass == each decoded alone
    piece_ok: dict[int, bool]  # prompt pieces of this size == the prompt in one piece
    tail_ok: bool  # a prompt's last piece may have any size
    decode_step_s: dict[int, float]  # g decode rows in one pass -> seconds
    prefill_tok_s: dict[int, float]  # n_ubatch -> prompt tokens per second
    deep_chunk_s: float  # a 64-token chunk 2,048 tokens deep in its sequence -> seconds

    @property
    def max_decode_group(self) -> int:
        """The largest g such that every decode group of 1..g rows was bit-identical."""
        g = 1
        while self.decode_group_ok.get(g + 1, False):
            g += 1
        return g

    @property
    def piece_rule(self) -> tuple[int, int] | None:
        """(smallest piece, quantum): every multiple of the quantum from the smallest piece
        up to the largest size probed was bit-identical. None: no such rule was found."""
        top = max(self.piece_ok, default=0)
        for quantum in (1, 2, 4):
            sizes = list(range(quantum, top + 1, quantum))
            passing = 0
            for size in reversed(sizes):
                if not self.piece_ok.get(size, False):
                    break
                passing += 1
            if passing >= MIN_PASSING_PIECES:
                return sizes[len(sizes) - passing], quantum
        return None

    @property
    def exact(self) -> bool:
        """Some batching with this setting keeps every sequence's logits bit-identical."""
        return self.piece_rule is not None and self.tail_ok

    def best_ubatch(self, n_batch: int) -> int:
        fitting = {u: r for u, r in self.prefill_tok_s.items() if u <= n_batch}
        return max(fitting, key=lambda u: fitting[u]) if fitting else n_batch

    def decode_time(self, n: int, group: int | None) -> float:
        """Seconds for n decode rows passed in groups of at most `group` (None: one pass
        of up to the largest size measured)."""
        largest = max(self.decode_step_s)
        step = min(group or largest, largest)
        full, rest = divmod(n, step)
        return full * self.decode_step_s[step] + (self.decode_step_s[rest] if rest else 0.0)

    def to_dict(self) -> dict[str, Any]:
        """The measurements (times in ms), and for a reader of the cache what follows."""
        d = asdict(self)
        d["decode_step_ms"] = {g: s * 1e3 for g, s in d.pop("decode_step_s").items()}
        d["deep_chunk_ms"] = d.pop("deep_chunk_s") * 1e3
        derived = {"max_decode_group": self.max_decode_group, "piece_rule": self.piece_rule}
        return {**d, **derived, "exact": self.exact}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AttentionFacts:
        def ints(m: dict[str, Any]) -> dict[int, Any]:
            return {int(k): v for k, v in m.items()}

        return cls(
            flash_attn=bool(d["flash_attn"]),
            decode_group_ok=ints(d["decode_group_ok"]),
            piece_ok=ints(d["piece_ok"]),
            tail_ok=bool(d["tail_ok"]),
            decode_step_s={g: ms / 1e3 for g, ms in ints(d["decode_step_ms"]).items()},
            prefill_tok_s=ints(d["prefill_tok_s"]),
            deep_chunk_s=float(d["deep_chunk_ms"]) / 1e3,
        )


@dataclass(frozen=True)
class BatchSettings:
    """How the backend batches: context settings and the shapes the scheduler may plan."""

    mode: Mode
    flash_attn: bool
    n_ubatch: int
    max_decode_group: int | None  # None: every decode in one pass
    min_chunk: int  # no prompt piece shorter, and no shorter remainder left
    chunk_quantum: int  # pieces other than a prompt's last are multiples of it
    max_chunk: int | None  # most prompt tokens of one request per iteration (None: n_batch)
    # Set by `choose_settings` once hand-set values are applied:
    exact: bool = False  # every shape this run can plan was measured bit-identical
    reason: str = ""  # why these settings, in the probe's numbers
    exact_cost: float | None = None  # measured slowdown of exact against fast batching

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Overrides:
    """Settings a user fixed by hand; each replaces what the probe would choose."""

    flash_attn: bool | None = None
    n_ubatch: int | None = None
    max_decode_group: int | None = None


def _costs(f: AttentionFacts, group: int | None, n: int, n_batch: int) -> list[float]:
    """Seconds per prompt token, for a chunk deep in a document, for n decode rows."""
    rate = f.prefill_tok_s.get(f.best_ubatch(n_batch), 0.0) or 1e-9
    return [1.0 / rate, f.deep_chunk_s, f.decode_time(n, group)]


def _run_seconds(
    f: AttentionFacts, group: int | None, n: int, n_batch: int, load: ExpectedLoad
) -> float:
    """The expected load's compute time with these facts: prompt tokens up to DEEP_DEPTH at
    the prefill rate, beyond it at the deep chunk's cost per token, outputs at the cost per
    row of passes of n rows."""
    shallow, deep, rows = _costs(f, group, n, n_batch)
    return sum(
        s.count
        * (
            min(s.prompt_tokens, DEEP_DEPTH) * shallow
            + max(s.prompt_tokens - DEEP_DEPTH, 0.0) * deep / DEEP_CHUNK
            + s.output_tokens * rows / n
        )
        for s in load.shapes
    )


def choose_settings(
    facts: list[AttentionFacts],
    batching: Batching,
    *,
    n_seq_max: int,
    n_batch: int,
    overrides: Overrides | None = None,
    load: ExpectedLoad | None = None,
) -> BatchSettings:
    """Fast: the flash-attention setting and micro-batch that compute the run's expected
    `load` fastest, every decode in one pass; with no load given, the one that prefills,
    computes a chunk deep in a document and decodes `n_seq_max` rows fastest, the three
    weighed alike. Exact: the fastest setting whose shapes the probe found bit-identical,
    decode groups and prompt pieces restricted to those shapes. Auto: exact where that is
    at most 3% slower at each of the three (a property of the CPU, not of one run), else
    fast."""
    o = overrides or Overrides()
    n = max(1, n_seq_max)
    bests = [min(c) for c in zip(*(_costs(f, None, n, n_batch) for f in facts), strict=True)]

    def slowdowns(f: AttentionFacts, group: int | None) -> list[float]:
        return [c / b for c, b in zip(_costs(f, group, n, n_batch), bests, strict=True)]

    def score(f: AttentionFacts, group: int | None) -> float:
        if load is None or not load.shapes:
            return sum(slowdowns(f, group))
        return _run_seconds(f, group, n, n_batch, load)

    fast = min(facts, key=lambda f: score(f, None))
    exact = min(
        (f for f in facts if f.exact),
        key=lambda f: score(f, f.max_decode_group),
        default=None,
    )
    cost = None
    if exact is not None:
        pairs = zip(slowdowns(exact, exact.max_decode_group), slowdowns(fast, None), strict=True)
        cost = max(e / q for e, q in pairs) - 1.0
    mode, why = _mode(batching, cost)
    if mode == "exact":
        settings = _exact_settings(exact or _safest(facts), n_batch)
    else:
        settings = BatchSettings(
            "fast", fast.flash_attn, fast.best_ubatch(n_batch), None, 1, 1, None
        )
    settings, inexact = _apply(settings, o, facts, n_seq_max)
    detail = (
        f"flash attention {'on' if settings.flash_attn else 'off'}, n_ubatch {settings.n_ubatch}"
    )
    if load is not None and load.shapes:
        detail += (
            f" (fastest for the run's expected {load.prompt_tokens:,.0f} prompt and "
            f"{load.output_tokens:,.0f} output tokens)"
        )
    if mode == "exact" and inexact:
        detail += f"; not exact: {inexact}"
    return replace(settings, reason=f"{mode} batching: {why}; {detail}", exact_cost=cost)


def _mode(batching: Batching, cost: float | None) -> tuple[Mode, str]:
    """The batching mode to use and why: `auto` is exact where that costs under
    EXACT_COST_LIMIT on this CPU (`cost`: None where no shape was exact)."""
    if batching != "auto":
        return batching, "asked for"
    if cost is None:
        return "fast", "no batch shape was bit-identical on this CPU"
    mode: Mode = "exact" if cost < EXACT_COST_LIMIT else "fast"
    side = "under" if mode == "exact" else "over"
    return mode, f"exact batching costs {cost:.0%} here ({side} {EXACT_COST_LIMIT:.0%})"


def _safest(facts: list[AttentionFacts]) -> AttentionFacts:
    """Where nothing was exact: flash attention off (it never was on the CPUs tried)."""
    return next((f for f in facts if not f.flash_attn), facts[0])


def _exact_settings(f: AttentionFacts, n_batch: int) -> BatchSettings:
    smallest, quantum = f.piece_rule or (1, 1)
    ubatch = f.best_ubatch(n_batch)
    return BatchSettings(
        "exact",
        f.flash_attn,
        ubatch,
        f.max_decode_group,
        smallest,
        quantum,
        ubatch,  # a chunk llama.cpp would split itself could leave a short remainder
    )


def _apply(
    s: BatchSettings, o: Overrides, facts: list[AttentionFacts], n_seq_max: int
) -> tuple[BatchSettings, str]:
    """Apply hand-set values, then say honestly whether the result is still exact, and if
    not, why not."""
    if o.flash_attn is not None:
        s = replace(s, flash_attn=o.flash_attn)
    if o.n_ubatch is not None:
        s = replace(s, n_ubatch=o.n_ubatch, max_chunk=o.n_ubatch if s.mode == "exact" else None)
    if o.max_decode_group is not None:
        s = replace(s, max_decode_group=o.max_decode_group)
    f = next(x for x in facts if x.flash_attn == s.flash_attn)
    fa = f"flash attention {'on' if f.flash_attn else 'off'}"
    group = s.max_decode_group or n_seq_max
    rule = f.piece_rule
    if not f.exact or rule is None:
        why = f"no prompt piece rule was bit-identical with {fa}"
    elif group > f.max_decode_group:
        why = f"decode groups of up to {group} exceed the {f.max_decode_group} measured exact"
    elif s.min_chunk < rule[0] or s.chunk_quantum % rule[1]:
        why = f"prompt pieces are not restricted to {rule[0]}+ in multiples of {rule[1]}"
    elif s.n_ubatch % rule[1]:
        why = f"n_ubatch {s.n_ubatch} is not a multiple of {rule[1]}"
    else:
        why = ""
    return replace(s, exact=not why), why
