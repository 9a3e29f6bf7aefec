"""First-token targets relative to the device, and the rate that keeps any chat from
starving (simulated backend: the costs are what the test says they are)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from edgeprefill.backends.sim import SimBackend
from edgeprefill.runtime.core.contract import Capacity
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.runner.calibration import save_profile

ROOT = Path(__file__).parents[1]
CLI = [sys.executable, "-m", "edgeprefill.runtime.cli.main"]

# A slow CPU: three decoding chats alone take longer than the 100 ms ITL target, so the
# budget beside them is 0 and only the first-token floor moves a waiting chat's prompt.
SLOW = CostModel(per_pass_s=0.020, per_sampled_s=0.030, per_prefill_s=0.003, per_kctx_s=0.0)
CAP = Capacity(n_batch=512, n_ctx=8 * 4096, n_seq_max=8, n_ctx_seq=4096, min_chunk=8, max_chunk=512)


def slow_profile() -> DeviceProfile:
    return DeviceProfile(SLOW, decode_s=0.05, target_s=0.1, n_batch=512, min_chunk=8, source="t")


def test_a_prompt_alone_is_its_chunks_each_a_pass_and_the_last_sampling_a_row():
    p = slow_profile()
    assert p.prompt_alone_s(300) == pytest.approx(0.020 + 0.030 + 300 * 0.003)
    assert p.prompt_alone_s(1000) == pytest.approx(2 * 0.020 + 0.030 + 1000 * 0.003)  # 2 chunks
    longest = p.longest_prompt_within(1.0)
    assert p.prompt_alone_s(longest) <= 1.0 < p.prompt_alone_s(longest + 1)


def test_a_chat_beside_decodes_that_fill_the_itl_target_gets_its_first_token_in_its_multiple():
    engine = Engine(
        SimBackend(SLOW, CAP), parse_policy("cadence:itl_ms=100"), profile=slow_profile()
    )
    talking = [
        Request(f"c{i}", "foreground", 0.0, list(range(10, 50)), 400, ignore_eos=True)
        for i in range(3)
    ]
    for r in talking:
        engine.add(r)
    while not all(r.output for r in talking):
        engine.iterate()
    late = Request(
        "late", "foreground", engine.clock.now(), list(range(10, 310)), 4, ttft_slowdown=3
    )
    engine.add(late)
    assert late.ttft_alone_s == pytest.approx(slow_profile().prompt_alone_s(300))
    iterations = []
    while not late.output:
        iterations.append(engine.iterate())
    assert all(len(r.output) < 400 for r in talking)  # the others decoded all along
    # No progress only until it is late (2/3 of its prompt alone: ~6 iterations of 0.11 s),
    # then some of its prompt in every iteration up to its first token.
    progress = ["late" in it.plan.prefill for it in iterations]
    first = progress.index(True)
    assert first <= 7 and all(progress[first:])
    # The budget alone for 2/3 of its time alone, then at the rate of 3x its time alone
    # (the others' 400-token answers end too late to wait for one): within 3.7x (it used to
    # get 0 tokens for 8 iterations in every 9: 40x).
    assert late.token_times_s[0] - late.arrival_s <= (3 + 2 / 3) * late.ttft_alone_s * 1.05
    # Each of its iterations takes at most 1.5x what the decodes and its pass take (plus
    # rounding to whole pieces, and the last one's sampled row).
    base = SLOW.predict(3, 0, 1, 0)
    assert max(it.timing.duration_s for it in iterations) <= 1.5 * base + 8 * 0.003 + 0.030


def test_an_absolute_target_this_device_cannot_meet_is_said_once_in_numbers(caplog):
    engine = Engine(SimBackend(SLOW, CAP), parse_policy("static:64"), profile=slow_profile())
    with caplog.at_level(logging.WARNING, logger="edgeprefill"):
        for i in range(3):  # 400 tokens alone: 1.25 s
            engine.add(Request(f"c{i}", "foreground", 0.0, list(range(400)), 4, ttft_target_s=1.0))
        engine.add(Request("ok", "foreground", 0.0, list(range(100)), 4, ttft_target_s=1.0))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1
    assert "400-token prompt alone takes 1.25 s" in said[0]
    assert f"over ~{slow_profile().longest_prompt_within(1.0)} tokens" in said[0]


def test_bursts_of_chats_at_one_thread_stay_within_the_readable_floor_and_start_sooner(tmp_path):
    """The bursty workload in the simulator calibrated from a run at --threads 1 on a 2-core
    EPYC (`edgeprefill calibrate`: a sampled row 19.5 ms, so five decoding chats fill the
    100 ms target): each chat that came in a burst used to go in at the guaranteed rate and
    become one more decode, up to 8 at 250 ms a token (P99 ITL 290/156/162 ms in seeds 0-2
    against DLFP's 119/116/118). Now the running chats' gaps stretch for a waiting chat to
    the readable-rate floor (150 ms) and no further, and the chats' first tokens come sooner
    than under DLFP, which keeps the gaps shorter (issue 41)."""
    cost = CostModel(0.00104, 0.01954, 0.002188, 0.0000891)
    path = tmp_path / "t1.json"
    save_profile(DeviceProfile(cost, 0.0137, 0.1, 2048, 1, "t1"), path)
    out = tmp_path / "cmp"
    cmd = [*CLI, "compare", str(ROOT / "workloads" / "assistant_bursty.yaml"), "--backend"]
    cmd += ["sim", "--cost-model", str(path), "--policies", "cadence,dlfp", "--seeds", "3"]
    res = subprocess.run([*cmd, "--out", str(out), "--no-progress"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    for seed in range(3):
        fg = {
            p: json.loads((out / f"seed{seed}" / p / "summary.json").read_text())["foreground"]
            for p in ("cadence", "dlfp")
        }
        assert fg["cadence"]["p99_itl_ms"] <= 150 + 5, (seed, fg["cadence"]["p99_itl_ms"])
        assert fg["cadence"]["mean_ttft_ms"] < fg["dlfp"]["mean_ttft_ms"], seed
