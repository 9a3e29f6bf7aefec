"""The layers import one way: core <- policies <- analysis <- results <- replay <- runner
<- cli; backends import only the core. Policies must load inside vLLM's engine-core process with the core alone."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
HEAVY = ["llama_cpp", "pydantic", "yaml", "matplotlib", "click", "rich", "platformdirs"]


def loaded_by(statement: str) -> set[str]:
    """Modules a fresh interpreter holds after running `statement`."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def under(modules: set[str], prefixes: list[str]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_policies_load_with_the_core_alone():
    mods = loaded_by("import edgeprefill.runtime.policies")
    assert "edgeprefill.runtime.policies.cadence" in mods  # really loaded
    forbidden = [
        "edgeprefill.backends",
        "edgeprefill.thermal",
        "edgeprefill.runtime.traffic",
        "edgeprefill.runtime.runner",
        "edgeprefill.runtime.analysis",
        "edgeprefill.runtime.cli",
        "edgeprefill.runtime.api",
        *HEAVY,
    ]
    assert under(mods, forbidden) == []


def test_the_core_loads_no_backend_and_nothing_above_it():
    mods = loaded_by("import edgeprefill.runtime.core.engine")
    assert "edgeprefill.runtime.core.scheduler" in mods
    assert under(mods, ["edgeprefill.backends", "edgeprefill.thermal", *HEAVY]) == []
    above = [m for m in under(mods, ["edgeprefill.runtime"]) if m != "edgeprefill.runtime"]
    assert all(m.startswith("edgeprefill.runtime.core") for m in above), above


# What each layer may import from edgeprefill (at module level or inside a function).
ALLOWED = {
    "runtime/core": ["runtime.core"],
    "runtime/policies": ["runtime.core", "runtime.policies"],
    "runtime/traffic": ["runtime.core", "runtime.traffic"],
    "backends": ["runtime.core", "backends"],
    # vLLM builds the policy inside its own scheduler, possibly in its engine-core process.
    "backends/vllm": ["runtime.core", "runtime.policies", "backends"],
    "thermal": ["thermal"],
    "runtime/analysis": ["runtime.core", "runtime.analysis"],
    # The result files: what a run computed, summarised as the analysis reads them, with
    # the machine and energy beside.
    "runtime/results": ["runtime.core", "runtime.analysis", "runtime.results", "thermal"],
    # The replay loop records as it goes and shows its progress.
    "runtime/replay": ["runtime.core", "runtime.results", "runtime.replay"],
    # The embedding API gets its driver, writes results, measures the device and takes
    # stop signals as `run` does.
    "runtime/api": [
        "runtime.core",
        "runtime.policies",
        "runtime.runner.drivers",
        "runtime.runner.calibration",
        "runtime.results",
        "runtime.replay.signals",
        "runtime.api",
    ],
    # The server samples the sensors as `run` does, for energy per token, and takes Ctrl-C
    # and SIGTERM as `run` and the embedding API do.
    "runtime/server": [
        "runtime.core",
        "runtime.policies",
        "runtime.api",
        "runtime.replay.signals",
        "runtime.server",
        "thermal",
    ],
    # The composition root puts a run together from every layer below the command line.
    "runtime/runner": [
        "runtime.core",
        "runtime.policies",
        "runtime.traffic",
        "runtime.runner",
        "runtime.replay",
        "runtime.results",
        "runtime.analysis",
        "backends",
        "thermal",
    ],
}


def edgeprefill_imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n.removeprefix("edgeprefill.") for n in names if n.startswith("edgeprefill.")]


def test_every_import_points_down_the_layers():
    wrong = []
    for folder, allowed in ALLOWED.items():
        inner = [f for f in ALLOWED if f != folder and f.startswith(folder + "/")]
        for path in sorted((ROOT / folder).rglob("*.py")):
            if any(path.is_relative_to(ROOT / f) for f in inner):
                continue  # a sub-layer with rules of its own
            for name in edgeprefill_imports(path):
                if not any(name == a or name.startswith(a + ".") for a in allowed):
                    wrong.append(f"{path.relative_to(ROOT)} imports edgeprefill.{name}")
    assert wrong == []


def test_no_import_cycles():
    """Module-level imports between edgeprefill's modules form no cycle."""
    modules = {}
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] not in ("runtime", "backends", "thermal"):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module level only: imports inside functions are lazy
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgeprefill."):
                deps.add(node.module.removeprefix("edgeprefill."))
        modules[name] = deps
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in modules.get(m, ()):
            if d not in modules:
                continue
            if state.get(d) == 1:
                return [*path, m, d]
            if d not in state:
                found = visit(d, [*path, m])
                if found:
                    return found
        state[m] = 2
        return None

    for m in modules:
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, " -> ".join(cycle)


def run_without_extras(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The command line in an interpreter where llama-cpp-python and matplotlib (the
    `llamacpp` and `report` extras) cannot be imported."""
    code = (
        "import sys\n"
        "sys.modules['llama_cpp'] = sys.modules['matplotlib'] = None\n"
        f"sys.argv = ['edgeprefill', *{list(args)!r}]\n"
        "from edgeprefill.runtime.cli.main import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )


def test_without_the_extras_the_simulator_runs_and_the_rest_says_what_to_install(tmp_path):
    from edgeprefill.runtime.core.costs.costmodel import CostModel
    from edgeprefill.runtime.core.costs.profile import DeviceProfile
    from edgeprefill.runtime.runner.calibration import save_profile

    model = tmp_path / "cm.json"
    save_profile(
        DeviceProfile(CostModel(0.02, 0.002, 0.003, 0.001), 0.024, 0.1, 2048, 8, "t"), model
    )
    workload = str(ROOT / "workloads" / "chat_only.yaml")
    res = run_without_extras(
        tmp_path,
        "run",
        workload,
        "--backend",
        "sim",
        "--cost-model",
        str(model),
        "--no-progress",
        "--out",
        "sim",
    )
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "sim" / "summary.json").read_text())["completed"] > 0

    res = run_without_extras(tmp_path, "run", workload, "--backend", "llamacpp")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "pip install 'edgeprefill[llamacpp]'" in res.stderr
    res = run_without_extras(tmp_path, "report", "sim")
    assert res.returncode == 2 and "pip install 'edgeprefill[report]'" in res.stderr
