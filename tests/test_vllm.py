"""The vLLM backend on vLLM's CPU build with a tiny locally written model: the same policy
objects inside vLLM's scheduler, completed-step timing, the same result files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")

from edgeprefill.backends.vllm.backend import VllmBackend  # noqa: E402
from edgeprefill.runtime.core.budget import BudgetPolicy  # noqa: E402
from edgeprefill.runtime.core.contract import ctx_work  # noqa: E402
from edgeprefill.runtime.core.costs.iteration_limit import FIRST_PROMPT, IterationLimit  # noqa: E402
from edgeprefill.runtime.core.plan import IterationTiming, SchedState  # noqa: E402
from edgeprefill.runtime.core.planner import MAX_DEFERRED  # noqa: E402
from edgeprefill.runtime.core.request import Request, Status  # noqa: E402
from edgeprefill.runtime.policies import parse_policy  # noqa: E402
from edgeprefill.runtime.runner.calibration import probe_device  # noqa: E402
from edgeprefill.runtime.runner.session import RunOptions, run_workload  # noqa: E402
from edgeprefill.runtime.traffic.workload import load_workload  # noqa: E402
from tests.vllm_model import tiny_settings, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WORKLOAD = """
name: vllm_small
seed: 3
streams:
  chat:
    class: foreground
    arrivals: {process: poisson, rate_per_s: 20, count: 6, start_s: 0.05}
    prompt: {source: text, tokens: {min: 40, max: 120}}
    output_tokens: {min: 12, max: 24}
    ignore_eos: true
  docs:
    class: background
    arrivals: {process: burst, count: 3, start_s: 0.0}
    prompt: {source: text, tokens: {min: 600, max: 900}}
    output_tokens: {min: 4, max: 8}
    ignore_eos: true
"""


@pytest.fixture(scope="module")
def vllm_backend(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    settings = tiny_settings(folder, n_seq_max=8)
    with VllmBackend(settings) as be:
        yield be


@pytest.fixture(scope="module")
def vllm_profile(vllm_backend):
    profile = probe_device(vllm_backend)
    assert profile.source == "probe" and profile.decode_s > 0
    # The scripted chunks were really timed: a chunk costs more than a decode alone (per
    # prompt token or per attended cell: with so small a model the fit may give either).
    chunk = profile.cost.predict(1, 512, 1, ctx_work(512, 0) + 1)
    assert chunk > profile.cost.predict(1, 0, 0, 1)
    return profile


@pytest.fixture
def workload(tmp_path) -> tuple[object, Path]:
    path = tmp_path / "w.yaml"
    path.write_text(WORKLOAD)
    return load_workload(path), path


def drain(engine, requests: list[Request]):
    """Submit everything at once and advance until done; every step's iteration record and
    the requests decoding when it was planned (from the driver's outputs, not the policy)."""
    for r in requests:
        assert engine.add(r)
    steps = []
    while engine.has_work:
        decoding = {r.id for r in requests if r.output and not r.done}
        adv = engine.advance()
        assert adv is not None, "vLLM scheduled nothing with work left"
        for it in adv.iterations:
            steps.append((decoding, it))
    return steps


def requests(tok, n_docs: int = 3, n_chats: int = 3) -> list[Request]:
    words = "the house of the river by the garden in summer "
    docs = [
        Request(
            f"doc{i}",
            "background",
            0.0,
            tok.encode(words * 90, add_bos=True, special=True)[: 500 + 37 * i],
            6,
            ignore_eos=True,
        )
        for i in range(n_docs)
    ]
    chats = [
        Request(
            f"chat{i}",
            "foreground",
            0.0,
            tok.encode(words * 9, add_bos=True, special=True)[: 30 + 7 * i],
            16,
            ignore_eos=True,
        )
        for i in range(n_chats)
    ]
    return chats + docs


@pytest.mark.parametrize("spec", ["ppas:nth=1,bmax=1024,bcap=24", "cadence"])
def test_prompt_tokens_stay_under_the_cap_and_every_decode_runs_every_step(
    vllm_backend, vllm_profile, spec
):
    if spec == "cadence":  # its cost model comes from the vLLM startup probe
        # A target this device meets with three chats decoding beside a 64-token chunk
        # of a document (measured here, not a number from one CPU).
        itl_s = vllm_profile.cost.predict(3, 64, 1, 3 * 60 + 64 * 300)
        spec = f"cadence:itl_ms={itl_s * 1e3:.2f}"
    policy = parse_policy(spec)
    if spec.startswith("cadence"):
        policy.calibrate(vllm_profile)
    engine = vllm_backend.engine(policy)
    steps = drain(engine, requests(vllm_backend.tokenizer))
    capped = 0
    runs: dict[str, int] = {}  # background decode -> steps in a row left out
    for decoding, it in steps:
        # Every running decode is in every step, but for background ones the policy may
        # defer (cadence, when a chat's target is at risk), never long: after MAX_DEFERRED
        # steps at least one goes, those with the fewest tokens first.
        assert set(it.plan.decode) | set(it.plan.deferred) == decoding
        assert all(rid.startswith("doc") for rid in it.plan.deferred)
        runs = {rid: runs.get(rid, 0) + 1 for rid in it.plan.deferred}
        n_docs = sum(rid.startswith("doc") for rid in decoding)
        assert all(n <= (MAX_DEFERRED + 1) * n_docs for n in runs.values())
        if it.plan.decode and it.plan.budget is not None:
            assert it.plan.n_prefill <= it.plan.budget
            capped += it.plan.n_prefill > 0
    assert capped >= 3  # prompts really rode along with decodes under the cap


def test_greedy_outputs_are_identical_across_policies(vllm_backend):
    outputs = {}
    for spec in ("unlimited", "static:16", "ppas:nth=1,bmax=1024,bcap=40"):
        reqs = requests(vllm_backend.tokenizer)
        drain(vllm_backend.engine(parse_policy(spec)), reqs)
        outputs[spec] = {r.id: r.output for r in reqs}
        assert all(
            len(o) == r.max_tokens for r, o in zip(reqs, outputs[spec].values(), strict=True)
        )
    first = outputs["unlimited"]
    assert all(o == first for o in outputs.values())


class Recording(BudgetPolicy):
    """A fixed budget that records every timing the scheduler hands it."""

    name = "recording"

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.seen: list[IterationTiming] = []

    def budget(self, state):
        return self.tokens

    def observe(self, timing):
        self.seen.append(timing)


def test_the_policy_gets_one_timing_per_completed_step_in_order_with_its_composition(vllm_backend):
    policy = Recording(48)
    steps = drain(vllm_backend.engine(policy), requests(vllm_backend.tokenizer))
    assert len(policy.seen) == len(steps)
    starts = [it.t_start_s for _, it in steps]
    assert starts == sorted(starts)
    for timing, (_, it) in zip(policy.seen, steps, strict=True):
        assert (timing.n_decode, timing.n_prefill) == (it.plan.n_decode, it.plan.n_prefill)
        assert timing.duration_s == it.timing.duration_s > 0
        assert timing.n_chunks == len(it.plan.prefill)


def test_a_run_writes_the_same_result_files_and_reconciles(vllm_backend, workload, tmp_path):
    spec, path = workload
    result = run_workload(
        spec,
        path,
        vllm_backend,
        "static:32",
        tmp_path / "run",
        options=RunOptions(progress=False, telemetry=None),
    )
    s = result.summary
    assert s["backend"]["name"] == "vllm" and s["backend"]["clock"] == "perf_counter"
    acc = s["accounting"]
    assert acc["reconciled"] and acc["submitted"] == 9 == acc["completed"]
    recs = [json.loads(x) for x in (tmp_path / "run" / "iterations.jsonl").read_text().splitlines()]
    assert sum(r["n_prefill"] for r in recs) == sum(r.prompt_len for r in result.requests)
    assert all(r["n_prefill"] <= 32 for r in recs if r["n_decode"])
    for r in result.requests:
        assert len(r.output) == r.max_tokens and len(r.token_times_s) == r.max_tokens


def test_a_request_longer_than_the_model_fails_with_a_reason_and_the_rest_run(vllm_backend):
    engine = vllm_backend.engine(parse_policy("unlimited"))
    too_long = Request("long", "background", 0.0, [5] * 2100, 4)
    ok = Request("ok", "foreground", 0.0, [5] * 20, 3, ignore_eos=True)
    assert not engine.add(too_long)
    assert "max_model_len 2048" in (too_long.error or "")
    drain(engine, [ok])
    assert len(ok.output) == 3


def test_one_workload_and_seed_give_byte_identical_arrivals_on_every_backend(
    vllm_backend, make_backend, workload, tmp_path
):
    from edgeprefill.backends.sim import SimBackend
    from edgeprefill.runtime.core.contract import Capacity
    from edgeprefill.runtime.core.costs.costmodel import CostModel

    spec, path = workload
    sim = SimBackend(CostModel(0.01, 0.002, 0.0005, 0.0001), Capacity(1024, 16384, 8, 2048))
    quiet = RunOptions(progress=False, telemetry=None)
    traces = {}
    for name, backend in (
        ("vllm", vllm_backend),
        ("llamacpp", make_backend(n_ctx=2048)),
        ("sim", sim),
    ):
        out = tmp_path / name
        run_workload(spec, path, backend, "static:256", out, seed=11, options=quiet)
        traces[name] = (out / "arrivals.jsonl").read_bytes()
    assert traces["vllm"] == traces["llamacpp"] == traces["sim"]
    assert traces["vllm"].count(b"\n") == 9


def add_documents(engine, tok) -> list[Request]:
    """Three 1,000-token documents, added to `engine` at once."""
    text = tok.encode(
        "the house of the river by the garden in summer " * 300, add_bos=True, special=True
    )
    docs = [
        Request(f"doc{i}", "background", 0.0, text[:1000], 3, ignore_eos=True) for i in range(3)
    ]
    for d in docs:
        engine.add(d)
    return docs


def test_a_chat_arriving_while_documents_prefill_goes_first_in_the_next_step(vllm_backend):
    """vLLM schedules running requests first whatever their priority; the runtime serves
    foreground prompts first on both backends, so the chat does not wait for documents,
    and with no budget set, no document tokens ride beside its prompt."""
    tok = vllm_backend.tokenizer
    engine = vllm_backend.engine(Recording(None))  # a capping policy that sets no budget
    docs = add_documents(engine, tok)
    engine.advance()  # the documents start their prompts (1024 tokens a step)
    chat = Request(
        "chat",
        "foreground",
        0.0,
        tok.encode("the garden " * 200, add_bos=True, special=True)[:200],
        4,
        ignore_eos=True,
    )
    engine.add(chat)
    (it,) = engine.advance().iterations
    assert it.plan.prefill == {"chat": 200}  # no budget: nothing rides beside its prompt
    while engine.has_work:
        engine.advance()
    assert len(chat.output) == 4 and all(len(d.output) == d.max_tokens for d in docs)


def test_a_documents_only_step_is_sized_for_the_wait_of_a_chat_arriving_during_it(
    vllm_backend, vllm_profile
):
    """vLLM cannot stop a step: with documents alone, each step holds the prompt tokens
    predicted to end within the wait a chat's allowance leaves, and the chat that arrives
    goes in the next step. The allowance is set from this device's measured profile to the
    time of 512 document tokens (at least 0 s rather than 0.25 s), so that the limit binds
    below n_batch however the measured costs split between passes, sampled rows and tokens
    (the tiny model's fit is noisy: with a fixed slowdown of 1.5 the cap was 83 tokens in
    one session and over 1,024 in another)."""
    tok = vllm_backend.tokenizer
    wait_s = vllm_profile.cost.predict(0, 512, 1, 512 * 513 // 2, n_sampled=0)
    slowdown = 1 + wait_s / vllm_profile.prompt_alone_s(FIRST_PROMPT)
    limit = IterationLimit(vllm_profile, slowdown=slowdown, min_wait_s=0.0)
    engine = vllm_backend.engine(
        parse_policy("unlimited"), profile=vllm_profile, iteration_limit=limit
    )
    docs = add_documents(engine, tok)
    first = [it for _ in range(2) for it in engine.advance().iterations]
    chat = Request("chat", "foreground", 0.0, docs[0].prompt[:200], 4, ignore_eos=True)
    engine.add(chat)
    (it,) = engine.advance().iterations
    assert "chat" in it.plan.prefill
    steps = first + [it]
    while engine.has_work:
        steps += engine.advance().iterations
    documents_only = [
        s
        for s in steps
        if s.plan.n_prefill and not s.timing.n_decode_foreground and "chat" not in s.plan.prefill
    ]
    # The largest step the limit allows: at the start of a prompt, nothing decoding, and
    # before any chat was seen (priced at a longer prompt than this chat's).
    widest = SchedState(1, 0, 0, 0, 1024, next_prompt_left=1000)
    cap = IterationLimit(vllm_profile, slowdown=slowdown, min_wait_s=0.0).cap(widest)
    assert cap is not None and cap < 1024  # without the limit, documents went 1,024 a step
    longest = max(documents_only, key=lambda s: s.plan.n_prefill)
    assert longest.plan.n_prefill <= cap
    assert all("cannot be stopped" in s.plan.decision.reason for s in documents_only)
    assert len(chat.output) == 4 and all(len(d.output) == d.max_tokens for d in docs)


class AlwaysDefer(Recording):
    name = "always-defer"

    def decide(self, state):
        return replace(super().decide(state), background_decodes=0)


def test_background_decodes_deferred_inside_vllm_never_longer_than_allowed(vllm_backend):
    tok = vllm_backend.tokenizer
    doc = Request(
        "doc",
        "background",
        0.0,
        tok.encode("the river " * 40, add_bos=True, special=True)[:60],
        30,
        ignore_eos=True,
    )
    chat = Request(
        "chat",
        "foreground",
        0.0,
        tok.encode("a house " * 40, add_bos=True, special=True)[:50],
        30,
        ignore_eos=True,
    )
    steps = drain(vllm_backend.engine(AlwaysDefer(256)), [doc, chat])
    runs, run = [], 0
    for decoding, it in steps:
        if "chat" in decoding:
            assert "chat" in it.plan.decode  # a chat's decode is never deferred
        if "doc" in decoding and "chat" in decoding:
            run = run + 1 if "doc" in it.plan.deferred else 0
            runs.append(run)
    assert max(runs) == MAX_DEFERRED and 0 in runs[MAX_DEFERRED:]  # deferred, then ran
    assert len(doc.output) == 30 and len(chat.output) == 30


def test_with_no_cap_vllm_schedules_every_request_as_it_would_without_edgeprefill(
    vllm_backend, monkeypatch
):
    """`unlimited` is the baseline: every scheduling decision is vLLM's own. A capping
    policy, even one whose cap never binds, serves a chat's prompt first."""
    from vllm.v1.core.sched.scheduler import Scheduler

    mixin_hook = type(vllm_backend.scheduler)._reserve_prefill_lookahead
    changed: list[bool] = []

    def spy(self, request, num_computed, num_new):
        ours = mixin_hook(self, request, num_computed, num_new)
        changed.append(
            ours != Scheduler._reserve_prefill_lookahead(self, request, num_computed, num_new)
        )
        return ours

    monkeypatch.setattr(type(vllm_backend.scheduler), "_reserve_prefill_lookahead", spy)
    tok = vllm_backend.tokenizer
    text = tok.encode(
        "the house of the river by the garden in summer " * 300, add_bos=True, special=True
    )
    for spec in ("unlimited", "static:100000"):
        changed.clear()
        engine = vllm_backend.engine(parse_policy(spec))
        for i in range(3):
            engine.add(Request(f"doc{i}", "background", 0.0, text[:1000], 3, ignore_eos=True))
        engine.advance()
        engine.add(Request("chat", "foreground", 0.0, text[:200], 3, ignore_eos=True))
        while engine.has_work:
            engine.advance()
        assert changed and any(changed) == (spec != "unlimited"), spec


class ChunkByTarget(Recording):
    """Records the first-token target the scheduler reports for a waiting chat."""

    name = "chunk-by-target"

    def __init__(self, tokens: int) -> None:
        super().__init__(tokens)
        self.targets: list[float | None] = []

    def decide(self, state):
        if state.foreground_prompt_left:
            self.targets.append(state.foreground_ttft_target_s)
        return super().decide(state)


def test_a_chats_prompt_goes_without_documents_decodes_and_its_target_reaches_the_policy(
    vllm_backend,
):
    """As on llama.cpp: while a chat's prompt is computed, documents' decodes wait (their
    sampled rows would delay its first token), and the policy sees the chat's own TTFT
    target to size its chunks."""
    tok = vllm_backend.tokenizer
    policy = ChunkByTarget(64)
    engine = vllm_backend.engine(policy)
    words = tok.encode("the house of the river " * 60, add_bos=True, special=True)
    docs = [
        Request(f"doc{i}", "background", 0.0, words[:40], 20, ignore_eos=True) for i in range(2)
    ]
    for d in docs:
        engine.add(d)
    while not all(d.output for d in docs):
        engine.advance()  # both documents decode from now on
    chat = Request("chat", "foreground", 0.0, words[:150], 4, ignore_eos=True, ttft_target_s=0.75)
    engine.add(chat)
    chat_steps = []
    while not chat.output:
        chat_steps += [it for it in engine.advance().iterations if "chat" in it.plan.prefill]
    assert len(chat_steps) >= 2  # 150 prompt tokens under a budget of 64
    for it in chat_steps:
        assert set(it.plan.deferred) == {"doc0", "doc1"} and "doc0" not in it.plan.decode
    assert policy.targets and set(policy.targets) == {0.75}
    while engine.has_work:
        engine.advance()
    assert len(chat.output) == 4 and all(len(d.output) == 20 for d in docs)


# One planner for both engines: the same states, described by each engine's own requests,
# give the same decisions and plans. (id, class, prompt tokens, computed, outputs, admitted,
# arrival)
SCRIPT = [
    [
        ("doc0", "background", 3000, 1024, 0, True, 0.0),
        ("chat0", "foreground", 300, 0, 0, False, 0.2),
    ],
    [
        ("doc0", "background", 3000, 1024, 0, True, 0.0),
        ("chat0", "foreground", 300, 96, 0, True, 0.2),
        ("doc1", "background", 2000, 0, 0, False, 0.1),
    ],
    [
        ("chat0", "foreground", 300, 300, 5, True, 0.2),
        ("doc0", "background", 3000, 3000, 3, True, 0.0),
        ("doc1", "background", 2000, 512, 0, True, 0.1),
        ("chat1", "foreground", 250, 0, 0, False, 0.9),
    ],
    [
        ("chat0", "foreground", 300, 300, 9, True, 0.2),
        ("chat1", "foreground", 250, 64, 0, True, 0.9),
        ("doc0", "background", 3000, 3000, 7, True, 0.0),
        ("doc1", "background", 2000, 1536, 0, True, 0.1),
    ],
    [
        ("chat0", "foreground", 300, 300, 30, True, 0.2),
        ("chat1", "foreground", 250, 250, 12, True, 0.9),
        ("doc1", "background", 2000, 1990, 0, True, 0.1),
    ],
    [
        ("chat1", "foreground", 250, 250, 40, True, 0.9),
        ("doc1", "background", 2000, 2000, 4, True, 0.1),
        ("doc2", "background", 1000, 0, 0, False, 2.0),
    ],
]


def core_scheduler(script_state, n_batch):
    from tests.helpers import make_scheduler

    sched, _ = make_scheduler(n_batch=n_batch, n_seq_max=8)
    for rid, cls, prompt, computed, outputs, admitted, arrival in script_state:
        req = Request(
            rid,
            cls,
            arrival,
            list(range(10, 10 + prompt)),
            64,
            ttft_target_s=1.0,
            ttft_slowdown=3.0,
        )
        sched.add(req)
        if admitted:
            sched._admit(req)
            req.num_computed = computed
            req.output = [7] * outputs
            if computed == prompt:
                req.status = Status.DECODE
    return sched


def vllm_candidates(scheduler, script_state, t0):
    """The script's requests as vLLM's scheduler lists them: candidates, and plan rows."""
    from vllm import SamplingParams
    from vllm.v1.request import Request as VllmRequest

    running, waiting = [], []
    for rid, cls, prompt, computed, outputs, admitted, arrival in script_state:
        req = VllmRequest(
            rid,
            list(range(10, 10 + prompt)),
            SamplingParams(max_tokens=64),
            None,
            arrival_time=t0 + arrival,
            priority=0 if cls == "foreground" else 1,
        )
        for _ in range(outputs):
            req.append_output_token_ids(7)
        req.num_computed_tokens = computed + max(outputs - 1, 0)
        scheduler.ep_ttft_targets[rid] = (1.0, 3.0)
        (running if admitted else waiting).append(req)
    held = scheduler.running, scheduler.waiting
    scheduler.running, scheduler.waiting = running, waiting
    try:
        candidates = scheduler._ep_candidates()
        return candidates, [c for c in candidates if c.admitted or c.admissible]
    finally:
        scheduler.running, scheduler.waiting = held
        for rid, *_ in script_state:
            scheduler.ep_ttft_targets.pop(rid, None)


@pytest.mark.parametrize("spec", ["cadence", "ppas", "dlfp", "static:64", "unlimited"])
def test_both_engines_plan_the_same_scripted_states_identically(vllm_backend, vllm_profile, spec):
    """The same states, described by each engine's own requests, give the same decisions,
    and the same plans: llama.cpp's scheduler after admitting what it can (as its engine
    does before planning), vLLM's adapter over its running and admissible waiting ones."""
    from edgeprefill.runtime.core.planner import Planner
    from edgeprefill.runtime.core.planning import Chunking, make_plan

    planners = []
    for _ in range(2):
        policy = parse_policy(spec)
        policy.calibrate(vllm_profile)
        policy.check_ready()
        planners.append(Planner(policy))
    core, vllm = planners
    n_batch, t0, now = 1024, 0.0, 1.25  # vLLM's wall-clock arrival times, from 0 here
    for script_state in SCRIPT:
        sched = core_scheduler(script_state, n_batch)
        ours = sched.candidates()
        theirs, rows = vllm_candidates(vllm_backend.scheduler, script_state, t0)
        assert core.state(ours, n_batch, now) == vllm.state(theirs, n_batch, t0 + now)
        decision = core.decide(ours, n_batch, now)
        assert decision == vllm.decide(theirs, n_batch, t0 + now)
        list(sched.admit())
        plan, their_plan = sched.plan(decision), make_plan(decision, rows, Chunking(n_batch))
        assert (plan.prefill, plan.deferred) == (their_plan.prefill, their_plan.deferred)
        assert sorted(plan.decode) == sorted(their_plan.decode)
        assert plan.n_prefill_foreground == their_plan.n_prefill_foreground
        assert plan.n_decode_foreground == their_plan.n_decode_foreground
