"""The README's and docs/' shell examples work as written: each `curl` example runs in
bash against a real `serve` (bundled model; its address put in for the README's, the key
from the environment as the README exports it) and answers as the page says; each
`edgeprefill` command names a command and only options it has, with values its choices and
the policy registry take; each `make` target exists."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import click
import pytest

from tests.server_helpers import KEY, serving

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```sh\n(.*?)```", re.S)
SERVER = "http://127.0.0.1:8080"


def _lines(page: Path) -> list[str]:
    """The page's shell commands, a backslash-continued command as one line."""
    lines = []
    for block in BLOCK.findall(page.read_text()):
        lines += [" ".join(line.split()) for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


COMMANDS = [(page.name, line) for page in PAGES for line in _lines(page)]
CURLS = [
    pytest.param(line, id=f"{name}-{i}")
    for i, (name, line) in enumerate(COMMANDS)
    if line.startswith("curl ")
]
EDGEPREFILL = re.compile(r"^(?:\.venv/bin/)?edgeprefill (\w+)(.*)$")


def test_the_pages_have_shell_examples_of_each_kind():
    assert len(CURLS) >= 2
    assert sum(bool(EDGEPREFILL.match(line)) for _, line in COMMANDS) >= 10
    assert any(line.startswith("make ") for _, line in COMMANDS)


@pytest.mark.parametrize(("page", "line"), [c for c in COMMANDS if EDGEPREFILL.match(c[1])])
def test_a_command_names_only_options_it_has(page, line):
    from edgeprefill.runtime.cli.main import cli
    from edgeprefill.runtime.policies import parse_policy

    name, rest = EDGEPREFILL.match(line).groups()  # type: ignore[union-attr]
    command = cli.commands.get(name)
    assert command is not None, f"{page}: no command {name!r} in {line!r}"
    params = {opt: p for p in command.params for opt in [*p.opts, *p.secondary_opts]}
    rest = rest.split(" # ")[0]
    for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
        assert opt in params, f"{page}: {name} has no option {opt} ({line!r})"
    for opt, value in re.findall(r"(--backend|--policy|--policies) ([\w:,|.=]+)", rest):
        choice = params[opt].type
        for one in re.split(r"[|,]" if opt != "--policy" else r"\|", value):
            if isinstance(choice, click.Choice):
                assert one in choice.choices, f"{page}: {opt} {one} is not a choice ({line!r})"
            else:
                parse_policy(one)  # a policy the registry builds, its parameters valid


def test_a_make_target_exists():
    makefile = (ROOT / "Makefile").read_text()
    for page, line in COMMANDS:
        for target in re.findall(r"^make ([\w-]+)", line):
            assert re.search(rf"^{target}:", makefile, re.M), f"{page}: no make target {target}"


@pytest.mark.slow
def test_the_curl_examples_answer_as_the_pages_say(make_backend):
    with serving(make_backend) as (base, _):
        for param in CURLS:
            line = param.values[0]
            done = subprocess.run(
                ["bash", "-c", line.replace(SERVER, base)],
                env={"EDGEPREFILL_API_KEY": KEY, "PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            _check_answer(line, done.stdout)


def _check_answer(line: str, out: str) -> None:
    """A streamed chat: server-sent chunks of text, then [DONE]; a document: its id, queued."""
    if '"stream": true' in line:
        events = [e.removeprefix("data: ") for e in out.split("\n\n") if e.strip()]
        assert events[-1] == "[DONE]"
        text = "".join(
            c["choices"][0]["delta"].get("content") or ""
            for c in map(json.loads, events[:-1])
            if c["choices"]
        )
        assert text.strip()
    else:
        body = json.loads(out)
        assert body["id"].startswith("doc-") and body["status"] == "queued", body
