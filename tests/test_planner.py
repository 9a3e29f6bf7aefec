"""The planner: one decision per iteration from the state both engines describe alike."""

from __future__ import annotations

from dataclasses import replace

from edgeprefill.runtime.core.budget import BudgetPolicy
from edgeprefill.runtime.core.candidate import Candidate
from edgeprefill.runtime.core.plan import Decision
from edgeprefill.runtime.core.planner import MAX_DEFERRED, Planner
from edgeprefill.runtime.policies import parse_policy


class AlwaysDefer(BudgetPolicy):
    name = "always-defer"

    def decide(self, state):
        return Decision(0, background_decodes=0, reason="test")


CHAT = Candidate("chat", "foreground", 300, 0, 0.0)  # decoding
DOC = Candidate("doc", "background", 3000, 0, 0.0)  # decoding


def test_background_decodes_are_never_deferred_more_than_max_deferred_in_a_row():
    planner = Planner(AlwaysDefer())
    decisions = [planner.decide([CHAT, DOC], 512, 0.0) for _ in range(MAX_DEFERRED + 2)]
    deferred = [d.defers_background_decodes for d in decisions]
    assert deferred == [True] * MAX_DEFERRED + [False, True]
    # Nothing to defer: not a deferral, and it does not count towards the bound.
    assert not planner.decide([CHAT], 512, 0.0).defers_background_decodes


def test_a_chats_prompt_defers_documents_decodes_for_a_capping_policy_only():
    waiting_chat = Candidate("chat1", "foreground", 0, 200, 1.0, ttft_target_s=1.0, admitted=False)
    for spec, defers in (("static:64", True), ("ppas:bcap=32", True), ("unlimited", False)):
        decision = Planner(parse_policy(spec)).decide([DOC, waiting_chat], 512, 1.5)
        assert decision.defers_background_decodes == defers, spec
        assert decision.foreground_alone == (spec != "unlimited")
    # A chat that cannot be admitted yet is no reason to hold anything back.
    full = replace(waiting_chat, admissible=False)
    assert (
        not Planner(parse_policy("static:64"))
        .decide([DOC, full], 512, 1.5)
        .defers_background_decodes
    )


class Guard:
    def __init__(self) -> None:
        self.updates = 0

    def update(self) -> None:
        self.updates += 1

    def background_cap(self, budget, n_batch):
        return (n_batch if budget is None else budget) // 4

    def snapshot(self):
        return {"active": True}


def test_the_thermal_guard_caps_the_background_part_of_every_decision():
    guard = Guard()
    planner = Planner(parse_policy("static:256"), guard)
    decision = planner.decide([DOC], 2048, 0.0)
    assert (decision.budget, decision.background_cap, guard.updates) == (256, 64, 1)
    assert planner.snapshot() == {"thermal": {"active": True}}
    assert "background_cap=64" in str(decision) and "256-token" in str(decision)


def test_background_decodes_wait_only_for_the_foregrounds_sake():
    """With no foreground decode or prompt in the iteration, deferring the background's
    decodes would leave it empty: the planner refuses, whatever the policy asks."""
    planner = Planner(AlwaysDefer())
    assert not planner.decide([DOC], 512, 0.0).defers_background_decodes
    waiting_chat = Candidate("chat1", "foreground", 0, 200, 0.0, admitted=False)
    assert planner.decide([DOC, waiting_chat], 512, 0.0).defers_background_decodes


def test_prompts_compute_foreground_first_then_in_order_and_a_waiting_one_blocks_those_behind():
    """The one order the decision reads its next prompt in and the plan computes in."""
    from edgeprefill.runtime.core.candidate import prompt_order

    rows = [
        Candidate("doc0", "background", 500, 1500, 0.0),
        Candidate("chat0", "foreground", 40, 160, 0.5),
        DOC,
        CHAT,
        Candidate("chat1", "foreground", 0, 300, 0.6, admitted=False),
        Candidate("doc1", "background", 0, 4000, 0.1, admitted=False, admissible=False),
        Candidate("doc2", "background", 0, 900, 0.2, admitted=False),  # fits, but FCFS
    ]
    assert [c.id for c in prompt_order(rows)] == ["chat0", "chat1", "doc0"]
    assert Planner(parse_policy("unlimited")).state(rows, 2048, 1.0).next_prompt_left == 160
