"""Arrival trace files: CSV or JSONL rows with a `timestamp_s`, replayed as arrivals.

Optional per-row `prompt_tokens` and `output_tokens` replace the stream's ranges, so a
production log of (time, input length, output length) replays as it happened.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

FIELDS = ("timestamp_s", "prompt_tokens", "output_tokens")
# Tokens of one prompt or answer at most: past any model's context (a trace asking for 10^12
# tokens made the prompt builder try to allocate terabytes).
MAX_TOKENS = 1 << 20


def read_text(path: Path, what: str) -> str:
    """A text file's contents, or a ValueError that says which file and why not."""
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} file {path}: {e}") from None


def read_trace(path: Path) -> list[dict[str, float]]:
    """Rows with `timestamp_s` relative to the first one, in file order (which must be
    ascending). Raises ValueError naming the file, the row and what is wrong."""
    text = read_text(path, "trace")
    if path.suffix == ".jsonl":
        raw = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {i}: not JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path} line {i}: expected an object with timestamp_s")
                raw.append((i, obj))
    elif path.suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None or "timestamp_s" not in reader.fieldnames:
            raise ValueError(f"{path}: the header must name a timestamp_s column")
        raw = [(i, row) for i, row in enumerate(reader, 2)]
    else:
        raise ValueError(f"trace file {path} must end in .csv or .jsonl")
    rows: list[dict[str, float]] = []
    for i, obj in raw:
        row: dict[str, float] = {}
        for key in FIELDS:
            value = obj.get(key)
            if (value is None or value == "") and key != "timestamp_s":
                continue
            try:
                number = float(value)  # type: ignore[arg-type]  # None: TypeError, reported
            except (TypeError, ValueError, OverflowError):  # an integer past any float
                raise ValueError(
                    f"{path} line {i}: {key} must be a number, got {value!r}"
                ) from None
            tokens = key != "timestamp_s"
            if not math.isfinite(number) or number < 0 or (tokens and number < 1):
                raise ValueError(f"{path} line {i}: {key} out of range: {value!r}")
            if tokens and number > MAX_TOKENS:
                raise ValueError(f"{path} line {i}: {key} {value!r} is over {MAX_TOKENS:,}")
            row[key] = number
        if rows and row["timestamp_s"] < rows[-1]["timestamp_s"]:
            raise ValueError(
                f"{path} line {i}: timestamp_s {row['timestamp_s']} is before the previous "
                f"row's {rows[-1]['timestamp_s']}; sort the trace by time"
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"trace file {path} has no rows")
    t0 = rows[0]["timestamp_s"]
    return [{**r, "timestamp_s": r["timestamp_s"] - t0} for r in rows]
