"""Paired statistics, output agreement, and comparisons on the simulated backend."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from edgeprefill.runtime.analysis.compare import outputs_agree, paired
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import DeviceProfile
from edgeprefill.runtime.runner.calibration import save_profile
from edgeprefill.runtime.runner.comparison import with_burst_rate
from edgeprefill.runtime.traffic.workload import load_workload

ROOT = Path(__file__).parents[1]
CLI = [sys.executable, "-m", "edgeprefill.runtime.cli.main"]


def test_paired_ratio_and_t_interval_by_hand():
    r = paired([90.0, 80.0, 120.0], [100.0, 100.0, 100.0])  # changes -10%, -20%, +20%
    assert r["geomean_ratio"] == pytest.approx(
        math.exp((math.log(0.9) + math.log(0.8) + math.log(1.2)) / 3)
    )
    assert r["change_mean"] == pytest.approx(-0.1 / 3)
    logs = [math.log(0.9), math.log(0.8), math.log(1.2)]
    mean = sum(logs) / 3
    sd = (sum((x - mean) ** 2 for x in logs) / 2) ** 0.5
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, df=2)
    assert r["change_ci95"] == pytest.approx([math.expm1(mean - half), math.expm1(mean + half)])
    assert paired([0.05, 0.04, 0.06], [1.0, 1.0, 1.0])["change_ci95"][0] > -1  # a ratio
    assert paired([1.0], [2.0])["change_ci95"] is None  # one pair: no interval


def test_output_disagreement_is_found():
    a = [{"id": "r0", "output_token_ids": [1, 2], "error": None}]
    b = [{"id": "r0", "output_token_ids": [1, 3], "error": None}]
    assert outputs_agree({"p": a, "q": a}) == (True, [])
    ok, problems = outputs_agree({"p": a, "q": b})
    assert not ok and problems == ["r0: q differs from p"]


def test_burst_rate_replaces_only_burst_phases():
    spec = load_workload(ROOT / "workloads" / "ppas_bursty.yaml")
    rates = [p.rate_per_s for p in with_burst_rate(spec, 3.0).streams["requests"].arrivals.phases]
    assert rates == [0.2, 3.0, 0.2, 3.0, 0.2]


@pytest.fixture
def cost_model(tmp_path) -> Path:
    path = tmp_path / "cm.json"
    cost = CostModel(0.02, 0.002, 0.003, 0.001)
    save_profile(DeviceProfile(cost, 0.024, 0.1, 2048, 8, "test"), path)
    return path


def _simulate(
    command: str, workload: Path, args: list[str], out: Path, timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """`edgeprefill COMMAND WORKLOAD --backend sim ARGS --out OUT`, its output captured."""
    cmd = [*CLI, command, str(workload), "--backend", "sim", *args, "--out", str(out)]
    return subprocess.run(
        [*cmd, "--no-progress"], capture_output=True, text=True, timeout=timeout_s
    )


def test_sweep_on_the_simulated_backend(tmp_path, cost_model):
    out = tmp_path / "sweep"
    workload = ROOT / "workloads" / "ppas_bursty.yaml"
    rates = ["--burst-rates", "0.5,2", "--policies", "unlimited,ppas,cadence"]
    res = _simulate("sweep", workload, ["--cost-model", str(cost_model), *rates], out, 120)
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "sweep.json").read_text())
    assert report["simulated"] and report["outputs_agree"] and report["reconciled"]
    assert list(report["per_rate"]) == ["0.5", "2"]
    n = [
        len((out / f"burst{r}" / "seed0" / "ppas" / "requests.jsonl").read_text().splitlines())
        for r in ("0.5", "2")
    ]
    assert n[1] > n[0]  # the faster burst really sends more requests
    by_rate = [report["per_rate"][r]["metrics"] for r in ("0.5", "2")]
    ratios = [m["cadence"]["fg P99 ITL ms"] / m["unlimited"]["fg P99 ITL ms"] for m in by_rate]
    expected = math.exp(sum(map(math.log, ratios)) / 2)
    got = report["geomean_ratio_over_rates"]["unlimited"]["cadence"]["fg P99 ITL ms"]
    assert got == pytest.approx(expected)


def test_compare_on_several_cost_models_reports_each_device(tmp_path, cost_model):
    """A slower device in the loop (issue 41): the same comparison on two cost models, the
    second a device three times slower, each in its own folder and report."""
    slow = tmp_path / "slow" / "cost_model.json"
    slow.parent.mkdir()
    save_profile(DeviceProfile(CostModel(0.06, 0.006, 0.009, 0.003), 0.07, 0.3, 2048, 8, "t"), slow)
    out = tmp_path / "cmp"
    workload = ROOT / "workloads" / "assistant_plus_indexer.yaml"
    models = ["--cost-model", str(cost_model), "--cost-model", str(slow)]
    policies = ["--policies", "static:64,cadence", "--seeds", "1"]
    res = _simulate("compare", workload, [*models, *policies], out, 300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("== cost model") == 2 and res.stdout.count("comparison: ") == 2
    reports = {d: json.loads((out / d / "comparison.json").read_text()) for d in ("cm", "slow")}
    assert all(r["outputs_agree"] and r["reconciled"] for r in reports.values())

    def makespan(folder: str) -> float:
        summary = json.loads((out / folder / "seed0" / "cadence" / "summary.json").read_text())
        return summary["background"]["makespan_s"]

    assert makespan("slow") > 1.5 * makespan("cm")  # each ran on its own device
    chats = ROOT / "workloads" / "chat_only.yaml"
    one = subprocess.run(
        [*CLI, "run", str(chats), "--backend", "sim", *models, "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert one.returncode == 2 and one.stderr.count("\n") == 1, one.stderr
    assert "only `compare` and `sweep` take several" in one.stderr


def test_bad_sweep_and_compare_options_fail_cleanly(tmp_path, cost_model):
    chat_only = tmp_path / "w.yaml"
    data = yaml.safe_load((ROOT / "workloads" / "assistant_plus_indexer.yaml").read_text())
    chat_only.write_text(yaml.safe_dump(data))
    cases = [
        (
            ["sweep", str(chat_only), "--backend", "sim", "--cost-model", str(cost_model)],
            "has no burst phase",
        ),
        (
            ["sweep", str(ROOT / "workloads" / "ppas_bursty.yaml"), "--burst-rates", "fast"],
            "--burst-rates must be numbers",
        ),
        (["compare", str(chat_only), "--policies", "static:64"], "two or more different policies"),
        (
            ["compare", str(chat_only), "--policies", "static:64,ppas", "--baselines", "dlfp"],
            "--baselines dlfp not among --policies",
        ),
        (["run", str(chat_only), "--backend", "sim"], "--backend sim needs --cost-model"),
        (
            ["run", str(chat_only), "--backend", "sim", "--cost-model", str(chat_only)],
            "is not a cost model written by `edgeprefill calibrate`",
        ),
    ]
    for args, fragment in cases:
        res = subprocess.run(
            [*CLI, *args, "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.count("\n") == 1 and fragment in res.stderr, res.stderr
