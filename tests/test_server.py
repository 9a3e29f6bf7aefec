"""`edgeprefill serve` on the real model, over a real loopback socket, with the clients its
users run: the official `openai` client, httpx and curl."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from tests.server_helpers import KEY, curl_post, serving
from tests.terminal import python_from_a_terminal

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture
def server(make_backend):
    with serving(make_backend) as running:
        yield running


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_openai_client_streams_the_same_answer_it_gets_whole_with_usage(server):
    base, _ = server
    c = client(base)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Name three rivers."}]}
    whole = c.chat.completions.create(**ask, max_tokens=12, temperature=0)
    chunks = list(
        c.chat.completions.create(
            **ask,
            max_completion_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    # "stop" where the answer reached the plain transcript's next turn, else "length".
    assert finishes[-1] == whole.choices[0].finish_reason
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed.completion_tokens == whole.usage.completion_tokens
    assert streamed.prompt_tokens == whole.usage.prompt_tokens
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    # The stream's prompt continued the whole answer's sequence, but for its last token.
    assert streamed.prompt_tokens_details.cached_tokens in (0, streamed.prompt_tokens - 1)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert [m.id for m in c.models.list().data] == ["tiny"]
    # Each streamed chunk's time from the engine's stamp to the connection is measured.
    metrics = _metrics(base)
    sent = sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks)
    assert f"edgeprefill_token_delivery_seconds_count {float(sent)}" in metrics


def test_a_stop_string_cuts_the_text_before_it_and_ends_the_request_as_completed(server):
    base, runtime = server
    c = client(base)
    ask = {"model": "tiny", "prompt": "A list of fruit: apple, pear,", "temperature": 0}
    full = c.completions.create(**ask, max_tokens=16).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and full.index(stop) > 0
    cut = c.completions.create(**ask, max_tokens=16, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 16
    # It ended as completed, not as an error, and gave its sequence back.
    completed = 'edgeprefill_requests_ended_total{cls="foreground",outcome="completed"} 2.0'
    deadline = time.monotonic() + 30
    while completed not in (metrics := _metrics(base)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert completed in metrics and 'outcome="error"' not in metrics
    assert not runtime.engine.scheduler.running
    # Its sequence stayed parked: a prompt that continues its text starts from it.
    follow = {**ask, "prompt": ask["prompt"] + cut.choices[0].text + " and"}
    after = c.completions.create(**follow, max_tokens=2).usage.prompt_tokens_details
    reusable = runtime.engine.scheduler.piece_floor(cut.usage.prompt_tokens)
    assert after.cached_tokens >= reusable > 0


def _metrics(base: str) -> str:
    return httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_curl_gets_server_sent_events_ending_in_done_and_the_key_is_required(server):
    base, _ = server
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    out = curl_post(f"{base}/v1/chat/completions", body, KEY)
    events = [line for line in out.splitlines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert httpx.get(f"{base}/health").status_code == 200  # no key needed
    denied = httpx.get(f"{base}/v1/models")
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    wrong = httpx.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_bad_requests_are_400_with_the_field_named(server):
    base, _ = server
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    cases = [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ]
    for body, param in cases:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = h.post("/v1/completions", json={"prompt": list(range(5000)), "max_tokens": 2})
    assert r.status_code == 400 and "context holds 4096" in r.json()["error"]["message"]


def test_documents_are_background_work_with_progress_and_a_priority_field_sets_the_class(server):
    base, _ = server
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    r = h.post(
        "/v1/documents", json={"text": "Bees make honey from nectar. " * 150, "max_tokens": 6}
    )
    assert r.status_code == 202
    doc = r.json()["id"]
    long = h.post("/v1/documents", json={"text": "Rain falls on hills. " * 600}).json()["id"]
    # a chat with vLLM's priority field: background above 0
    r = h.post(
        "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 3, "priority": 1}
    )
    assert r.status_code == 200
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = h.get(f"/v1/documents/{doc}").json()
        seen.append(state["prompt_tokens_read"])
        if state["status"] == "finished":
            break
        time.sleep(0.1)
    assert state["status"] == "finished" and state["output"] and state["error"] is None
    assert state["prompt_tokens_read"] == state["prompt_tokens"] and seen == sorted(seen)
    gone = h.delete(f"/v1/documents/{long}")
    assert gone.status_code == 200 and gone.json()["deleted"]
    assert h.get(f"/v1/documents/{long}").status_code == 404  # forgotten once deleted
    assert h.get("/v1/documents/nope").status_code == 404
    metrics = h.get("/metrics").text
    ended = [
        line for line in metrics.splitlines() if line.startswith("edgeprefill_requests_ended_total")
    ]
    assert 'edgeprefill_requests_ended_total{cls="background",outcome="completed"} 2.0' in ended
    assert 'edgeprefill_requests_ended_total{cls="background",outcome="error"} 1.0' in ended
    for name in (
        "edgeprefill_ttft_seconds_bucket",
        "edgeprefill_itl_seconds_bucket",
        "edgeprefill_requests_waiting",
        "edgeprefill_prefill_budget_tokens",
    ):
        assert name in metrics


def test_a_question_by_document_id_restores_the_document_and_computes_only_the_question(server):
    base, _ = server
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    text = "The lighthouse keeper logged ship number seven at dawn. " * 70
    doc = h.post("/v1/documents", json={"text": text, "max_tokens": 4}).json()["id"]
    c = client(base)
    # Asked at once, while the document is still read: it waits for the read rather than
    # computing the document a second time beside it.
    early = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "What did the keeper log?"}],
        max_tokens=6,
        extra_body={"document_id": doc},
    )
    later = c.completions.create(
        model="tiny", prompt="Who kept the log?", max_tokens=6, extra_body={"document_id": doc}
    )
    read = h.get(f"/v1/documents/{doc}").json()["prompt_tokens"]
    for usage in (early.usage, later.usage):
        cached = usage.prompt_tokens_details.cached_tokens
        assert cached > read - 64 and usage.prompt_tokens - cached < 64, usage
    unknown = h.post("/v1/completions", json={"prompt": "x", "document_id": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"


def test_a_chat_goes_ahead_of_a_long_document_and_a_dropped_stream_frees_its_sequence(server):
    base, runtime = server
    h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    doc = h.post("/v1/documents", json={"text": "Rivers run to the sea. " * 600}).json()["id"]
    time.sleep(0.5)  # the document's prompt is being read
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}
    answer = h.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200
    state = h.get(f"/v1/documents/{doc}").json()
    assert state["status"] != "finished" and state["prompt_tokens_read"] < state["prompt_tokens"]
    # A client that goes away mid-stream: its request ends and gives its sequence back. It
    # ignores EOS so that only the disconnect can end it before 200 tokens.
    long_chat = {**chat, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with h.stream("POST", "/v1/chat/completions", json=long_chat) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    h.delete(f"/v1/documents/{doc}")
    # Both ends are counted after the engine lets the sequences go: wait for the counts.
    ended = [
        f'edgeprefill_requests_ended_total{{cls="{cls}",outcome="error"}} 1.0'
        for cls in ("foreground", "background")
    ]
    deadline = time.monotonic() + 60
    while not all(e in (metrics := h.get("/metrics").text) for e in ended):
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert not runtime.engine.scheduler.running


def test_32_concurrent_streams_end_once_each_and_background_prompts_never_ride_with_chats(
    make_backend, tmp_path
):
    """32 clients at once (asyncio, httpx), a quarter of them background work with longer
    prompts, on the default policy: every stream ends with [DONE], each request is in
    requests.jsonl once, the accounting reconciles, and no iteration computed a priority-1
    prompt beside a priority-0 one."""
    import asyncio

    out = tmp_path / "served"

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
        background = i % 4 == 0
        prompt = f"Notes {i}: " + "the tide came in and went out. " * (60 if background else 2)
        body = {"prompt": prompt, "max_tokens": 6, "stream": True, "priority": int(background)}
        body["ignore_eos"] = True  # sampled at temperature 1: an end token may be drawn
        async with c.stream("POST", "/v1/completions", json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]

    async def clients() -> list[tuple[int, list[str]]]:
        auth = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=600) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    with serving(make_backend, policy="cadence", n_seq_max=8, results=out) as (base, _):
        answers = asyncio.run(clients())
    for status, lines in answers:
        assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
        assert all(line.startswith("data: ") for line in lines), lines
    records = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 32 == len({r["id"] for r in records})
    short = [r for r in records if r["error"] is not None or len(r["output_token_ids"]) != 6]
    assert not short, [(r["id"], r["error"], r["output_token_ids"]) for r in short]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["submitted"] == 32 and summary["accounting"]["reconciled"]
    iterations = [json.loads(x) for x in (out / "iterations.jsonl").read_text().splitlines()]
    chats_prompts = [i for i in iterations if i["n_prefill_foreground"]]
    assert chats_prompts and not any(i["n_prefill_background"] for i in chats_prompts)
    assert any(i["n_prefill_background"] for i in iterations)


def test_streamed_tokens_cross_once_an_iteration_and_are_written_between_device_calls(
    make_backend, tmp_path
):
    """The serving design's rule, read from the server's own iterations.jsonl: an
    iteration's tokens reach the event loop in one hand-over for every stream, and the
    engine waits for them to be written before its next device call, so the HTTP work never
    takes a core from llama.cpp's compute threads (history, section F). /metrics counts the
    same hand-overs."""
    import asyncio

    out = tmp_path / "served"
    auth = {"Authorization": f"Bearer {KEY}"}

    async def one(c: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 24, "stream": True}
        async with c.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r:
            lines = [line[6:] async for line in r.aiter_lines() if line.startswith("data: {")]
        return sum(bool(c["text"]) for x in lines for c in json.loads(x)["choices"])

    async def clients() -> list[int]:
        async with httpx.AsyncClient(base_url=base, headers=auth, timeout=600) as c:
            return await asyncio.gather(*(one(c, i) for i in range(6)))

    with serving(make_backend, n_seq_max=8, results=out) as (base, _):
        chunks = sum(asyncio.run(clients()))
        metrics = httpx.get(f"{base}/metrics", headers=auth).text
    iterations = [json.loads(x) for x in (out / "iterations.jsonl").read_text().splitlines()]
    handed = [i["handover"] for i in iterations if "handover" in i]
    assert sum(h["events"] for h in handed) >= 6 * 24  # every token crossed in a hand-over
    assert max(h["streams"] for h in handed) >= 4  # one wake-up for several streams
    late = sum(h["late_writes"] for h in handed)
    assert chunks >= 6 * 20 and late <= 0.05 * chunks, (late, chunks)
    assert f"edgeprefill_handovers_total {float(len(handed))}" in metrics


def test_metrics_report_energy_per_token_where_rapl_measures_it(make_backend, tmp_path):
    """RAPL is the thin layer no machine here has: a fake powercap tree whose counter the
    test moves by 2 J while 4 tokens are generated."""
    from edgeprefill.thermal.telemetry import TelemetryConfig
    from tests.test_thermal import rapl_domain

    energy = rapl_domain(tmp_path, "intel-rapl:0", "package-0", 0)
    telemetry = TelemetryConfig(period_s=0.05, root=tmp_path)
    with serving(make_backend, telemetry=telemetry) as (base, _):
        h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        assert "edgeprefill_energy_joules_per_token{" not in h.get("/metrics").text
        r = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
        assert r.json()["usage"]["completion_tokens"] == 4
        energy.write_text("2000000")  # microjoules
        deadline = time.monotonic() + 30  # sampled after the move, on a loaded machine too
        while True:
            lines = h.get("/metrics").text.splitlines()
            line = next(x for x in lines if x.startswith("edgeprefill_energy_joules_per_token{"))
            if float(line.split()[-1]) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert 'device="cpu"' in line and 'source="rapl:package-0"' in line
    assert float(line.split()[-1]) == pytest.approx(2.0 / 4)


def test_a_full_queue_is_429_with_retry_after_per_class_and_a_stopping_server_503(make_backend):
    from edgeprefill.runtime.server.admission import QueueLimits

    limits = {"queue": QueueLimits(foreground=None, background=1)}
    with serving(make_backend, server=limits) as (base, runtime):
        h = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        long = {"text": "Clouds drift over the valley. " * 300, "max_tokens": 4}
        docs = [h.post("/v1/documents", json=long) for _ in range(5)]  # 4 sequences + 1
        assert [r.status_code for r in docs] == [202] * 5
        full = h.post("/v1/documents", json=long)
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error"
        assert "--max-document-queue" in full.json()["error"]["message"]
        # A backlog of documents does not turn a chat away.
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
        with h.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200
        for r in docs:
            h.delete(f"/v1/documents/{r.json()['id']}")
        runtime.stop()
        stopping = h.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert stopping.status_code == 503 and stopping.json()["error"]["message"]
        health = h.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "stopping"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)
    raise AssertionError(f"the server did not come up: {proc.poll()}")


def test_sigterm_with_requests_in_flight_keeps_the_finished_and_marks_the_rest(
    tmp_path, kv_cache_folder
):
    import signal
    import sys

    # A scratch KV folder that a killed server left (its process is gone): removed at start.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = kv_cache_folder / f"kv-{dead.pid}-left"
    stale.mkdir(parents=True)
    (stale / "x.kvstate").write_bytes(b"what a document said")
    port, out = free_port(), tmp_path / "served"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgeprefill.runtime.cli.main",
            "serve",
            "--port",
            str(port),
            "--policy",
            "static:64",
            "--n-ctx",
            "4096",
            "--n-seq-max",
            "4",
            "--calibration",
            "none",
            "--results",
            str(out),
            "--cancel-on-shutdown",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        h = httpx.Client(base_url=base, timeout=120)
        done = h.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3}).json()
        doc = h.post("/v1/documents", json={"text": "Snow on the pass. " * 600}).json()["id"]
        with h.stream(
            "POST", "/v1/completions", json={"prompt": "Count:", "max_tokens": 2000, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # streaming when the signal comes
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the stream ended, cancelled, not cut off
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, stderr  # after its results are written
    assert list(kv_cache_folder.glob("kv-*")) == []  # its own scratch folder too: gone
    assert "Traceback" not in stderr, stderr
    records = {
        json.loads(line)["id"]: json.loads(line)
        for line in (out / "requests.jsonl").read_text().splitlines()
    }
    assert len(records) == 3
    finished = [r for r in records.values() if r["error"] is None]
    assert (
        len(finished) == 1
        and len(finished[0]["output_token_ids"]) == 3 == done["usage"]["completion_tokens"]
    )
    assert {r["error"] for r in records.values() if r["error"]} == {"cancelled at shutdown"}
    # The document's id reads its answer: the results name it by the runtime's own id.
    assert doc not in records and sum(r["class"] == "background" for r in records.values()) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["submitted"] == 3 and summary["accounting"]["reconciled"]
    assert (out / "iterations.jsonl").read_text().count("\n") >= 3
    # Compute threads that sleep soon after a graph, not spin through the hand-over of tokens
    # (unless the user chose otherwise): recorded as the server's libgomp read it.
    from edgeprefill.runtime.server.serve import SERVE_SPIN_COUNT

    spin = os.environ.get("GOMP_SPINCOUNT", str(SERVE_SPIN_COUNT))
    assert summary["backend"]["gomp_spincount"] == spin


def test_the_serve_command_answers_curl_and_stops_cleanly_on_sigint(tmp_path):
    import signal
    import sys

    port = free_port()
    module = ["-m", "edgeprefill.runtime.cli.main"]
    proc = subprocess.Popen(
        [
            *python_from_a_terminal(*module),
            "serve",
            "--port",
            str(port),
            "--policy",
            "static:64",
            "--n-ctx",
            "2048",
            "--calibration",
            "none",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc)
        out = curl_post(f"{base}/v1/completions", {"prompt": "Hello", "max_tokens": 3})
        assert json.loads(out)["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr  # as a shell reports it
    bad = subprocess.run(
        [sys.executable, *module, "serve", "--backend", "vllm", "--model", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    sim = subprocess.run(
        [sys.executable, *module, "serve", "--backend", "sim", "--cost-model", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert sim.returncode == 2 and "--backend sim cannot serve" in sim.stderr, sim.stderr


def test_an_event_whose_text_holds_a_unicode_line_break_stays_one_line_for_line_readers():
    """A token's text may hold NEL or U+2028/U+2029, which JSON need not escape but
    `str.splitlines` (httpx's `aiter_lines`, as the 32-stream test reads) breaks at: seen as
    a stream line that was half an event. Each event reaches such a reader whole."""
    from httpx._decoders import LineDecoder

    from edgeprefill.runtime.server.responses import sse

    text = "one\x85two\u2028three\u2029four"
    lines = LineDecoder().decode(sse({"text": text}).decode())
    assert [json.loads(x.removeprefix("data: ")) for x in lines if x] == [{"text": text}]
