"""A conversation resent whole at every turn computes only what is new, and answers exactly
as if it had computed everything: on the real model, through the runtime and through
`serve` with the `openai` client."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from edgeprefill.runtime.api.runtime import Runtime
from edgeprefill.runtime.core.request import SamplingParams
from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(0.0, 1.0, 0)


def question(tok, i: int, words: int = 3) -> list[int]:
    text = f"\nUser: What is fact {i} about rivers, lakes and the sea? " * words
    return tok.encode(text + "\nAssistant:", add_bos=False, special=False)


def replay(rt: Runtime, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Each prompt in turn (the next submitted once the last has ended), greedy."""
    outputs = []
    for prompt in prompts:
        handle = rt.submit(prompt, max_tokens=max_tokens, sampling=GREEDY, ignore_eos=True)
        outputs.append(list(handle.result().output))
    return outputs


def conversation(rt: Runtime, turns: int) -> tuple[list[list[int]], list[int]]:
    """A conversation whose every prompt is the last one, its answer and a new question;
    the prompts sent and the tokens each reused."""
    tok = rt.backend.tokenizer
    history = tok.encode("A talk about water.\n", add_bos=True, special=False)
    prompts, reused = [], []
    for i in range(turns):
        prompt = history + question(tok, i)
        handle = rt.submit(prompt, max_tokens=24, sampling=GREEDY, ignore_eos=True)
        answer = list(handle.result().output)
        prompts.append(prompt)
        reused.append(handle.request.prefix_reused_tokens)
        history = prompt + answer
    return prompts, reused


def test_reused_prefixes_answer_exactly_as_computed_ones(make_backend):
    """Turns inside and past the 512-token sliding window, then a prompt that leaves the
    last answer half-way (a regenerated turn: the match ends inside the answer's run)."""
    with Runtime(make_backend(n_seq_max=4), "static:256", profile=None) as rt:
        prompts, reused = conversation(rt, 10)
        assert len(prompts[-1]) > 700  # past the window
        tok = rt.backend.tokenizer
        half = prompts[-1][: len(prompts[-2]) + 12] + question(tok, 99)
        prompts.append(half)
        reused_outputs = replay(rt, [half])
        reused.append(rt.engine.scheduler.parked.stats.reused_tokens)
    assert all(n > len(p) - 40 for n, p in zip(reused[1:-1], prompts[:-2], strict=True)), reused
    fresh_backend = make_backend(n_seq_max=4, kv_cache=False)
    fresh_backend.keeps_sequences = False  # every prompt computed from its first token
    with Runtime(fresh_backend, "static:256", profile=None) as rt:
        fresh = replay(rt, prompts)
    with Runtime(make_backend(n_seq_max=4), "static:256", profile=None) as rt:
        again = replay(rt, prompts)  # each continuing the previous one where they agree
    assert again == fresh
    assert reused_outputs[0] == fresh[-1]


def test_200_conversations_in_a_small_memory_budget_are_evicted_and_recomputed_right(
    make_backend,
):
    """More conversations than sequences: parked ones are evicted to the saved states'
    memory, which holds 8 MiB (a few dozen first turns); every second turn continues what is left of its first (or
    computes it), and answers as a fresh computation does."""
    budget = 8 << 20
    backend = make_backend(n_seq_max=4, kv_cache_ram=budget, kv_cache_disk=0)
    tok = backend.tokenizer
    firsts = [
        tok.encode(f"Topic {i}: ", add_bos=True, special=False) + question(tok, i, 1)
        for i in range(200)
    ]
    with Runtime(backend, "static:256", profile=None) as rt:
        answers = replay(rt, firsts, max_tokens=4)
        seconds = [
            f + a + question(tok, 1000 + i, 1)
            for i, (f, a) in enumerate(zip(firsts, answers, strict=True))
        ]
        # Newest first: the last conversations are still parked, the ones before them in
        # the saved states' memory, the oldest gone (computed again).
        handles = [
            rt.submit(p, max_tokens=4, sampling=GREEDY, ignore_eos=True) for p in reversed(seconds)
        ][::-1]
        outputs = [list(h.result().output) for h in handles]
        assert all(h.request.error is None for h in handles)
        store = backend.prefix_cache.store.describe()
        parked = rt.engine.scheduler.parked.stats
    assert store["ram_bytes"] <= budget and store["evicted_from_ram"] > 0, store
    assert parked.evicted >= 196 and parked.spilled == parked.evicted
    assert store["restored"] >= 2 and parked.hits >= 2, (store, parked)
    assert sum(h.request.prefix_reused_tokens > 0 for h in handles) >= 6
    fresh_backend = make_backend(n_seq_max=4, kv_cache=False)
    fresh_backend.keeps_sequences = False
    with Runtime(fresh_backend, "static:256", profile=None) as rt:
        sample = list(range(0, 200, 10))
        fresh = replay(rt, [seconds[i] for i in sample], max_tokens=4)
    assert [outputs[i] for i in sample] == fresh


def test_a_conversation_through_serve_computes_only_its_new_tokens(make_backend, tmp_path):
    """Ten turns with the `openai` client, the whole conversation sent each time: from
    turn 2 on `cached_tokens` covers the previous prompt but a few tokens, and the prompt
    tokens the engine computed for turn 10 are about those of turn 2 (requests.jsonl)."""
    from openai import OpenAI

    out = tmp_path / "served"
    with serving(make_backend, results=out) as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key=KEY)
        messages = [{"role": "system", "content": "You answer questions about water."}]
        usages = []
        for i in range(10):
            messages.append({"role": "user", "content": f"Tell me fact {i} about rivers. " * 4})
            reply = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=24, temperature=0
            )
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            usages.append(reply.usage)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    prompts = [u.prompt_tokens for u in usages]
    assert cached[0] == 0
    for i in range(1, 10):
        assert cached[i] >= prompts[i - 1] - 16, (i, cached, prompts)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    computed = [r["prefilled_tokens"] for r in records]
    assert computed[9] <= 1.3 * computed[1] + 16, computed


CONVERSATION_WORKLOAD = {
    "name": "conversation_run",
    "seed": 3,
    "streams": {
        "talk": {
            "class": "foreground",
            "arrivals": {
                "process": "closed_loop",
                "users": 2,
                "turns": 4,
                "think_s": 0.2,
                "stagger_s": 0.5,
                "conversation": True,
            },
            "prompt": {"source": "text", "tokens": {"min": 60, "max": 90}},
            "output_tokens": {"min": 12, "max": 12},
            "ignore_eos": True,
        },
    },
}


def test_a_conversation_workload_resends_each_turn_and_run_reuses_it(tmp_path):
    """`run` builds each turn from the turn before it (its prompt and answer, then the new
    part the trace gives), and the engine computes only that new part (but for the
    answer's last token, never fed back, and the turn's piece alignment)."""
    workload = tmp_path / "conversation.yaml"
    workload.write_text(yaml.safe_dump(CONVERSATION_WORKLOAD))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "edgeprefill.runtime.cli.main", "run", str(workload)]
    res = subprocess.run(
        [*cmd, "--backend", "llamacpp", "--out", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    trace = {r["id"]: r for r in map(json.loads, (out / "arrivals.jsonl").open())}
    done = {r["id"]: r for r in map(json.loads, (out / "requests.jsonl").open())}
    assert len(done) == 8 and all(r["error"] is None for r in done.values())
    for rid, r in done.items():
        if "after" not in r:
            assert r["prefix_reused_tokens"] == 0 and "continues" not in trace[rid]
            continue
        before = done[r["after"]]
        resent = before["prompt_tokens"] + len(before["output_token_ids"])
        assert trace[rid]["continues"] and r["continues"]
        assert r["prompt_tokens"] == resent + trace[rid]["prompt_tokens"]
        assert resent - 4 <= r["prefix_reused_tokens"] <= resent, rid
    by_turn = json.loads((out / "summary.json").read_text())["foreground"]["mean_ttft_by_turn_ms"]
    assert len(by_turn) == 4
