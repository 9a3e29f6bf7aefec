"""Latency and throughput, computed from request records alone.

Definitions (vLLM's benchmark names): TTFT = first token - arrival; ITL = every gap between
consecutive tokens of a request; TPOT = (E2E - TTFT) / (n - 1), for n > 1; E2E = last token -
arrival. Percentiles are numpy's default (linear). Latency counts completed requests only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from itertools import pairwise
from typing import Any

import numpy as np

LATENCIES = ("ttft", "itl", "tpot", "e2el")
STATS = ("mean", "median", "p95", "p99")


def request_latencies(rec: Mapping[str, Any]) -> dict[str, list[float]]:
    """Seconds, per latency, for one completed request record."""
    times = rec["token_times_s"]
    if not times:
        return {k: [] for k in LATENCIES}
    ttft = times[0] - rec["arrival_s"]
    e2el = times[-1] - rec["arrival_s"]
    n = len(times)
    return {
        "ttft": [ttft],
        "itl": [b - a for a, b in pairwise(times)],
        "tpot": [(e2el - ttft) / (n - 1)] if n > 1 else [],
        "e2el": [e2el],
    }


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(STATS)
    a = np.asarray(values) * 1000.0
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "p99": float(np.percentile(a, 99)),
    }


def completed(rec: Mapping[str, Any]) -> bool:
    return rec["error"] is None and rec["finish_reason"] is not None


def pooled_latencies(records: Iterable[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Seconds, per latency, over every completed request of `records`."""
    pooled: dict[str, list[float]] = {k: [] for k in LATENCIES}
    for rec in records:
        if completed(rec):
            for k, v in request_latencies(rec).items():
                pooled[k].extend(v)
    return pooled


def class_summary(records: Iterable[Mapping[str, Any]], duration_s: float) -> dict[str, Any]:
    """`mean_/median_/p95_/p99_` x `ttft_ms, itl_ms, tpot_ms, e2el_ms`, token totals and
    throughputs over the run's duration, for one class of requests."""
    recs = list(records)
    done = [r for r in recs if completed(r)]
    pooled = pooled_latencies(done)
    out: dict[str, Any] = {"completed": len(done), "failed": len(recs) - len(done)}
    for k in LATENCIES:
        for stat, value in _stats(pooled[k]).items():
            out[f"{stat}_{k}_ms"] = value
    input_tokens = sum(r["prompt_tokens"] for r in done)
    output_tokens = sum(len(r["output_token_ids"]) for r in done)
    out["input_tokens"] = input_tokens
    out["prefix_reused_tokens"] = sum(r.get("prefix_reused_tokens", 0) for r in done)
    out["output_tokens"] = output_tokens
    out["prefill_tok_s"] = input_tokens / duration_s if duration_s > 0 else None
    out["output_tok_s"] = output_tokens / duration_s if duration_s > 0 else None
    # The class's own span, first arrival to last token: how long its work took, which
    # the run's duration hides when another class's arrivals set it.
    span = (
        max(r["token_times_s"][-1] for r in done) - min(r["arrival_s"] for r in done)
        if done
        else None
    )
    out["makespan_s"] = span
    out["span_prefill_tok_s"] = input_tokens / span if span else None
    out["ttft_attainment"] = ttft_attainment(recs)
    out["mean_ttft_by_turn_ms"] = ttft_by_turn(done)
    return out


def ttft_by_turn(done: list[Mapping[str, Any]]) -> list[float] | None:
    """Closed-loop users' mean first-token time at their first, second, ... turn (a turn
    is one after the request it follows): whether it grows as conversations do. None
    without closed-loop turns."""
    if not any(r.get("after") for r in done):
        return None
    after = {r["id"]: r.get("after") for r in done}
    turns: dict[str, int] = {}
    for rid in after:
        chain = [rid]  # back to a numbered turn, the first, or one that did not complete
        while (before := after[chain[-1]]) in after and before not in turns:
            chain.append(before)
        base = turns.get(after[chain[-1]] or "", 0)
        for k, turn in enumerate(reversed(chain), 1):
            turns[turn] = base + k
    if max(turns.values(), default=1) == 1:
        return None
    ttfts: dict[int, list[float]] = {}
    for r in done:
        ttfts.setdefault(turns[r["id"]], []).append(r["token_times_s"][0] - r["arrival_s"])
    return [1e3 * statistics.fmean(ttfts[k]) for k in sorted(ttfts)]


def ttft_attainment(records: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Of the requests with a TTFT target, how many had their first token in time (a
    request that failed or never produced a token missed it): against the target relative
    to the device (its slowdown times its prompt alone) and, separately, against the
    absolute one a caller gave, with how many of those this device could not meet even
    alone. None: no targets."""
    recs = list(records)
    relative = _attained(
        recs,
        lambda r: (
            r["ttft_slowdown"] * r["ttft_alone_s"]
            if "ttft_slowdown" in r and "ttft_alone_s" in r
            else None
        ),
    )
    absolute = _attained(recs, lambda r: r.get("ttft_target_s"))
    if relative is None and absolute is None:
        return None
    if relative is not None:
        relative["slowdowns"] = sorted({r["ttft_slowdown"] for r in recs if "ttft_slowdown" in r})
        over = [
            (r["token_times_s"][0] - r["arrival_s"]) / r["ttft_alone_s"]
            for r in recs
            if "ttft_slowdown" in r and r["token_times_s"] and r.get("ttft_alone_s")
        ]
        # How many times its time alone each first token took: the worst is the starvation
        # a person would notice.
        relative["p95_over_alone"] = float(np.percentile(over, 95)) if over else None
        relative["max_over_alone"] = max(over) if over else None
        relative["reference"] = against_reference(recs)
    if absolute is not None:
        absolute["targets_s"] = sorted({r["ttft_target_s"] for r in recs if "ttft_target_s" in r})
        absolute["infeasible_alone"] = sum(
            r.get("ttft_alone_s", 0.0) > r["ttft_target_s"] for r in recs if "ttft_target_s" in r
        )
    return {"relative": relative, "absolute": absolute}


def reference_ttfts(records: Iterable[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], float]]:
    """Each chat (in arrival order) with its reference time to its first token: what the
    device needs for it with nothing else to do but the chats ahead of it, their prompts
    computed alone (the engine's estimate, `ttft_alone_s`) one after another in arrival
    order, with no decode and no document. Alone it is its prompt-alone time; in a burst it
    counts the prompts ahead, which no policy can skip."""
    chats = sorted(
        (r for r in records if "ttft_slowdown" in r and r.get("ttft_alone_s") is not None),
        key=lambda r: r["arrival_s"],
    )
    free_s, out = 0.0, []
    for r in chats:
        free_s = max(free_s, r["arrival_s"]) + r["ttft_alone_s"]
        out.append((r, free_s - r["arrival_s"]))
    return out


def against_reference(records: list[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The chats' first tokens against their reference times: how many within their
    slowdown of it (one that never had a token did not), the worst ratio, and mean TTFT
    over mean reference."""
    pairs = reference_ttfts(records)
    if not pairs:
        return None
    ttft = [
        (r, ref, r["token_times_s"][0] - r["arrival_s"]) for r, ref in pairs if r["token_times_s"]
    ]
    mean_reference = float(np.mean([ref for _, ref in pairs]))
    return {
        "requests": len(pairs),
        "met": sum(t <= r["ttft_slowdown"] * ref for r, ref, t in ttft),
        "mean_reference_ms": 1e3 * mean_reference,
        "max_over_reference": max((t / ref for _, ref, t in ttft if ref > 0), default=None),
        "mean_ttft_over_mean_reference": (
            float(np.mean([t for *_, t in ttft])) / mean_reference
            if ttft and mean_reference
            else None
        ),
    }


def _attained(
    records: list[Mapping[str, Any]], target: Callable[[Mapping[str, Any]], float | None]
) -> dict[str, Any] | None:
    targeted = [(r, t) for r in records if (t := target(r)) is not None]
    if not targeted:
        return None
    met = sum(
        bool(r["token_times_s"]) and r["token_times_s"][0] - r["arrival_s"] <= t
        for r, t in targeted
    )
    return {"requests": len(targeted), "met": met, "rate": met / len(targeted)}
