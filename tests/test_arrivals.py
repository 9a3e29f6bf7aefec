"""Arrival processes, trace replay, closed-loop users and document prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgeprefill.backends.sim import SimBackend, SimTokenizer
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.replay.loop import run_requests
from edgeprefill.runtime.results.writer import RunWriter
from edgeprefill.runtime.traffic.arrivals import arrival_times
from edgeprefill.runtime.traffic.build import build_requests, format_trace
from edgeprefill.runtime.traffic.workload import GammaArrivals, load_workload
from tests.test_policies import CAP, COST


def workload(tmp_path: Path, streams: dict, name: str = "w.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump({"name": "t", "seed": 3, "streams": streams}))
    return p


def stream(arrivals: dict, prompt: dict | None = None, cls: str = "foreground") -> dict:
    return {
        "class": cls,
        "arrivals": arrivals,
        "prompt": prompt or {"source": "synthetic", "tokens": 40},
        "output_tokens": {"min": 4, "max": 8},
        "ignore_eos": True,
    }


def test_gamma_burstiness_keeps_the_rate_and_changes_the_spread():
    gaps = {}
    for shape in (0.25, 1.0, 4.0):
        spec = GammaArrivals(process="gamma", rate_per_s=2.0, burstiness=shape, count=4000)
        t = np.array([a.t_s for a in arrival_times(spec, np.random.default_rng(0))])
        gaps[shape] = np.diff(t)
        assert gaps[shape].mean() == pytest.approx(0.5, rel=0.1)
    cv = {k: g.std() / g.mean() for k, g in gaps.items()}
    assert cv[1.0] == pytest.approx(1.0, rel=0.1)  # Poisson
    assert cv[0.25] > 1.7 > cv[1.0] > 0.6 > cv[4.0]  # cv = 1/sqrt(shape)


def test_trace_replay_from_csv_and_jsonl(tmp_path):
    (tmp_path / "t.csv").write_text(
        "timestamp_s,prompt_tokens,output_tokens\n100.0,30,5\n100.5,,\n102.0,60,7\n"
    )
    (tmp_path / "t.jsonl").write_text('{"timestamp_s": 7}\n{"timestamp_s": 7.25}\n')
    wl = load_workload(
        workload(
            tmp_path,
            {
                "csv": stream({"process": "trace", "path": "t.csv", "start_s": 1.0}),
                "jsonl": stream({"process": "trace", "path": "t.jsonl"}),
            },
        )
    )
    reqs = {r.id: r for r in build_requests(wl, SimTokenizer())}
    assert [reqs[f"csv-{i}"].arrival_s for i in range(3)] == [1.0, 1.5, 3.0]
    assert (reqs["csv-0"].prompt_len, reqs["csv-0"].max_tokens) == (30, 5)
    assert (reqs["csv-2"].prompt_len, reqs["csv-2"].max_tokens) == (60, 7)
    assert reqs["csv-1"].prompt_len == 40  # the stream's range where the row is empty
    assert [reqs["jsonl-0"].arrival_s, reqs["jsonl-1"].arrival_s] == [0.0, 0.25]


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("missing.csv", None, "trace file .*missing.csv does not exist"),
        ("t.csv", "time,x\n1,2\n", "the header must name a timestamp_s column"),
        ("t.csv", "timestamp_s\n1\nsoon\n", "line 3: timestamp_s must be a number, got 'soon'"),
        ("t.csv", "timestamp_s\n5\n4\n", "line 3: timestamp_s 4.0 is before the previous"),
        ("t.jsonl", '{"timestamp_s": 1}\n[2]\n', "line 2: expected an object"),
        ("t.txt", "1\n", "must end in .csv or .jsonl"),
    ],
)
def test_a_bad_trace_file_is_a_clear_error(tmp_path, name, content, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    path = workload(tmp_path, {"s": stream({"process": "trace", "path": name})})
    with pytest.raises(UserError, match=f"w.yaml: streams.s.arrivals: .*{message}"):
        load_workload(path)


def test_closed_loop_users_send_the_next_turn_after_the_answer_and_a_think_time(tmp_path):
    wl = load_workload(
        workload(
            tmp_path,
            {
                "users": stream(
                    {
                        "process": "closed_loop",
                        "users": 3,
                        "turns": 4,
                        "think_s": 2.0,
                        "stagger_s": 0.5,
                    }
                )
            },
        )
    )
    reqs = build_requests(wl, SimTokenizer())
    firsts = sorted(r.arrival_s for r in reqs if r.after is None)
    assert firsts == [0.0, 0.5, 1.0] and len(reqs) == 12
    engine = Engine(SimBackend(COST, CAP), parse_policy("static:64"))
    with RunWriter(tmp_path / "out") as writer:
        outcome = run_requests(engine, reqs, writer)
    assert outcome.not_arrived == 0 and not outcome.interrupted
    by_id = {r.id: r for r in reqs}
    for r in reqs:
        assert r.error is None and len(r.output) == r.max_tokens
        if r.after is not None:
            prev = by_id[r.after]
            # arrives its think time after the previous answer's last token, not before
            assert r.arrival_s == pytest.approx(prev.token_times_s[-1] + r.think_s, abs=0.2)
            assert r.token_times_s[0] > prev.token_times_s[-1]
    assert len(writer.records) == 12


def test_a_conversation_turn_resends_the_turn_before_it_on_the_simulator(tmp_path):
    arrivals = {"process": "closed_loop", "users": 2, "turns": 3, "think_s": 0.5}
    text = {"source": "text", "tokens": {"min": 30, "max": 40}, "system": "Be brief."}
    wl = load_workload(workload(tmp_path, {"u": stream({**arrivals, "conversation": True}, text)}))
    reqs = build_requests(wl, SimTokenizer())
    new_parts = {r.id: list(r.prompt) for r in reqs}
    engine = Engine(SimBackend(COST, CAP), parse_policy("static:64"))
    with RunWriter(tmp_path / "out") as writer:
        run_requests(engine, reqs, writer)
    by_id = {r.id: r for r in reqs}
    for r in reqs:
        assert r.error is None
        if r.after is None:
            assert not r.continues
            continue
        prev = by_id[r.after]
        assert r.continues and r.prompt == prev.prompt + prev.output + new_parts[r.id]
    with pytest.raises(UserError, match="arrivals.conversation needs a text prompt"):
        load_workload(workload(tmp_path, {"u": stream({**arrivals, "conversation": True})}))


def doc_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    paragraphs = [
        " ".join(f"word{i}x{j}" for j in range(60)) for i in range(30)
    ]  # 30 paragraphs of 60 words
    (folder / "a_long.md").write_text("# Title\n\n" + "\n\n".join(paragraphs))
    (folder / "b_short.txt").write_text("A short note.\n\nWith two paragraphs.")
    (folder / "ignored.pdf").write_text("not read")
    return folder


def test_documents_are_split_never_truncated(tmp_path):
    doc_folder(tmp_path)
    prompt = {"source": "documents", "folder": "docs", "chunk_tokens": 300, "instruction": "Tags?"}
    wl = load_workload(
        workload(tmp_path, {"idx": stream({"process": "burst"}, prompt, cls="background")})
    )
    tok = SimTokenizer()
    reqs = build_requests(wl, tok)
    sources = [r.source for r in reqs]
    assert sources[-1] == "b_short.txt 1/1" and all(s.startswith("a_long.md") for s in sources[:-1])
    assert len(reqs) == 9  # a title and 30 paragraphs of 60 tokens, four to a piece; the note
    assert all(r.prompt_len <= 300 for r in reqs)
    # every word of the long document is in exactly one piece, in order
    text = (tmp_path / "docs" / "a_long.md").read_text()
    body = [t for r in reqs[:-1] for t in r.prompt]
    words = tok.encode(text, add_bos=False, special=False)
    frame = (
        len(tok.encode("User: ", add_bos=True, special=True))
        + len(tok.encode("\n\nTags?", add_bos=False, special=False))
        + len(tok.encode("\nAssistant:", add_bos=False, special=True))
    )
    assert len(body) == len(words) + frame * (len(reqs) - 1)
    order = [t for t in body if t in set(words)]
    assert order == words


@pytest.mark.parametrize(
    "folder,make,message",
    [
        ("nowhere", False, "document folder .*nowhere does not exist"),
        ("empty", True, "no files matching \\*.txt, \\*.md in .*empty"),
    ],
)
def test_a_missing_or_empty_document_folder_is_a_clear_error(tmp_path, folder, make, message):
    if make:
        (tmp_path / folder).mkdir()
    prompt = {"source": "documents", "folder": folder, "chunk_tokens": 300}
    path = workload(tmp_path, {"idx": stream({"process": "burst"}, prompt)})
    with pytest.raises(UserError, match=f"streams.idx.prompt: {message}"):
        load_workload(path)


def test_documents_take_their_count_from_the_pieces(tmp_path):
    doc_folder(tmp_path)
    prompt = {"source": "documents", "folder": "docs", "chunk_tokens": 300}
    path = workload(tmp_path, {"idx": stream({"process": "burst", "count": 3}, prompt)})
    with pytest.raises(UserError, match="arrivals.count must be left out with a documents"):
        load_workload(path)


def test_the_same_seed_gives_byte_identical_traces(tmp_path):
    (tmp_path / "t.csv").write_text("timestamp_s\n0\n1.5\n")
    streams = {
        "chat": stream(
            {"process": "gamma", "rate_per_s": 1.0, "burstiness": 0.5, "count": 6},
            {"source": "text", "tokens": {"min": 40, "max": 90}, "system": "Be brief."},
        ),
        "users": stream({"process": "closed_loop", "users": 2, "turns": 3, "think_s": 1.0}),
        "replay": stream({"process": "trace", "path": "t.csv"}),
        "docs": stream(
            {"process": "poisson", "rate_per_s": 0.5, "count": 3},
            {"source": "synthetic", "tokens": {"min": 100, "max": 900}},
            cls="background",
        ),
    }
    wl = load_workload(workload(tmp_path, streams))
    a = format_trace(build_requests(wl, SimTokenizer()))
    assert a == format_trace(
        build_requests(load_workload(workload(tmp_path, streams)), SimTokenizer())
    )
    assert a != format_trace(build_requests(wl, SimTokenizer(), seed=4))
    assert len(a.splitlines()) == 6 + 6 + 2 + 3
    assert json.loads(a.splitlines()[0])["arrival_s"] == 0.0


def test_bundled_workloads_load_and_the_references_match_the_default():
    root = Path(__file__).parents[1] / "workloads"
    built = {p.stem: build_requests(load_workload(p), SimTokenizer()) for p in root.glob("*.yaml")}
    assert {"assistant_plus_indexer", "chat_only", "indexer_only", "ppas_bursty"} <= set(built)
    assert {"dlfp_agent", "many_users_sim", "indexer_folder"} <= set(built)

    def same(a, b):
        return [(r.id, r.arrival_s, r.prompt, r.max_tokens) for r in a] == [
            (r.id, r.arrival_s, r.prompt, r.max_tokens) for r in b
        ]

    default = built["assistant_plus_indexer"]
    assert same(built["chat_only"], [r for r in default if r.cls == "foreground"])
    assert same(built["indexer_only"], [r for r in default if r.cls == "background"])


def test_a_streams_json_schema_is_its_requests_output_format_and_needs_its_end(tmp_path):
    root = Path(__file__).parents[1] / "workloads"
    built = build_requests(load_workload(root / "json_chats_plus_indexer.yaml"), SimTokenizer())
    chats = [r.sampling.output_format for r in built if r.cls == "foreground"]
    assert chats and all(f is not None for f in chats)
    assert json.loads(chats[0].schema)["required"] == ["title", "tags", "answer"]
    assert all(r.sampling.output_format is None for r in built if r.cls == "background")
    s = stream({"process": "burst", "count": 2})
    s["sampling"] = {"json_schema": {"type": "object"}}  # with ignore_eos: never ends
    with pytest.raises(UserError, match="json_schema with ignore_eos"):
        load_workload(workload(tmp_path, {"s": s}))
