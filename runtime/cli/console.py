"""What a person sees at the end of a run: a fixed-width summary."""

from __future__ import annotations

from typing import Any

from edgeprefill.runtime.core.request import CLASSES

WIDTH = 56


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_summary(s: dict[str, Any]) -> str:
    title = " edgeprefill run (SIMULATED) " if s.get("simulated") else " edgeprefill run "
    lines = [f"{title:=^{WIDTH}}"]
    rows: list[tuple[str, Any]] = [
        ("Backend:", s["backend"]["name"]),
        ("Model:", s["backend"].get("model_description", s["backend"].get("model"))),
        ("Policy:", s["policy"]["spec"]),
        ("Workload:", f"{s['workload']['name']} (seed {s['seed']})"),
        ("Completed / failed:", f"{s['completed']} / {s['failed']}"),
        ("Interrupted:", "yes" if s["interrupted"] else "no"),
        ("Duration (s):", s["duration_s"]),
        ("Makespan (s):", s["makespan_s"]),
        ("Iterations:", s["iterations"]),
        ("Accounting reconciled:", "yes" if s["accounting"]["reconciled"] else "NO"),
    ]
    pre = s.get("preemption")
    if pre and pre["count"]:  # document iterations stopped for a chat's arrival
        rows.append(
            (
                "Preemptions (median to abort):",
                f"{pre['count']} ({pre['median_abort_latency_ms']:.1f} ms)",
            )
        )
    wait = s.get("step_wait")
    if wait and wait["max_ms"] is not None:  # chats that arrived during an iteration
        rows.append(("Longest wait for a running iteration:", f"{wait['max_ms']:.0f} ms"))
    lines += [f"{k:<34}{_fmt(v):>22}" for k, v in rows]
    batching = s["backend"].get("batching")
    if batching is not None:  # the reason is longer than a table cell
        exact = "bit-identical shapes" if batching["exact"] else "outputs may depend on batching"
        lines.append(f"Batching: {batching['mode']} ({exact}); {batching['reason']}")
        probe = s["backend"].get("probe")
        if probe is not None:
            lines.append(f"Device probe: {probe['source']} ({probe['path']})")
    if s["backend"]["name"] == "vllm":  # what timed each completed iteration
        b = s["backend"]
        lines.append(
            f"vLLM {b['vllm_version']} on {b['device']}: {b['dtype']}, iterations timed by "
            f"{b['clock']}, {'async' if b['async_scheduling'] else 'sync'} scheduling"
        )
    for cls in CLASSES:
        lines += _class_lines(cls, s[cls])
    lines += _energy_lines(s.get("energy"))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _class_lines(cls: str, c: dict[str, Any]) -> list[str]:
    """One class's latencies (vLLM bench's statistics), attainment and throughput."""
    lines = [f"{' ' + cls + ' ':-^{WIDTH}}"]
    lines.append(f"{'Completed / failed:':<34}{c['completed']:>10} / {c['failed']:<9}")
    for label, key in (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2el")):
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p95", "P95"), ("p99", "P99")):
            lines.append(f"{name + ' ' + label + ' (ms):':<34}{_fmt(c[f'{stat}_{key}_ms']):>22}")
    lines += _attainment_lines(c.get("ttft_attainment"))
    lines.append(f"{'Input / output tokens:':<34}{c['input_tokens']:>10} / {c['output_tokens']:<9}")
    if c.get("prefix_reused_tokens"):
        lines.append(f"{'Input tokens restored, not computed:':<34}{c['prefix_reused_tokens']:>10}")
    by_turn = c.get("mean_ttft_by_turn_ms")
    if by_turn:
        lines.append(f"{'Mean TTFT by turn (ms):':<34}{' '.join(f'{t:.0f}' for t in by_turn)}")
    lines.append(f"{'Prefill throughput (tok/s):':<34}{_fmt(c['prefill_tok_s']):>22}")
    lines.append(f"{'Output throughput (tok/s):':<34}{_fmt(c['output_tok_s']):>22}")
    return lines


def _attainment_lines(att: dict[str, Any] | None) -> list[str]:
    """First tokens in time: against the target relative to this device, then against an
    absolute one where given."""
    lines: list[str] = []
    rel = (att or {}).get("relative")
    if rel is not None:
        within = "/".join(f"{t:g}x" for t in rel["slowdowns"])
        lines.append(f"{f'TTFT within {within} alone:':<34}{rel['met']:>10} / {rel['requests']:<9}")
        worst = rel["max_over_alone"]
        lines.append(f"{'Worst TTFT / its prompt alone:':<34}{_fmt(worst):>22}")
        ref = rel.get("reference")
        if ref is not None:  # the prompts ahead counted (a burst)
            lines.append(
                f"{f'TTFT within {within} reference:':<34}{ref['met']:>10} / {ref['requests']:<9}"
            )
            lines.append(
                f"{'Worst TTFT / its reference:':<34}{_fmt(ref['max_over_reference']):>22}"
            )
            mean = ref["mean_ttft_over_mean_reference"]
            lines.append(f"{'Mean TTFT / mean reference:':<34}{_fmt(mean):>22}")
    ab = (att or {}).get("absolute")
    if ab is not None:
        within = "/".join(f"{t:g}" for t in ab["targets_s"])
        label = f"TTFT within target ({within} s):"
        lines.append(f"{label:<34}{ab['met']:>10} / {ab['requests']:<9}")
        if ab["infeasible_alone"]:
            lines.append(f"{'  not feasible even alone here:':<34}{ab['infeasible_alone']:>10}")
    return lines


def _energy_lines(energy: dict[str, Any] | None) -> list[str]:
    """Energy per output token with its source, or each device's reason it has none."""
    if energy is None:
        return []
    lines = [f"{' energy ':-^{WIDTH}}"]
    for device, source in energy["sources"].items():
        if isinstance(source, str):
            lines.append(f"{device.upper() + ' source:':<20}{source:>36}")
        else:
            lines.append(f"{device.upper() + ':':<20}unavailable ({source['reason']})")
    whole = energy.get("whole_run")
    if whole:
        per = whole["j_per_output_token"]
        lines.append(f"{'Energy (J):':<34}{_fmt(whole['joules_total']):>22}")
        for key in ("all", "foreground", "background"):
            lines.append(f"{'J per output token, ' + key + ':':<34}{_fmt(per[key]):>22}")
    return lines
