"""Bad requests to `edgeprefill serve`, over a real loopback socket: hand-written cases with
the status and error each must get, then hundreds generated from the server's own OpenAPI
schema (valid bodies and broken ones), under the default policy. No 5xx, every error an
OpenAI-style body, a normal request still answered after every case, and no sequence left
held."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_helpers import KEY, serving

pytestmark = pytest.mark.slow
pytest.importorskip("uvicorn")

CHAT = "/v1/chat/completions"
DONE = "/v1/completions"
DOCS = "/v1/documents"
HI = [{"role": "user", "content": "Hi"}]

# (method, path, body: JSON-able, or bytes sent as they are; status; the param named)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("POST", CHAT, b'{"messages": [', 400, None),  # malformed JSON
    ("POST", CHAT, b"", 400, None),
    ("POST", CHAT, [], 400, None),
    ("POST", CHAT, "hi", 400, None),
    ("POST", CHAT, {}, 400, "messages"),
    ("POST", CHAT, {"messages": []}, 400, "messages"),
    ("POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("POST", CHAT, {"messages": [{"content": "x"}]}, 400, "messages.0.role"),
    ("POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
        400,
        "messages.0.content.0",
    ),
    (
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 5]}]},
        400,
        None,
    ),
    ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("POST", CHAT, {"messages": HI * 5000}, 400, "messages"),
    (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "ttft_target_ms": 1e400}',
        400,
        "ttft_target_ms",
    ),
    (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "ttft_target_ms": Infinity}',
        400,
        "ttft_target_ms",
    ),
    ("POST", CHAT, {"messages": HI, "ttft_target_ms": 1e300}, 400, "ttft_target_ms"),
    (
        "POST",
        CHAT,
        b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}',
        400,
        "temperature",
    ),
    ("POST", CHAT, {"messages": HI, "priority": 10**30}, 400, "priority"),
    ("POST", CHAT, {"messages": HI, "seed": 2**64}, 400, "seed"),
    ("POST", CHAT, {"messages": HI, "stop": ["a"] * 17}, 400, "stop"),
    ("POST", CHAT, {"messages": HI, "stop": "x" * 300}, 400, "stop"),
    ("POST", CHAT, {"messages": HI, "n": 2}, 400, "n"),
    ("POST", CHAT, {"messages": HI, "temperature": -1}, 400, "temperature"),
    ("POST", CHAT, {"messages": HI, "temperature": 3}, 400, "temperature"),
    ("POST", CHAT, {"messages": HI, "top_p": 0}, 400, "top_p"),
    ("POST", CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p"),
    ("POST", CHAT, {"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ("POST", CHAT, {"messages": HI, "max_tokens": -5}, 400, "max_tokens"),
    ("POST", CHAT, {"messages": HI, "max_tokens": 10**9}, 400, "max_tokens"),
    ("POST", CHAT, {"messages": HI, "max_tokens": "ten"}, 400, "max_tokens"),
    ("POST", CHAT, {"messages": HI, "max_completion_tokens": 10**12}, 400, "max_completion_tokens"),
    ("POST", CHAT, {"messages": HI, "seed": -1}, 400, "seed"),
    ("POST", CHAT, {"messages": HI, "stream": "maybe"}, 400, "stream"),
    ("POST", CHAT, {"messages": HI, "stream_options": "x"}, 400, "stream_options"),
    ("POST", CHAT, {"messages": HI, "stop": 5}, 400, None),
    ("POST", CHAT, {"messages": HI, "priority": "high"}, 400, "priority"),
    ("POST", CHAT, {"messages": HI, "priority": 1.5}, 400, "priority"),
    ("POST", CHAT, {"messages": HI, "ttft_target_ms": 0}, 400, "ttft_target_ms"),
    ("POST", CHAT, {"messages": HI, "ttft_target_ms": -3}, 400, "ttft_target_ms"),
    ("POST", CHAT, {"messages": HI, "model": "gpt-4"}, 404, "model"),
    ("POST", CHAT, {"messages": HI, "document_id": "nope"}, 404, None),
    ("POST", DONE, {"prompt": ""}, 400, None),
    ("POST", DONE, {"prompt": []}, 400, None),
    ("POST", DONE, {"prompt": [-1]}, 400, "prompt.0"),
    ("POST", DONE, {"prompt": [10**9]}, 400, "prompt"),
    ("POST", DONE, {"prompt": [10**30]}, 400, "prompt.0"),
    ("POST", DONE, {"prompt": list(range(5000))}, 400, "prompt"),
    ("POST", DONE, {"prompt": {"a": 1}}, 400, "prompt"),
    ("POST", DONE, {"prompt": [1, 2], "document_id": "nope"}, 400, "prompt"),
    ("POST", DOCS, {}, 400, None),
    ("POST", DOCS, {"text": "a", "tokens": [1]}, 400, None),
    ("POST", DOCS, {"tokens": [-3]}, 400, "tokens.0"),
    ("POST", DOCS, {"text": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("POST", DOCS, {"text": "a", "colour": "red"}, 400, "colour"),
    ("POST", DOCS, {"text": "Snow on the pass. " * 1500}, 400, "text"),  # past the context
    ("POST", DOCS, {"tokens": [5] * 5000}, 400, "tokens"),
    ("GET", f"{DOCS}/nope", None, 404, None),
    ("DELETE", f"{DOCS}/nope", None, 404, None),
    ("GET", CHAT, None, 405, None),
    ("GET", "/v1/nothing", None, 404, None),
]


def send(h: httpx.Client, method: str, path: str, body: Any) -> httpx.Response:
    if body is None:
        return h.request(method, path)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return h.request(method, path, content=content, headers={"Content-Type": "application/json"})


def assert_openai_error(r: httpx.Response) -> None:
    error = r.json()["error"]
    assert error["message"] and error["type"] and {"param", "code"} <= error.keys(), r.text


def answers(h: httpx.Client) -> None:
    """A normal request is still answered: the engine lived through the last case."""
    ok = h.post(DONE, json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, ok.text


def settle(base: str, runtime: Any, h: httpx.Client) -> None:
    """The server still answers, and once its requests end no sequence is held."""
    assert httpx.get(f"{base}/health").status_code == 200
    deadline = time.monotonic() + 120
    scheduler = runtime.engine.scheduler
    while (scheduler.running or any(scheduler.waiting.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not scheduler.running and not any(scheduler.waiting.values())
    assert scheduler.kv_free == runtime.backend.capacity.n_ctx
    ok = h.post(DONE, json={"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


@pytest.fixture
def server(make_backend):
    with serving(make_backend, policy="cadence") as running:
        yield running


def client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_hand_written_bad_requests_get_the_right_status_and_an_openai_error(server):
    base, runtime = server
    h = client(base)
    assert len(CASES) >= 30
    for method, path, body, status, param in CASES:
        r = send(h, method, path, body)
        assert r.status_code == status, (method, path, body, r.status_code, r.text)
        assert_openai_error(r)
        if param is not None:
            assert r.json()["error"]["param"] == param, (body, r.text)
        answers(h)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{base}{CHAT}", json={"messages": HI}, headers=headers)
        assert r.status_code == 401
        assert_openai_error(r)
    settle(base, runtime, h)


# Text with lone surrogates too, numbers past 64 bits, and floats that JSON writes as
# Infinity and NaN (Python's parser reads them, and 1e400, as inf and nan).
TEXT = st.text(max_size=20) | st.text(st.sampled_from("a\ud800\udfffé<"), max_size=6)
NUMBERS = st.integers() | st.integers(2**63, 10**40) | st.floats()
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)


def _from_schema(
    schema: dict[str, Any], components: dict[str, Any], clean: bool
) -> st.SearchStrategy[Any]:
    """Values of an OpenAPI (JSON Schema) type as pydantic writes it: within its bounds
    (`clean`), or also past them and of any JSON type at all."""

    def of(sub: dict[str, Any]) -> st.SearchStrategy[Any]:
        return _from_schema(sub, components, clean)

    if "$ref" in schema:
        return of(components[schema["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in schema:
        return st.one_of([of(sub) for sub in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        fields = {k: of(v) for k, v in schema["properties"].items()}
        required = {k: fields.pop(k) for k in schema.get("required", [])}
        return st.fixed_dictionaries(required, optional=fields)
    if kind == "null":
        return st.none()
    if kind == "array":
        items = of(schema.get("items", {}))
        typed = st.lists(items, min_size=int(clean), max_size=6)
        if not clean:  # past a list's bound, or the context's, one list at a time: nested,
            # 5000 messages of 5000 tool calls each made 24 GB of client-side objects
            within = _from_schema(schema.get("items", {}), components, clean=True)
            typed |= within.map(lambda item: [item] * 5000)
    elif kind == "integer":
        lo = int(schema.get("minimum", 0))
        hi = int(schema.get("maximum", lo + 200))
        # unclean: token ids past the vocabulary, lengths past the context
        typed = st.integers(lo, hi) if clean else st.integers(-3, 300_000) | NUMBERS
    elif kind == "number":
        lo, hi = (
            schema.get("minimum", schema.get("exclusiveMinimum", 0)),
            schema.get("maximum", 1e4),
        )
        edge = "exclusiveMinimum" in schema
        typed = st.floats(lo, hi, exclude_min=edge) if clean else st.floats() | st.just(-1.0)
    else:
        typed = {
            "string": st.text(min_size=int(clean), max_size=30),
            "boolean": st.booleans(),
            "object": st.fixed_dictionaries(
                {"type": st.just("text"), "text": st.text(max_size=10)}
            ),
        }.get(kind, JSON_VALUES)
    return typed if clean else typed | JSON_VALUES


def _bodies(openapi: dict[str, Any], name: str) -> st.SearchStrategy[Any]:
    """Bodies of the route's schema within its bounds (answers kept to 2 tokens so that
    each case is quick), the same with values past them or of other types, anything JSON at
    all, and bytes that are not JSON."""
    schema = openapi["components"]["schemas"]
    clean = _from_schema(schema[name], schema, clean=True).map(_short)
    broken = _from_schema(schema[name], schema, clean=False).map(_short)
    return clean | broken | JSON_VALUES | st.binary(max_size=40)


def _short(body: dict[str, Any]) -> dict[str, Any]:
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > 2:
            body[key] = 2
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    if isinstance(body.get("text"), str):  # a document: keep it short
        body["text"] = body["text"][:200]
    return body


@pytest.mark.parametrize(
    "path,schema", [(CHAT, "ChatRequest"), (DONE, "CompletionRequest"), (DOCS, "DocumentRequest")]
)
def test_generated_requests_never_get_a_5xx_and_leak_nothing(server, path, schema):
    """170 cases per route, 510 in all."""
    base, runtime = server
    h = client(base)
    openapi = h.get("/openapi.json").json()  # the key is needed for it too
    seen: list[int] = []

    @settings(
        max_examples=170,
        deadline=None,
        database=None,
        derandomize=True,  # the same 170 cases each run: CI's verdict does not vary by draw
        suppress_health_check=list(HealthCheck),
    )
    @given(body=_bodies(openapi, schema))
    def case(body: Any) -> None:
        r = send(h, "POST", path, body)
        seen.append(r.status_code)
        assert r.status_code < 500, (body, r.status_code, r.text)
        if r.status_code >= 400:
            assert_openai_error(r)
        elif path == DOCS:  # background work: not left to pile up
            h.delete(f"{DOCS}/{r.json()['id']}")
        answers(h)

    case()
    assert len(seen) >= 170
    counts = Counter(s < 300 for s in seen)
    assert counts[True] >= 5 and counts[False] >= 50, Counter(seen)  # both kinds ran
    settle(base, runtime, h)
