"""The slowest CPU the project has met (a 2-core Zen 3 EPYC, AVX2 only: one decode row 21
ms, four 110 ms, a prompt token 3.5 ms), put in the loop through the simulator with the cost
model measured there (tests/devices/, a copy of ../shared/devices/zen3-2core-avx2/).

A chat's first token is judged against its reference (its prompt alone, after the chats'
prompts ahead of it), computed here from requests.jsonl. Cadence sized a new chat's prompt
to the 100 ms ITL target only: beside three decoding chats (67 ms) it went in at a few
tokens an iteration and waited up to 4.5x (default workload) and 10x (bursty) its reference
(issue 41). Every chat within 3x cannot hold here: four or five chats decoding take 90-130
ms of every 150 ms the readable-rate floor allows, so a prompt beside them gets a share of
the device too small for 3x (benchmarks/history.md, section AC)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
ZEN3 = ROOT / "tests/devices/zen3-2core-avx2.json"
CLI = [sys.executable, "-m", "edgeprefill.runtime.cli.main"]


def _references(chats: list[dict]) -> list[float]:
    """Each chat's reference, in arrival order: the prompts alone, back to back."""
    ends: list[float] = []
    for r in chats:
        ends.append(max([r["arrival_s"], *ends[-1:]]) + r["ttft_alone_s"])
    return [end - r["arrival_s"] for end, r in zip(ends, chats, strict=True)]


def _run(tmp_path: Path, workload: str, policy: str) -> dict:
    out = tmp_path / f"{workload}-{policy}"
    cmd = [*CLI, "run", str(ROOT / f"workloads/{workload}.yaml"), "--backend", "sim"]
    cmd += ["--cost-model", str(ZEN3), "--policy", policy, "--out", str(out), "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    requests = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    chats = sorted(
        (r for r in requests if r["class"] == "foreground"), key=lambda r: r["arrival_s"]
    )
    assert chats and all(r["error"] is None and r["token_times_s"] for r in chats)
    ttft = [r["token_times_s"][0] - r["arrival_s"] for r in chats]
    reference = _references(chats)
    gaps = np.concatenate([np.diff(r["token_times_s"]) for r in chats])
    return {
        "over": [t / ref for t, ref in zip(ttft, reference, strict=True)],
        "mean_over": sum(ttft) / sum(reference),
        "p99_itl_s": float(np.percentile(gaps, 99)),
    }


@pytest.mark.parametrize("workload", ["assistant_plus_indexer", "assistant_bursty"])
def test_on_the_slowest_cpu_chats_wait_less_within_the_readable_floor(tmp_path, workload):
    """Against the same policy whose running chats never pass the ITL target
    (readable_ms at itl_ms: the rule before), on this device: the worst and the mean
    first token against the reference are lower, no more chats miss 3x, and the running
    chats' P99 token gap stays within the 150 ms readable-rate floor."""
    new = _run(tmp_path, workload, "cadence")
    old = _run(tmp_path, workload, "cadence:readable_ms=100")
    assert new["p99_itl_s"] <= 0.150
    assert old["p99_itl_s"] <= 0.100 + 0.010
    assert max(new["over"]) < max(old["over"])
    assert new["mean_over"] < old["mean_over"]
    assert sum(x > 3 for x in new["over"]) <= sum(x > 3 for x in old["over"])
