"""`edgeprefill run` end to end on the real model, as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from edgeprefill.runtime.analysis.metrics import class_summary
from edgeprefill.runtime.core.costs.costmodel import CostModel

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "edgeprefill.runtime.cli.main"]
DEFAULT = Path(__file__).parents[1] / "workloads" / "assistant_plus_indexer.yaml"


def small_workload(tmp_path: Path, chats: int = 3, docs: int = 2, doc_tokens: int = 600) -> Path:
    data = {
        "name": "small",
        "seed": 7,
        "streams": {
            "chat": {
                "class": "foreground",
                "arrivals": {"process": "poisson", "rate_per_s": 2.0, "count": chats},
                "prompt": {
                    "source": "text",
                    "tokens": {"min": 40, "max": 80},
                    "system": "Be brief.",
                },
                "output_tokens": {"min": 6, "max": 10},
                "ignore_eos": True,
            },
            "docs": {
                "class": "background",
                "arrivals": {"process": "burst", "count": docs},
                "prompt": {"source": "text", "tokens": doc_tokens, "instruction": "Summarize."},
                "output_tokens": 4,
            },
        },
    }
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_results_that_agree_with_each_other(tmp_path):
    out = tmp_path / "out"
    res = run_cli(
        "run",
        small_workload(tmp_path),
        "--out",
        out,
        "--policy",
        "static:32",
        "--no-progress",
        "--n-ctx",
        "2048",
        "--thermal-aware",
        "--tdp-watts",
        "30",
    )
    assert res.returncode == 0, res.stderr
    assert "foreground" in res.stdout and "Mean ITL (ms):" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    batching, probe = summary["backend"]["batching"], summary["backend"]["probe"]
    assert f"Batching: {batching['mode']}" in res.stdout  # `run` defaults to auto
    assert batching["mode"] == ("exact" if batching["exact_cost"] < 0.03 else "fast")
    assert probe["source"] in ("measured", "cache") and Path(probe["path"]).exists()
    # settings were chosen for this workload's work, estimated before the model loaded
    assert summary["backend"]["expected_load"]["requests"] == 5
    assert "fastest for the run's expected" in batching["reason"]
    requests = read_jsonl(out / "requests.jsonl")
    iterations = read_jsonl(out / "iterations.jsonl")

    assert summary["completed"] == 5 and summary["failed"] == 0 and not summary["interrupted"]
    # chats carry the foreground's default TTFT target, 3x their prompt alone on this device,
    # documents none; each chat's first token counted against it
    att = summary["foreground"]["ttft_attainment"]["relative"]
    chats = [r for r in requests if r["class"] == "foreground"]
    assert (
        att["slowdowns"] == [3.0]
        and att["requests"] == 3
        and summary["background"]["ttft_attainment"] is None
        and all(0 < r["ttft_alone_s"] < 10 for r in chats)
    )
    in_time = sum(r["token_times_s"][0] - r["arrival_s"] <= 3 * r["ttft_alone_s"] for r in chats)
    assert att["met"] == in_time and f"{in_time:>10} / 3" in res.stdout
    assert summary["policy"] == {"name": "static", "params": {"tokens": 32}, "spec": "static:32"}
    assert summary["machine"]["cpu_model"] and summary["backend"]["name"] == "llamacpp"
    assert summary["backend"]["clock"] == "perf_counter"  # the same field on every backend
    acc = summary["accounting"]
    assert acc["reconciled"] and acc["submitted"] == len(requests) == 5
    for cls in ("foreground", "background"):
        recomputed = class_summary(
            [r for r in requests if r["class"] == cls], summary["duration_s"]
        )
        assert summary[cls] == recomputed
    assert summary["iterations"] == len(iterations)
    assert sum(it["n_prefill"] for it in iterations) == sum(r["prompt_tokens"] for r in requests)
    assert all(it["n_prefill"] <= 32 for it in iterations)
    for r in requests:
        assert len(r["token_times_s"]) == len(r["output_token_ids"]) >= 1
        assert r["token_times_s"] == sorted(r["token_times_s"])
        assert r["token_times_s"][0] >= r["arrival_s"]
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
    chats = [r for r in requests if r["class"] == "foreground"]
    assert all(6 <= len(r["output_token_ids"]) <= 10 for r in chats)

    # Telemetry beside the run: every sensor available with its source or unavailable with
    # its reason; energy never a silent 0.
    tel = summary["telemetry"]
    assert set(tel["sensors"]) == {"rapl", "cpu_temp", "cpu_freq", "cpu_load", "battery", "gpu"}
    for name, sensor in tel["sensors"].items():
        assert sensor["source"], name
        assert sensor["available"] or sensor["reason"], name
    samples = read_jsonl(out / "telemetry.jsonl")
    assert len(samples) == tel["samples"] >= 2
    assert 0 <= samples[0]["t_s"] and samples[-1]["t_s"] <= summary["duration_s"] + 1
    energy = summary["energy"]
    if not Path("/sys/class/powercap").exists():  # this machine: no RAPL, no battery
        assert "no RAPL package domains" in tel["sensors"]["rapl"]["reason"]
        assert energy["sources"]["cpu"] == "estimated:tdp=30W*cpu_load"  # as asked, labelled
    if not Path("/sys/class/power_supply/BAT0").exists():
        assert "no battery" in tel["sensors"]["battery"]["reason"]
    whole = energy["whole_run"]["j_per_output_token"]
    assert whole["all"] > 0 and whole["foreground"] > 0 and whole["background"] > 0
    assert energy["steady_state"]["joules_total"] < energy["whole_run"]["joules_total"]
    assert summary["thermal_aware"]["factor"] == 0.5
    assert all("thermal" in it["policy"] for it in iterations)  # the decision, per iteration
    if not tel["sensors"]["cpu_temp"]["available"] and not tel["sensors"]["battery"]["available"]:
        assert not any(it["policy"]["thermal"]["active"] for it in iterations)


def test_a_request_too_long_for_the_context_fails_and_the_run_goes_on(tmp_path):
    out = tmp_path / "out"
    res = run_cli(
        "run",
        small_workload(tmp_path, doc_tokens=1500),
        "--out",
        out,
        "--no-progress",
        "--n-ctx",
        "1024",
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    requests = read_jsonl(out / "requests.jsonl")
    failed = [r for r in requests if r["error"]]
    assert {r["class"] for r in failed} == {"background"} and len(failed) == 2
    assert "needs 1503 KV cells but a sequence holds 1024" in failed[0]["error"]
    assert summary["completed"] == 3 and summary["failed"] == 2
    assert summary["accounting"]["reconciled"]


def assert_clean_error(res: subprocess.CompletedProcess, *fragments: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("edgeprefill: error: ")
    assert "Traceback" not in res.stderr
    for f in fragments:
        assert f in lines[0]


def test_bad_inputs_give_one_line_and_exit_code_2(tmp_path):
    wl = small_workload(tmp_path)
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("this is not a model")
    bad_yaml = tmp_path / "bad.yaml"
    data = yaml.safe_load(DEFAULT.read_text())
    data["streams"]["assistant"]["arrivals"]["rate_per_s"] = -0.5
    bad_yaml.write_text(yaml.safe_dump(data))
    cases = [
        (["--model", tmp_path / "missing.gguf"], "model file", "does not exist"),
        (["--model", not_gguf], "is not a GGUF file"),
        (["--n-ubatch", "4096"], "--n-ubatch must be between 1 and --n-batch (2048)"),
        (["--policy", "static:0"], "tokens must be at least 1"),
        (["--policy", "fastest"], "unknown policy 'fastest'; choose one of"),
        (["--n-ctx", "100000"], "--n-ctx 100000 exceeds the model's trained context (32768)"),
        (["--max-background", "17"], "background sequences must be between 1 and n_seq_max (16)"),
        (["--backend", "tensorrt"], "Invalid value for '--backend'"),
        (
            ["--backend", "vllm", "--max-background", "2"],
            "--max-background does not apply to --backend vllm (vLLM admits requests",
        ),
        (["--n-batch", "abc"], "'abc' is not a valid integer"),
        (["--thermal-aware", "--thermal-factor", "0"], "thermal factor must be in (0, 1]"),
        (["--telemetry-period", "0"], "telemetry period must be positive"),
        (["--thermal-aware", "--no-telemetry"], "--thermal-aware needs telemetry"),
        (["--kv-cache-ram", "lots"], "'lots' is not a size: write it as 512MiB, 2GiB or bytes"),
        (
            ["--sim-noise", "measured"],
            "--sim-noise does not apply to --backend llamacpp (it is --backend sim's)",
        ),
    ]
    for extra, *fragments in cases:
        assert_clean_error(
            run_cli("run", wl, "--no-progress", "--out", tmp_path / "o", *extra), *fragments
        )
    assert_clean_error(
        run_cli("run", bad_yaml, "--no-progress", "--out", tmp_path / "o"),
        "streams.assistant.arrivals.rate_per_s: Input should be greater than 0",
    )
    assert_clean_error(run_cli("run", tmp_path / "nope.yaml"), "nope.yaml does not exist")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_keeps_finished_work_and_marks_the_run_interrupted(tmp_path, signum):
    out = tmp_path / "out"
    wl = small_workload(tmp_path, chats=30, docs=3, doc_tokens=3000)
    proc = subprocess.Popen(
        [*CLI, "run", str(wl), "--out", str(out), "--no-progress", "--policy", "static:64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    requests_file = out / "requests.jsonl"
    while time.monotonic() < deadline:
        if requests_file.exists() and len(requests_file.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr and "interrupted" in stderr
    summary = json.loads((out / "summary.json").read_text())
    requests = read_jsonl(requests_file)
    assert summary["interrupted"] is True
    assert summary["completed"] >= 2
    assert summary["accounting"]["reconciled"]
    interrupted = [r for r in requests if r["error"] == "interrupted"]
    assert interrupted, "work in flight should be reported as failed: interrupted"
    assert summary["completed"] + summary["failed"] == len(requests)
    assert summary["accounting"]["not_arrived"] + len(requests) == 33


def test_sigterm_during_compare_keeps_finished_runs_and_marks_the_stopped_one(
    tmp_path, kv_cache_folder
):
    out = tmp_path / "cmp"
    wl = small_workload(tmp_path, chats=30, docs=3, doc_tokens=3000)
    proc = subprocess.Popen(
        [
            *CLI,
            "compare",
            str(wl),
            "--policies",
            "static:64,unlimited",
            "--seeds",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first, second = out / "seed7" / "static_64", out / "seed7" / "unlimited"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:  # the first run done, the second under way
        if (second / "requests.jsonl").exists() and (second / "requests.jsonl").read_text():
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "interrupted during seed 7, unlimited" in stderr
    whole = json.loads((first / "summary.json").read_text())
    stopped = json.loads((second / "summary.json").read_text())
    assert not whole["interrupted"] and whole["completed"] == 33
    assert stopped["interrupted"] and stopped["accounting"]["reconciled"]
    report = json.loads((out / "comparison.json").read_text())
    assert report == {
        "interrupted": True,
        "stopped_during": "seed 7, unlimited",
        "finished_runs": [str(first)],
    }
    assert not list(kv_cache_folder.glob("*.tmp*"))  # no half-written saved prefix


def test_calibrate_a_real_run_then_simulate_and_compare_on_it(tmp_path):
    real = tmp_path / "real"
    assert (
        run_cli(
            "run",
            small_workload(tmp_path),
            "--out",
            real,
            "--policy",
            "static:32",
            "--no-progress",
            "--n-ctx",
            "2048",
        ).returncode
        == 0
    )
    res = run_cli("calibrate", real)
    assert res.returncode == 0, res.stderr
    assert "ms per prompt token" in res.stdout
    model = json.loads((real / "cost_model.json").read_text())
    assert (
        model["cost_model"]["n_samples"]
        == json.loads((real / "summary.json").read_text())["iterations"]
    )

    def simulate(out: Path, *noise: str) -> dict:
        workload = small_workload(tmp_path, chats=20, docs=6)
        cost_model = real / "cost_model.json"
        sim = ("--backend", "sim", "--cost-model", cost_model, *noise, "--policy", "cadence")
        res = run_cli("run", workload, *sim, "--out", out, "--no-progress")
        assert res.returncode == 0, res.stderr
        return json.loads((out / "summary.json").read_text())

    summary = simulate(tmp_path / "sim")
    assert summary["simulated"] is True and summary["backend"]["name"] == "sim"
    assert summary["completed"] == 26 and summary["accounting"]["reconciled"]

    # As noisy as the real run was: every simulated iteration is the model's prediction
    # plus one of the residuals the calibration measured.
    noisy = tmp_path / "noisy"
    assert simulate(noisy, "--sim-noise", "measured")["accounting"]["reconciled"]
    cost = CostModel.from_dict(model["cost_model"])
    measured = np.array(model["residuals_ms"])
    assert len(measured) == model["cost_model"]["n_samples"] and measured.std() > 0
    drawn = []
    for it in read_jsonl(noisy / "iterations.jsonl"):
        predicted = cost.predict(
            it["rows_decode"], it["rows_prefill"], it["n_chunks"], it["ctx_work"], it["n_sampled"]
        )
        # (no residual takes it below a tenth; a preempted one stopped at a chat's arrival)
        if it["duration_s"] > predicted / 10 + 1e-9 and not it.get("preempted"):
            drawn.append(it["duration_s"] * 1e3 - predicted * 1e3)
    nearest = np.array([np.abs(measured - d).min() for d in drawn])
    assert (nearest < 0.01).all() and len(set(np.round(drawn, 2))) > 5

    cmp = tmp_path / "cmp"
    res = run_cli(
        "compare",
        small_workload(tmp_path, chats=10, docs=3),
        "--backend",
        "sim",
        "--cost-model",
        real / "cost_model.json",
        "--policies",
        "static:32,ppas,dlfp,cadence",
        "--seeds",
        "3",
        "--out",
        cmp,
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert "SIMULATED" in res.stdout and "Against static:32" in res.stdout
    report = json.loads((cmp / "comparison.json").read_text())
    assert report["simulated"] and report["outputs_agree"] and report["reconciled"]
    assert report["seeds"] == [7, 8, 9]
    ratio = report["vs_baseline"]["static:32"]["cadence"]["fg P99 ITL ms"]
    assert ratio["n"] == 3 and len(ratio["change_ci95"]) == 2


def test_compare_on_the_real_model_checks_outputs_agree_across_policies(tmp_path):
    out = tmp_path / "cmp"
    res = run_cli(
        "compare",
        small_workload(tmp_path, chats=3, docs=1),
        "--policies",
        "static:16,unlimited",
        "--seeds",
        "2",
        "--out",
        out,
        "--no-progress",
        "--n-ctx",
        "2048",
    )
    assert res.returncode == 0, res.stderr
    assert "output tokens agree exactly across policies: yes" in res.stdout
    report = json.loads((out / "comparison.json").read_text())
    assert report["outputs_agree"] and report["reconciled"] and not report["simulated"]
    assert report["calibration"]["source"] == "probe"
    assert sorted(p.name for p in (out / "seed7").iterdir()) == ["static_16", "unlimited"]


def test_compare_with_a_decode_group_larger_than_measured_reports_agreement_not_exactness(
    tmp_path, make_backend
):
    measured = make_backend().settings.max_decode_group  # exact batching's largest group
    out = tmp_path / "cmp"
    res = run_cli(
        "compare",
        small_workload(tmp_path, chats=3, docs=1),
        "--policies",
        "static:16,unlimited",
        "--seeds",
        "1",
        "--out",
        out,
        "--no-progress",
        "--n-ctx",
        "2048",
        "--max-decode-group",
        measured + 1,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "comparison.json").read_text())
    assert not report["batching_exact"]
    assert "outputs are not expected to match across policies" in res.stdout
    assert "token agreement with static:16:" in res.stdout
    agreement = report["token_agreement"]
    assert agreement["requests_compared"] == 4 and 0 < agreement["tokens"] <= 1
    run = json.loads((out / "seed7" / "unlimited" / "summary.json").read_text())
    assert run["backend"]["batching"]["max_decode_group"] == measured + 1
    assert not run["backend"]["batching"]["exact"]
    assert f"decode groups of up to {measured + 1} exceed" in run["backend"]["batching"]["reason"]
