from __future__ import annotations

import pytest

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import SchedState
from edgeprefill.runtime.policies import StaticPolicy, UnlimitedPolicy, parse_policy

STATE = SchedState(
    n_prompts_running=1, n_prompts_waiting=2, n_decode=3, n_decode_foreground=1, n_batch=2048
)


@pytest.mark.parametrize("spec", ["static:128", "static:tokens=128"])
def test_static_spec_forms_build_the_same_cap(spec):
    policy = parse_policy(spec)
    assert isinstance(policy, StaticPolicy) and policy.decide(STATE).budget == 128
    assert policy.describe() == {"name": "static", "params": {"tokens": 128}}


def test_unlimited_has_no_cap():
    policy = parse_policy("unlimited")
    assert isinstance(policy, UnlimitedPolicy) and policy.decide(STATE).budget is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "sttic:64",
            "unknown policy 'sttic'; choose one of: cadence, dlfp, ppas, static, unlimited",
        ),
        ("static:abc", "tokens must be int, got 'abc'"),
        ("static:0", "tokens must be at least 1, got 0"),
        ("static:-5", "tokens must be at least 1, got -5"),
        ("static:size=64", "unknown parameter 'size'; static takes tokens=..."),
        ("static:64,128", "unexpected '128'"),
        ("unlimited:5", "unlimited takes no parameters"),
        ("cadence:tail_pct=100", "tail_pct must be at least 50 and under 100, got 100"),
        ("cadence:share=0", "share must be over 0 and at most 1, got 0"),
    ],
)
def test_bad_specs_say_what_is_allowed(spec, message):
    with pytest.raises(UserError) as err:
        parse_policy(spec)
    assert message in str(err.value)
