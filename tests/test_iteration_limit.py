"""Steps a backend cannot stop (vLLM): a documents-only step is sized so that a chat that
arrives during it waits no longer than its first-token allowance leaves; and how long chats
waited for running steps, in summary.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgeprefill.runtime.core.candidate import Candidate
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.iteration_limit import (
    FIRST_PROMPT,
    UNNOTICED_WAIT_S,
    IterationLimit,
)
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.core.planner import Planner
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.runner.calibration import save_profile

# vLLM's CPU build on an AVX2-only EPYC: ~6.4 ms a prompt token (issue 23).
SLOW = CostModel(per_pass_s=0.030, per_sampled_s=0.010, per_prefill_s=0.0064, per_kctx_s=0.0002)
# A GPU: a 2,048-token step in ~0.1 s.
GPU = CostModel(per_pass_s=0.004, per_sampled_s=0.0002, per_prefill_s=0.00004, per_kctx_s=1e-7)


def profile(cost: CostModel) -> DeviceProfile:
    return DeviceProfile(cost, decode_s=0.04, target_s=0.1, n_batch=2048, min_chunk=16, source="t")


def documents_only(pos: int = 1000, n_decode: int = 2) -> SchedState:
    return SchedState(
        n_prompts_running=1,
        n_prompts_waiting=0,
        n_decode=n_decode,
        n_decode_foreground=0,
        n_batch=2048,
        decode_ctx=n_decode * 3000,
        next_prompt_pos=pos,
        next_prompt_left=5000,
    )


def test_a_documents_only_step_is_predicted_within_the_wait_a_chats_allowance_leaves():
    limit = IterationLimit(profile(SLOW))
    # Before any chat: priced at a FIRST_PROMPT-token prompt, 3x its time alone.
    assert limit.wait_s == pytest.approx(2 * profile(SLOW).prompt_alone_s(FIRST_PROMPT))
    state = documents_only()
    n = limit.cap(state)
    assert n is not None and n < 2048  # the whole batch would keep a chat waiting ~13 s

    def predicted(tokens: int) -> float:
        ctx = state.decode_ctx + tokens * state.next_prompt_pos + tokens * (tokens + 1) // 2
        return SLOW.predict(state.n_decode, tokens, 1, ctx)

    assert predicted(n) <= limit.wait_s < predicted(n + 1)


def test_the_allowance_follows_the_chats_prompts_and_documents_always_progress():
    limit = IterationLimit(profile(SLOW))
    for n in (100, 400, 300):
        limit.saw_prompt(n)
    assert limit.wait_s == pytest.approx(2 * profile(SLOW).prompt_alone_s(300))  # the median
    # So many documents decoding that their rows alone fill the wait: the smallest chunk
    # still goes.
    costly_rows = IterationLimit(profile(CostModel(0.03, 1.0, 0.0064, 0.0)))
    assert costly_rows.cap(documents_only(n_decode=16)) == 16


def test_on_a_gpu_the_limit_changes_nothing_and_foreground_work_is_the_budgets_to_size():
    limit = IterationLimit(profile(GPU))
    assert limit.wait_s == UNNOTICED_WAIT_S  # a short prompt alone takes milliseconds
    assert limit.cap(documents_only()) >= 2048
    slow = IterationLimit(profile(SLOW))
    chat_decoding = SchedState(**{**documents_only().__dict__, "n_decode_foreground": 1})
    chat_waiting = SchedState(**{**documents_only().__dict__, "foreground_prompt_left": 200})
    assert slow.cap(chat_decoding) is None and slow.cap(chat_waiting) is None
    assert slow.cap(SchedState(**{**documents_only().__dict__, "next_prompt_left": 0})) is None


class HalfGuard:
    def update(self) -> None: ...

    def background_cap(self, budget, n_batch):
        return 40

    def snapshot(self):
        return {}


def test_the_planner_caps_documents_only_steps_and_keeps_a_smaller_cap():
    doc = Candidate("doc", "background", 1000, 5000, 0.0)
    limit = IterationLimit(profile(SLOW))
    decision = Planner(parse_policy("unlimited"), iteration_limit=limit).decide([doc], 2048, 0.0)
    state = Planner(parse_policy("unlimited")).state([doc], 2048, 0.0)
    assert decision.background_cap == limit.cap(state) < 2048
    assert "cannot be stopped" in decision.reason
    # Without a limit (llama.cpp stops such a step instead) nothing is capped.
    assert Planner(parse_policy("unlimited")).decide([doc], 2048, 0.0).background_cap is None
    # The thermal guard's smaller cap stands.
    guarded = Planner(parse_policy("unlimited"), HalfGuard(), limit).decide([doc], 2048, 0.0)
    assert guarded.background_cap == 40


# Issue 23's trace: five ~2,600-token documents at once, four chats arriving while they are read.
TRACE = Path(__file__).parents[1] / "benchmarks" / "step_wait.yaml"


def test_summary_gives_how_long_chats_waited_for_the_step_running_at_their_arrival(tmp_path):
    model = tmp_path / "cm.json"
    save_profile(profile(SLOW), model)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "run", str(TRACE)]
    cmd += ["--backend", "sim", "--cost-model", str(model), "--policy", "unlimited"]
    cmd += ["--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    wait = json.loads((out / "summary.json").read_text())["step_wait"]
    # From the result files: each chat's arrival inside an iteration's interval.
    steps = [json.loads(line) for line in (out / "iterations.jsonl").read_text().splitlines()]
    chats = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    waits = [
        s["t_start_s"] + s["duration_s"] - c["arrival_s"]
        for c in chats
        if c["class"] == "foreground"
        for s in steps
        if s["t_start_s"] < c["arrival_s"] < s["t_start_s"] + s["duration_s"]
    ]
    assert waits and wait["foreground_arrivals_mid_step"] == len(waits)
    assert wait["max_ms"] == pytest.approx(max(waits) * 1e3)
    assert max(waits) > 1.0  # unlimited reads 2,048-token steps of documents here
