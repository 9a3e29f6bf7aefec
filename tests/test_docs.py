"""docs/reference.md is current, and names exactly what exists: every command's options,
every request field, every metric (`make docs` rewrites it)."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from prometheus_client.metrics import MetricWrapperBase

pytest.importorskip("fastapi")

from edgeprefill.runtime.cli import reference  # noqa: E402
from edgeprefill.runtime.cli.main import cli  # noqa: E402
from edgeprefill.runtime.server.metrics import ServerMetrics  # noqa: E402
from edgeprefill.runtime.server.schema import (  # noqa: E402
    ChatRequest,
    CompletionRequest,
    DocumentRequest,
)

PAGE = (Path(__file__).parents[1] / "docs" / "reference.md").read_text()


def sections() -> dict[str, str]:
    """Heading -> the text under it, up to the next heading."""
    parts = re.split(r"^#{2,3} (.+)$", PAGE, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_the_reference_is_what_make_docs_writes_now():
    assert PAGE == reference.page(), "docs/reference.md is stale: run `make docs`"


def test_every_option_of_every_command_is_named_and_nothing_else():
    named = sections()
    ctx = click.Context(cli, info_name="edgeprefill")
    for name in cli.list_commands(ctx):
        command = cli.get_command(ctx, name)
        assert command is not None
        params = command.get_params(click.Context(command, info_name=name, parent=ctx))
        flags = {f for p in params for f in (*p.opts, *p.secondary_opts) if f[:2] == "--"}
        text = named[f"`edgeprefill {name}`"]
        assert set(re.findall(r"--[a-z0-9-]+", text)) >= flags, name
        mentioned = set(re.findall(r"^\| `(--[a-z0-9-]+)", text, flags=re.M))
        assert mentioned <= flags, f"{name}: {mentioned - flags} do not exist"


def test_every_request_field_is_named_and_nothing_else():
    named = sections()
    routes = {
        "`POST /v1/chat/completions`": ChatRequest,
        "`POST /v1/completions`": CompletionRequest,
        "`POST /v1/documents`": DocumentRequest,
    }
    for heading, model in routes.items():
        fields = set(re.findall(r"^\| `(\w+)` \|", named[heading], flags=re.M))
        assert fields == set(model.model_fields), heading


def test_every_metric_a_scrape_shows_is_named_and_nothing_else():
    metrics = ServerMetrics()
    for metric in vars(metrics).values():  # a labelled metric shows once it has a child
        if isinstance(metric, MetricWrapperBase) and metric._labelnames:
            metric.labels(*["x"] * len(metric._labelnames))
    lines = metrics.text().decode().splitlines()
    names = {line.split("{")[0].split(" ")[0] for line in lines if not line.startswith("#")}
    scraped = {
        re.sub(r"_(bucket|sum|count)$", "", name) for name in names if not name.endswith("_created")
    }
    table = sections()["Metrics (`GET /metrics`)"]
    assert set(re.findall(r"^\| `(edgeprefill_\w+)`", table, flags=re.M)) == scraped


ROOT = Path(__file__).parents[1]
USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
USER_PAGES.remove(ROOT / "docs" / "reference.md")


def user_pages() -> dict[Path, str]:
    """README.md and docs/*.md but the generated reference, whitespace made single spaces."""
    return {page: re.sub(r"\s+", " ", page.read_text()) for page in USER_PAGES}


def test_user_pages_name_no_issue_numbers():
    """A reader cannot see the project's issues: a page says what it means instead."""
    found = [
        (page.name, hit)
        for page, text in user_pages().items()
        for hit in re.findall(r"\bissues? #?\d+\S*", text, flags=re.I)
    ]
    assert not found


def test_user_pages_name_no_history_sections():
    """A history section's letter tells a reader nothing: a figure gives its date and machine."""
    patterns = (
        r"\b[Ss]ections? [A-Z]{1,2}\d?\b",  # "section AL", "sections H and L", "(section D3)"
        r"history(?:\.md)?\b[^.]{0,40}\bsections?\b",  # "history section C", "history.md, section"
        r"history\.md,? [A-Z]{1,2}\d?\b",  # "benchmarks/history.md D2"
    )
    found = [
        (page.name, hit)
        for page, text in user_pages().items()
        for pattern in patterns
        for hit in re.findall(pattern, text)
    ]
    assert not found


def test_every_file_a_user_page_names_exists():
    """A path or link that leads nowhere sends a reader looking for code that moved."""
    folders = ("runtime", "backends", "benchmarks", "tests", "workloads", "thermal", "docs")
    path = re.compile(
        rf"(?<![\w./-])(?:{'|'.join(folders)})/[\w./-]+\.(?:py|md|yaml|json|sh|jinja)\b"
    )
    files = {f.name for folder in folders for f in (ROOT / folder).rglob("*")}
    missing = []
    for page, text in user_pages().items():
        for named in path.findall(text):
            if not re.search(r"\b[A-Z]+\b", named) and not (ROOT / named).exists():  # not W.yaml
                missing.append((page.name, named))
        for name in re.findall(r"`(\w+\.(?:py|yaml))`", text):  # a module named alone: `state.py`
            if name not in files:
                missing.append((page.name, name))
        for target in re.findall(r"\]\(([^)\s#]+)[^)]*\)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append((page.name, target))
    assert not missing
