"""Workload files are validated strictly and errors point at the key in the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.traffic.arrivals import arrival_times
from edgeprefill.runtime.traffic.workload import BurstArrivals, PoissonArrivals, load_workload

DEFAULT = Path(__file__).parents[1] / "workloads" / "assistant_plus_indexer.yaml"


def times(spec, rng) -> list[float]:
    return [a.t_s for a in arrival_times(spec, rng)]


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "w.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


def base() -> dict:
    return yaml.safe_load(DEFAULT.read_text())


def test_default_workload_loads_with_both_classes():
    w = load_workload(DEFAULT)
    classes = {s.cls for s in w.streams.values()}
    assert classes == {"foreground", "background"}
    indexer = w.streams["indexer"]
    assert indexer.prompt.tokens.min >= 2000 and indexer.prompt.tokens.max <= 8000


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (
            lambda d: d["streams"]["assistant"]["arrivals"].update(rate_per_s=-1),
            "streams.assistant.arrivals.rate_per_s: Input should be greater than 0 (got -1)",
        ),
        (
            lambda d: d["streams"]["assistant"]["arrivals"].update(burstiness=2),
            "streams.assistant.arrivals.burstiness: unknown key; allowed keys here: "
            "process, rate_per_s, count, start_s",
        ),
        (
            lambda d: d["streams"]["indexer"].update(max_tokens=5),
            "streams.indexer.max_tokens: unknown key; allowed keys here: class, arrivals, prompt, "
            "output_tokens, ignore_eos, sampling",
        ),
        (
            lambda d: d["streams"]["indexer"]["arrivals"].update(count="four"),
            "streams.indexer.arrivals.count: Input should be a valid integer (got 'four')",
        ),
        (
            lambda d: d["streams"]["assistant"]["arrivals"].update(process="uniform"),
            "streams.assistant.arrivals.process: unknown process 'uniform'; allowed: 'poisson', 'gamma', 'burst'",
        ),
        (
            lambda d: d["streams"]["assistant"].update({"class": "middle"}),
            "streams.assistant.class: Input should be 'foreground' or 'background' (got 'middle')",
        ),
        (
            lambda d: d["streams"]["assistant"].update(output_tokens={"min": 90, "max": 10}),
            "streams.assistant.output_tokens: max (10) must be at least min (90)",
        ),
        (
            lambda d: d["streams"]["assistant"].pop("prompt"),
            "streams.assistant.prompt: required key is missing",
        ),
        (
            lambda d: d["streams"]["assistant"]["arrivals"].update(count=10**12),
            "streams.assistant: this stream would make about 1000000000000 requests; at most "
            "1,000,000 per stream are allowed",
        ),
        (
            lambda d: d.update(sed=1),
            "sed: unknown key; allowed keys here: name, description, seed, streams",
        ),
    ],
)
def test_bad_workloads_name_the_file_the_key_and_the_rule(tmp_path, mutate, expected):
    data = base()
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(UserError) as err:
        load_workload(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message


def test_yaml_syntax_and_missing_file_errors(tmp_path):
    with pytest.raises(UserError, match=r"line 3, column 1: not valid YAML"):
        load_workload(write(tmp_path, "name: x\nstreams: [a\n"))
    with pytest.raises(UserError, match="does not exist"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="a workload is a YAML mapping"):
        load_workload(write(tmp_path, "- 1\n- 2\n"))


def test_token_ranges_accept_a_bare_integer(tmp_path):
    data = base()
    data["streams"]["assistant"]["output_tokens"] = 32
    w = load_workload(write(tmp_path, data))
    assert (w.streams["assistant"].output_tokens.min, w.streams["assistant"].output_tokens.max) == (
        32,
        32,
    )


def test_ttft_targets_default_by_class_and_can_be_set_or_removed(tmp_path):
    from edgeprefill.backends.sim import SimTokenizer
    from edgeprefill.runtime.traffic.build import build_requests

    def targets(data) -> dict[str, set]:
        built = build_requests(load_workload(write(tmp_path, data)), SimTokenizer())
        return {
            c: {(r.ttft_target_s, r.ttft_slowdown) for r in built if r.cls == c}
            for c in ("foreground", "background")
        }

    # relative to the device by default: 3x a chat's prompt alone, no absolute target
    assert targets(base()) == {"foreground": {(None, 3.0)}, "background": {(None, None)}}
    data = base()
    data["streams"]["assistant"]["ttft_target_s"] = 0.5
    data["streams"]["indexer"]["ttft_target_s"] = 30
    assert targets(data) == {"foreground": {(0.5, 3.0)}, "background": {(30, None)}}
    data["streams"]["assistant"]["ttft_slowdown"] = None
    data["streams"]["indexer"]["ttft_slowdown"] = 5
    assert targets(data) == {"foreground": {(0.5, None)}, "background": {(30, 5)}}
    for key, bad in (("ttft_target_s", 0), ("ttft_slowdown", 1)):
        data["streams"]["assistant"][key] = bad
        with pytest.raises(UserError, match=key):
            load_workload(write(tmp_path, data))
        data["streams"]["assistant"][key] = None


def test_arrivals_are_seeded_and_shaped():
    p = PoissonArrivals(process="poisson", rate_per_s=2.0, count=2000, start_s=1.0)
    a = times(p, np.random.default_rng(1))
    assert a == times(p, np.random.default_rng(1))
    assert a[0] == 1.0 and a == sorted(a)
    assert np.mean(np.diff(a)) == pytest.approx(0.5, rel=0.1)
    b = BurstArrivals(process="burst", count=3, start_s=2.0, interval_s=0.5)
    assert times(b, np.random.default_rng(0)) == [2.0, 2.5, 3.0]


def test_phased_arrivals_follow_each_phase_rate():
    from edgeprefill.runtime.traffic.workload import PhasedArrivals

    spec = PhasedArrivals.model_validate(
        {
            "process": "phases",
            "start_s": 5.0,
            "phases": [
                {"duration_s": 1000, "rate_per_s": 0.2},
                {"duration_s": 1000, "rate_per_s": 4.0},
            ],
        }
    )
    a = times(spec, np.random.default_rng(3))
    assert a == sorted(a) and a[0] >= 5.0 and a[-1] < 2005.0
    first = sum(t < 1005.0 for t in a)
    second = len(a) - first
    assert first == pytest.approx(200, rel=0.2) and second == pytest.approx(4000, rel=0.1)


@pytest.mark.parametrize(
    "name", ["assistant_plus_indexer", "chat_only", "ppas_bursty", "indexer_folder"]
)
def test_expected_load_is_what_the_workload_builds(name):
    """The backend picks settings for a run from this estimate, made before the model
    loads: it must be close to what the run then does."""
    from edgeprefill.backends.sim import SimTokenizer
    from edgeprefill.runtime.traffic.build import build_requests
    from edgeprefill.runtime.traffic.expected import expected_load

    spec = load_workload(DEFAULT.parent / f"{name}.yaml")
    work = expected_load(spec)
    built = build_requests(spec, SimTokenizer())
    # A folder's files are estimated from their size: each may round to a piece more or less.
    files = sum(len(s.prompt.files) for s in spec.streams.values() if hasattr(s.prompt, "files"))
    assert abs(sum(s.count for s in work.shapes) - len(built)) <= 0.1 * len(built) + files
    # means of the ranges against a few draws; documents are estimated from their size
    assert work.prompt_tokens == pytest.approx(sum(r.prompt_len for r in built), rel=0.2)
    assert work.output_tokens == pytest.approx(sum(r.max_tokens for r in built), rel=0.1)


def test_questions_about_documents_start_with_the_indexers_exact_tokens(tmp_path):
    from edgeprefill.backends.sim import SimTokenizer
    from edgeprefill.runtime.traffic.build import build_requests

    w = load_workload(DEFAULT.parent / "assistant_asks_about_documents.yaml")
    built = build_requests(w, SimTokenizer())
    docs = [r for r in built if r.cls == "background"]
    questions = [r for r in built if r.cls == "foreground"]
    assert all(d.share_prefix and d.share_prefix < d.prompt_len for d in docs)
    for i, q in enumerate(sorted(questions, key=lambda r: int(r.id.split("-")[1]))):
        doc = docs[i % len(docs)]
        assert q.source == f"about {doc.id}" and q.share_prefix is None
        assert q.prompt[: doc.share_prefix] == doc.prompt[: doc.share_prefix]
        assert 20 <= q.prompt_len - doc.share_prefix - 2 <= 60 + 4  # the question, then the end
    # the documents are the default workload's, token for token
    default = build_requests(load_workload(DEFAULT), SimTokenizer())
    assert [d.prompt for d in docs] == [r.prompt for r in default if r.cls == "background"]


@pytest.mark.parametrize(
    "stream, expected",
    [("nope", "must name another stream"), ("assistant", "must name another stream")],
)
def test_a_question_stream_must_name_another_document_stream(tmp_path, stream, expected):
    data = base()
    data["streams"]["assistant"]["prompt"] = {"source": "about", "stream": stream, "question": 30}
    with pytest.raises(UserError, match=expected):
        load_workload(write(tmp_path, data))
