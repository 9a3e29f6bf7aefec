"""`edgeprefill serve` on vLLM's CPU build: the same server, embedding API and result files
as on llama.cpp, over a real loopback socket with the official `openai` client and httpx.
In a module of its own: one vLLM engine per process."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test installs its CPU build)")
openai = pytest.importorskip("openai")

from edgeprefill.backends.vllm.backend import VllmBackend  # noqa: E402
from tests.server_helpers import KEY, serving  # noqa: E402
from tests.vllm_model import tiny_settings, write_tiny_model  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WORDS = "the house of the river by the garden in summer "
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def vllm_backend(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    settings = tiny_settings(folder, n_batch=512, n_seq_max=8, prefix_caching=True)
    with VllmBackend(settings) as be:
        yield be


def wait_for_document(base: str, doc_id: str) -> dict:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = httpx.get(f"{base}/v1/documents/{doc_id}", headers=AUTH).json()
        if state["status"] in ("finished", "failed"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"document {doc_id} did not finish: {state}")


def test_a_chat_streams_on_vllm_while_a_document_is_indexed_and_asked_about(vllm_backend, tmp_path):
    results = tmp_path / "served"
    with serving(lambda **_: vllm_backend, policy="static:64", results=results) as (base, rt):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        doc = httpx.post(
            f"{base}/v1/documents",
            json={"text": WORDS * 60, "max_tokens": 4},
            headers=AUTH,
        )
        assert doc.status_code == 202
        doc_id = doc.json()["id"]
        chunks = list(
            c.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": WORDS}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 12
        assert sum(bool(ch.choices and ch.choices[0].delta.content) for ch in chunks) >= 2
        state = wait_for_document(base, doc_id)
        assert state["status"] == "finished"
        assert state["prompt_tokens_read"] == state["prompt_tokens"] > 300
        # Asked about by id: vLLM's cached blocks of the document supply its prompt.
        answer = c.completions.create(
            model="tiny",
            prompt=" which garden?",
            max_tokens=4,
            extra_body={"document_id": doc_id, "ignore_eos": True},
        )
        assert answer.usage.prompt_tokens_details.cached_tokens >= 256
        assert answer.usage.prompt_tokens > answer.usage.prompt_tokens_details.cached_tokens
        metrics = httpx.get(f"{base}/metrics", headers=AUTH).text
        assert (
            'edgeprefill_requests_ended_total{cls="background",outcome="completed"} 1.0' in metrics
        )
        assert 'edgeprefill_requests_running{cls="foreground"} 0.0' in metrics
    summary = json.loads((results / "summary.json").read_text())
    assert summary["backend"]["name"] == "vllm"
    assert summary["accounting"]["reconciled"] and summary["completed"] == 3
    lines = (results / "requests.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["class"] for line in lines) == [
        "background",
        "foreground",
        "foreground",
    ]


def test_json_log_probabilities_and_a_stop_string_on_vllm(vllm_backend):
    """What assistants' clients ask beyond text, on vLLM: JSON fitting a schema and a tool
    call (vLLM's structured outputs), log-probabilities, and a stop string that ends a
    request as completed."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {
        "type": "object",
        "properties": {"pick": {"enum": ["river", "garden"]}},
        "required": ["pick"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    ask = {"model": "tiny", "messages": [{"role": "user", "content": WORDS}], "temperature": 0}
    with serving(lambda **_: vllm_backend) as (base, _):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
        reply = c.chat.completions.create(**ask, max_tokens=32, response_format=fmt)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert reply.choices[0].finish_reason == "stop"
        tool = {"type": "function", "function": {"name": "go", "parameters": schema}}
        called = c.chat.completions.create(
            **ask, max_tokens=400, tools=[tool], tool_choice="required", parallel_tool_calls=False
        ).choices[0]
        assert (
            called.finish_reason == "tool_calls"
            and called.message.tool_calls[0].function.name == "go"
        )
        jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), schema)
        scored = c.chat.completions.create(**ask, max_tokens=6, logprobs=True, top_logprobs=2)
        content = scored.choices[0].logprobs.content
        assert len(content) == scored.usage.completion_tokens == 6
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
        # Greedy: the token sampled is the likeliest.
        assert all(e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in content)
        full = c.completions.create(model="tiny", prompt=WORDS, max_tokens=12, temperature=0)
        text = full.choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = c.completions.create(
            model="tiny", prompt=WORDS, max_tokens=12, temperature=0, stop=[stop]
        )
        assert cut.choices[0].text == text[: text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        deadline = time.monotonic() + 30
        done = 'edgeprefill_requests_ended_total{cls="foreground",outcome="completed"} 5.0'
        while done not in (m := httpx.get(f"{base}/metrics", headers=AUTH).text):
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
        assert 'outcome="error"' not in m
