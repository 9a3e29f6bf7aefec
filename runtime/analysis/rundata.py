"""Reading finished runs back: a run folder, or every run under a compare/sweep folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeprefill.runtime.core.errors import UserError


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class RunData:
    path: Path
    summary: dict[str, Any]
    requests: list[dict[str, Any]] = field(repr=False)
    iterations: list[dict[str, Any]] = field(repr=False)
    telemetry: list[dict[str, Any]] = field(repr=False)

    @property
    def policy(self) -> str:
        return self.summary["policy"].get("spec") or self.summary["policy"]["name"]

    @property
    def label(self) -> str:
        return f"{self.policy} seed {self.summary.get('seed')}"

    @property
    def title(self) -> str:
        s = self.summary
        sim = " (SIMULATED)" if s.get("simulated") else ""
        return (
            f"{s['backend']['name']}{sim} | {self.policy} | {s['workload']['name']} | "
            f"seed {s.get('seed')}"
        )


def load_run(path: Path) -> RunData:
    try:
        summary = json.loads((path / "summary.json").read_text())
        return RunData(
            path,
            summary,
            _jsonl(path / "requests.jsonl"),
            _jsonl(path / "iterations.jsonl"),
            _jsonl(path / "telemetry.jsonl"),
        )
    except FileNotFoundError:
        raise UserError(
            f"{path} is not a run folder (no summary.json): pass folders written by "
            "`edgeprefill run`, `compare` or `sweep`"
        ) from None
    except (json.JSONDecodeError, KeyError) as e:
        raise UserError(f"{path}: unreadable run results ({e})") from None


def find_runs(paths: list[Path]) -> tuple[list[RunData], list[dict[str, Any]]]:
    """The runs the paths name (a compare or sweep folder names all of its runs) and the
    comparison reports found there."""
    runs: list[RunData] = []
    reports: list[dict[str, Any]] = []
    for p in paths:
        if not p.is_dir():
            raise UserError(f"{p} is not a folder: pass run, compare or sweep folders")
        if (p / "summary.json").exists():
            runs.append(load_run(p))
            continue
        for name in ("comparison.json", "sweep.json"):
            if (p / name).exists():
                reports.append({"file": str(p / name), **json.loads((p / name).read_text())})
        found = sorted(s.parent for s in p.rglob("summary.json"))
        if not found:
            raise UserError(
                f"{p} holds no runs (no summary.json in it or below it): pass folders "
                "written by `edgeprefill run`, `compare` or `sweep`"
            )
        runs += [load_run(f) for f in found]
    return runs, reports
