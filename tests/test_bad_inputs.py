"""Generated bad input: whatever a user writes into a workload file, a trace or the command
line, `edgeprefill run` ends in one line on stderr and exit code 2, or runs (a tiny
simulated workload) and reconciles; never a traceback. The hand-written cases, with their
exact messages, stay in test_cli.py and test_workload.py."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from edgeprefill.runtime.cli.main import main
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.runner.calibration import save_profile

# A run small enough to simulate thousands of times: three short chats beside one document.
BASE: dict[str, Any] = {
    "name": "tiny",
    "seed": 3,
    "streams": {
        "chat": {
            "class": "foreground",
            "arrivals": {"process": "poisson", "rate_per_s": 4.0, "count": 3, "start_s": 0.1},
            "prompt": {"source": "text", "tokens": {"min": 12, "max": 30}, "system": "Brief."},
            "output_tokens": {"min": 2, "max": 4},
            "ignore_eos": True,
        },
        "docs": {
            "class": "background",
            "arrivals": {"process": "burst", "count": 1},
            "prompt": {"source": "text", "tokens": 60, "instruction": "Summarize."},
            "output_tokens": 3,
            "sampling": {"temperature": 0.7, "top_p": 0.9},
        },
    },
}
CASES = 2000  # over the three generators below, in CI, from a fixed seed
SETTINGS = settings(
    max_examples=CASES // 3 + 1,
    deadline=None,
    database=None,  # the same cases on every machine, not ones replayed from a local file
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sim")
    cost = CostModel(per_pass_s=0.012, per_sampled_s=0.002, per_prefill_s=0.0015, per_kctx_s=1e-5)
    save_profile(DeviceProfile(cost, 0.016, 0.1, 2048, 1, "test"), folder / "cost_model.json")
    return folder


class Hung(Exception):
    """A case that neither failed nor finished in time (a loop that never ends)."""


def _hung(signum: int, frame: Any) -> None:
    raise Hung("no result within 60 s")


def run_cli(args: list[str]) -> tuple[int, str, str]:
    """`edgeprefill ARGS` in this process (a subprocess per case would take an hour)."""
    out, err = io.StringIO(), io.StringIO()
    argv = sys.argv
    sys.argv = ["edgeprefill", *args]
    code: Any = 0
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(60)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.argv = argv
    return code or 0, out.getvalue(), err.getvalue()


def check(args: list[str], sim: Path, out: Path) -> None:
    code, stdout, stderr = run_cli(
        [
            "run",
            *args,
            "--backend",
            "sim",
            "--cost-model",
            str(sim / "cost_model.json"),
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert "Traceback" not in stderr + stdout, stderr
    event("ran" if code == 0 else "refused")
    if code == 0:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["accounting"]["reconciled"], summary["accounting"]
        return
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("edgeprefill: error: "), (
        code,
        stderr,
    )


# --- values a user gets wrong -------------------------------------------------------------
huge = st.sampled_from([10**7, 10**12, 2**63, 10**400, 1e308])
bad_numbers = st.one_of(
    st.integers(-(10**6), 0),
    huge,
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-300]),
    st.floats(allow_nan=True, allow_infinity=True),
)
wrong_types = st.one_of(
    st.none(),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(-3, 3), max_size=2),
)
unknown_names = st.sampled_from(
    ["Foreground", "gpu", "poisson2", "pdf", "", "streams", "ttft", "count ", "κλάση"]
)
values = st.one_of(bad_numbers, wrong_types, unknown_names, st.integers(1, 50))


def paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a workload (mappings only)."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            found += paths(v, (*prefix, k))
    return found


PATHS = paths(BASE)


@st.composite
def mutated_workloads(draw: st.DrawFn) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent = data
        for key in path[:-1]:
            if not isinstance(parent, dict) or key not in parent:
                break
            parent = parent[key]
        else:
            if not isinstance(parent, dict):
                continue
            op = draw(st.sampled_from(["delete", "set", "add"]))
            if op == "delete":
                parent.pop(path[-1], None)
            elif op == "set":
                parent[path[-1]] = draw(values)
            else:
                parent[draw(unknown_names)] = draw(values)
    return data


def dump(data: Any) -> str:
    """YAML as a user would write it; NaN and infinities as YAML spells them."""
    return yaml.safe_dump(data, allow_unicode=True, sort_keys=False)


@SETTINGS
@seed(25)
@given(data=mutated_workloads())
def test_generated_workload_files(sim, tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("wl")
    path = folder / "w.yaml"
    try:
        path.write_text(dump(data))
    except (OverflowError, ValueError):  # not representable as YAML: nothing to test
        return
    check([str(path)], sim, folder / "out")


broken_files = st.one_of(
    st.just(b""),
    st.binary(max_size=64),
    st.text(max_size=80).map(str.encode),
    st.integers(1, len(dump(BASE)) - 1).map(lambda n: dump(BASE)[:n].encode()),  # cut short
    st.sampled_from(
        [b"streams: [", b"name: x\nstreams: {a: 1", b"- 1\n- 2\n", b"\t:\n", b"\xff\xfe"]
    ),
)


@st.composite
def traces(draw: st.DrawFn) -> tuple[str, bytes]:
    times = draw(
        st.lists(
            st.one_of(
                st.floats(-5, 50, allow_nan=False),
                st.sampled_from([math.nan, math.inf, -1.0, 0.0, 0.0]),
                st.text(max_size=4),
                st.none(),
            ),
            max_size=6,
        )
    )
    if draw(st.booleans()):
        rows = [json.dumps({"timestamp_s": t, "prompt_tokens": draw(values)}) for t in times]
        return "jsonl", "\n".join(rows).encode()
    return "csv", ("timestamp_s\n" + "\n".join(map(str, times))).encode()


@SETTINGS
@seed(26)
@given(content=st.one_of(broken_files.map(lambda b: ("yaml", b)), traces()))
def test_generated_broken_files_and_traces(sim, tmp_path_factory, content):
    folder = tmp_path_factory.mktemp("files")
    kind, raw = content
    path = folder / "w.yaml"
    if kind == "yaml":
        path.write_bytes(raw)
    else:
        (folder / f"t.{kind}").write_bytes(raw)
        data = copy.deepcopy(BASE)
        data["streams"]["chat"]["arrivals"] = {"process": "trace", "path": f"t.{kind}"}
        path.write_text(dump(data))
    check([str(path)], sim, folder / "out")


FLAGS = [
    "--policy",
    "--seed",
    "--n-ctx",
    "--n-batch",
    "--n-seq-max",
    "--n-ubatch",
    "--threads",
    "--max-background",
    "--telemetry-period",
    "--thermal-factor",
    "--kv-cache-ram",
    "--kv-cache-disk",
    "--batching",
    "--sim-noise",
    "--calibration",
    "--model",
]
flag_values = st.one_of(
    st.integers(-5, 5).map(str),
    huge.map(str),
    st.sampled_from(["nan", "inf", "-1", "0", "", "abc", "1e9", "2GiB", "-3MiB", "static:0"]),
    st.sampled_from(["cadence:itl_ms=-4", "ppas:nth=x", "dlfp:target_ms=nan", "cadence:share=2"]),
    st.sampled_from(["unlimited", "static:16", "fast", "exact", "measured"]),
)
cli_args = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(FLAGS), flag_values).map(list),
        st.sampled_from([["--frobnicate"], ["-x"], ["--thermal-aware"], ["--no-telemetry"]]),
    ),
    max_size=3,
).map(lambda groups: [a for g in groups for a in g])


@SETTINGS
@seed(27)
@given(args=cli_args)
def test_generated_command_lines(sim, tmp_path_factory, args):
    folder = tmp_path_factory.mktemp("cli")
    path = folder / "w.yaml"
    path.write_text(dump(BASE))
    check([str(path), *args], sim, folder / "out")


@pytest.mark.parametrize(
    "spec", ["cadence:readable_ms=nan", "cadence:itl_ms=inf", "cadence:share=-inf", "dlfp:nan"]
)
def test_a_policy_parameter_that_is_not_a_finite_number_is_refused_in_one_line(sim, tmp_path, spec):
    """A NaN or infinite policy parameter reached the policy's arithmetic (a traceback:
    "cannot convert float NaN to integer"); it is refused where the spec is read."""
    path = tmp_path / "w.yaml"
    path.write_text(dump(BASE))
    cost_model = ["--backend", "sim", "--cost-model", str(sim / "cost_model.json")]
    args = ["run", str(path), *cost_model, "--policy", spec, "--out", str(tmp_path / "out")]
    code, _, stderr = run_cli([*args, "--no-progress"])
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "must be a finite number" in stderr and "Traceback" not in stderr
