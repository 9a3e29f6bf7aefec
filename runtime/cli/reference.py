"""docs/reference.md, written from the code: every command's options (as `--help` gives
them), every request body's fields (the server's pydantic schema) and every metric /metrics
exposes (the server's registry). Hand-written tables drift; these cannot, and a test checks
the file is current.

    python -m edgeprefill.runtime.cli.reference > docs/reference.md      (make docs)
"""

from __future__ import annotations

import sys
from typing import Any

import click
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel

HEADER = """# Reference

Written by `make docs` (`python -m edgeprefill.runtime.cli.reference`) from the code;
regenerate it rather than edit it. How to use these is in the README and `docs/`.
"""


def cli_tables(group: click.Group) -> list[str]:
    """A table of options per command, in `--help`'s order."""
    ctx = click.Context(group, info_name="edgeprefill")
    lines = ["## Command line", ""]
    for name in sorted(group.list_commands(ctx)):
        command = group.get_command(ctx, name)
        assert command is not None
        sub = click.Context(command, info_name=name, parent=ctx)
        lines += [f"### `edgeprefill {name}`", "", _cell((command.help or "").split("\n\n")[0])]
        lines += ["", "| option or argument | what [default] |", "|---|---|"]
        for param in command.get_params(sub):
            record = param.get_help_record(sub)
            if record is not None:
                lines.append(f"| `{_cell(record[0])}` | {_cell(record[1])} |")
        lines.append("")
    return lines


def request_tables(models: dict[str, type[BaseModel]]) -> list[str]:
    """A table of fields per request body: type and bounds from the schema, then what the
    field's docstring says."""
    lines = ["## Request bodies", ""]
    for route, model in models.items():
        lines += [f"### {route}", "", "| field | type | default | what |", "|---|---|---|---|"]
        schema = model.model_json_schema()
        for name, prop in schema["properties"].items():
            default = "required" if name in schema.get("required", []) else prop.get("default")
            kind = _cell(_type(prop))
            what = _cell(prop.get("description", ""))
            lines.append(f"| `{name}` | {kind} | `{default}` | {what} |")
        lines.append("")
    return lines


def metric_table(metrics: list[MetricWrapperBase]) -> list[str]:
    """Every metric, named as a scrape shows it, with the labels it takes."""
    lines = ["## Metrics (`GET /metrics`)", "", "| metric | type | labels | what |"]
    lines.append("|---|---|---|---|")
    for family, labels in sorted(_described(metrics), key=lambda pair: pair[0].name):
        name = family.name + ("_total" if family.type == "counter" else "")
        what = _cell(family.documentation)
        lines.append(f"| `{name}` | {family.type} | {', '.join(labels) or '-'} | {what} |")
    return lines + [""]


def _described(metrics: list[MetricWrapperBase]) -> list[tuple[Any, tuple[str, ...]]]:
    """(family, label names) of each metric; a labelled one has no sample to read them
    from until it is used, so they come from the metric itself."""
    return [(next(iter(m.describe())), tuple(getattr(m, "_labelnames", ()))) for m in metrics]


def _type(prop: dict[str, Any]) -> str:
    """A JSON schema property's type with its bounds, as a reader wants them."""
    if "anyOf" in prop:
        return " or ".join(_type(p) for p in prop["anyOf"])
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    kind = prop.get("type", "any")
    if kind == "array":
        kind = f"array of {_type(prop.get('items', {}))}"
    if "enum" in prop:
        kind = " / ".join(f'"{v}"' for v in prop["enum"])
    bounds = [
        f"{word} {prop[key]}"
        for key, word in (
            ("minimum", ">="),
            ("exclusiveMinimum", ">"),
            ("maximum", "<="),
            ("minItems", "items >="),
            ("maxItems", "items <="),
            ("maxLength", "length <="),
        )
        if key in prop
    ]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def page() -> str:
    from edgeprefill.runtime.cli.main import cli
    from edgeprefill.runtime.server.metrics import ServerMetrics
    from edgeprefill.runtime.server.schema import ChatRequest, CompletionRequest, DocumentRequest

    models: dict[str, type[BaseModel]] = {
        "`POST /v1/chat/completions`": ChatRequest,
        "`POST /v1/completions`": CompletionRequest,
        "`POST /v1/documents`": DocumentRequest,
    }
    server = vars(ServerMetrics()).values()
    metrics = [m for m in server if isinstance(m, MetricWrapperBase)]
    lines = [HEADER, *cli_tables(cli), *request_tables(models), *metric_table(metrics)]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(page())
