"""The real model at --threads 1, this CPU's stand-in for a laptop half as fast: a burst of
chats beside a document. Every chat gets its first token, and once one of them is late (it
has waited (slowdown - 1)/slowdown of its prompt alone) no iteration passes without the
chats' prompts progressing, whatever the other chats' decodes cost. Checked from the run's
own result files, not from the policy's state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

CLI = [sys.executable, "-m", "edgeprefill.runtime.cli.main"]

WORKLOAD = {
    "name": "slow_device_burst",
    "seed": 0,
    "streams": {
        "chat": {
            "class": "foreground",
            "arrivals": {"process": "burst", "count": 5, "start_s": 1.0, "interval_s": 0.3},
            "prompt": {"source": "text", "tokens": {"min": 120, "max": 220}},
            "output_tokens": {"min": 16, "max": 24},
            "ignore_eos": True,
        },
        "document": {
            "class": "background",
            "arrivals": {"process": "burst", "count": 1, "start_s": 0.0},
            "prompt": {"source": "text", "tokens": {"min": 1500, "max": 1500}},
            "output_tokens": {"min": 8, "max": 8},
            "ignore_eos": True,
        },
    },
}


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run_at_one_thread(tmp_path: Path, spec: dict) -> Path:
    workload = tmp_path / f"{spec['name']}.yaml"
    workload.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    cmd = [*CLI, "run", str(workload), "--backend", "llamacpp", "--threads", "1"]
    res = subprocess.run(
        [*cmd, "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def test_at_one_thread_a_late_chat_prompt_progresses_in_every_iteration(tmp_path):
    out = _run_at_one_thread(tmp_path, WORKLOAD)
    chats = [r for r in _lines(out / "requests.jsonl") if r["class"] == "foreground"]
    assert len(chats) == 5 and all(r["token_times_s"] and r["error"] is None for r in chats)
    iterations = _lines(out / "iterations.jsonl")
    late_iterations = 0
    for it in iterations:
        start = it["t_start_s"]
        end = start + it["duration_s"]
        # A chat is waiting through this iteration when it arrived before it started and
        # its first token came at its end or later; late once it has waited its share.
        late = [
            r["id"]
            for r in chats
            if r["arrival_s"] <= start
            and r["token_times_s"][0] >= end - 1e-6
            and start - r["arrival_s"] >= r["ttft_alone_s"] * (1 - 1 / r["ttft_slowdown"])
        ]
        if late:
            late_iterations += 1
            chat_tokens = sum(n for rid, n in it["prefill"].items() if rid.startswith("chat"))
            assert chat_tokens > 0, (start, late, it["decision"])
    assert late_iterations > 0  # the burst really made chats wait beside the others
    _assert_reference_reported(chats, json.loads((out / "summary.json").read_text()))


def _assert_reference_reported(chats: list[dict], summary: dict) -> None:
    """summary.json's reference (issue 41) against one computed here, independently: the
    chats' prompts alone, back to back in arrival order, each starting once it has arrived
    and the prompt before it is done."""
    ends: list[float] = []
    for r in sorted(chats, key=lambda r: r["arrival_s"]):
        start = max([r["arrival_s"], *ends[-1:]])
        ends.append(start + r["ttft_alone_s"])
    arrivals = sorted(r["arrival_s"] for r in chats)
    reference = [end - arrival for end, arrival in zip(ends, arrivals, strict=True)]
    by_arrival = sorted(chats, key=lambda r: r["arrival_s"])
    ttft = [r["token_times_s"][0] - r["arrival_s"] for r in by_arrival]
    reported = summary["foreground"]["ttft_attainment"]["relative"]["reference"]
    assert reported["requests"] == len(chats)
    assert abs(reported["mean_reference_ms"] - 1e3 * sum(reference) / len(chats)) < 1e-6
    slowdowns = [r["ttft_slowdown"] for r in by_arrival]
    within = zip(ttft, reference, slowdowns, strict=True)
    assert reported["met"] == sum(t <= s * ref for t, ref, s in within)
    worst = max(t / ref for t, ref in zip(ttft, reference, strict=True))
    assert abs(reported["max_over_reference"] - worst) < 1e-9
    # In a burst a chat's reference counts the prompts ahead of it: above its prompt alone.
    assert reference[-1] > by_arrival[-1]["ttft_alone_s"]


ARRIVING_BESIDE_TWO = {
    "name": "three_beside_two",
    "seed": 0,
    "streams": {
        "talking": {
            "class": "foreground",
            "arrivals": {"process": "burst", "count": 2, "start_s": 0.0, "interval_s": 0.1},
            "prompt": {"source": "text", "tokens": {"min": 40, "max": 60}},
            "output_tokens": {"min": 240, "max": 240},
            "ignore_eos": True,
        },
        "arriving": {
            "class": "foreground",
            "arrivals": {"process": "burst", "count": 3, "start_s": 2.0, "interval_s": 1.5},
            "prompt": {"source": "text", "tokens": {"min": 150, "max": 250}},
            "output_tokens": {"min": 2, "max": 2},
            "ignore_eos": True,
        },
    },
}


def test_at_one_thread_three_chats_arriving_beside_two_are_served_in_every_iteration(tmp_path):
    """Issue 41: three chats arrive while two others decode. Each starts while both still
    decode, and from its arrival until its prompt is done every iteration computes chat
    prompt tokens, the earliest arrived first: the device never spends an iteration on the
    decodes alone while a chat waits. The 3x-reference target itself depends on the CPU's
    speed (2.3-3.1x on AVX-512 machines; 2.8-3.6x on a 2-core Zen 3, AVX2 only, 7 Dec 2026,
    where decoding two rows costs half of every 100-150 ms iteration), so the benchmarks
    track it (benchmarks/history.md), not this test."""
    out = _run_at_one_thread(tmp_path, ARRIVING_BESIDE_TWO)
    chats = sorted(_lines(out / "requests.jsonl"), key=lambda r: r["arrival_s"])
    iterations = _lines(out / "iterations.jsonl")
    ends: dict[str, float] = {}
    for it in iterations:
        for rid in it["prefill"]:
            ends[rid] = it["t_start_s"] + it["duration_s"]
    talking_done = max(r["token_times_s"][-1] for r in chats if r["id"].startswith("talking"))
    arriving = [r for r in chats if r["id"].startswith("arriving")]
    for r in arriving:
        assert ends[r["id"]] < talking_done  # it arrived, and started, while both decoded
    for it in iterations:
        start = it["t_start_s"]
        waiting = [r["id"] for r in arriving if r["arrival_s"] <= start < ends[r["id"]]]
        if waiting:
            assert waiting[0] in it["prefill"], (start, waiting, it["prefill"], it["decision"])
