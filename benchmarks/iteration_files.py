"""Which of edgeprefill's files one iteration on llama.cpp runs through: a chat decoding
beside a document's prompt chunk, under cadence, on the bundled model. The README's trace
of one iteration is checked against it.

    python benchmarks/iteration_files.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import edgeprefill.runtime.core.engine
from edgeprefill.backends.bundled_model import default_model_path
from edgeprefill.backends.llamacpp import LlamaCppBackend, LlamaCppConfig
from edgeprefill.runtime.core.engine import Engine
from edgeprefill.runtime.core.request import Request
from edgeprefill.runtime.policies import parse_policy
from edgeprefill.runtime.runner.calibration import probe_device

# The package's root (an editable install maps it onto the checkout): above runtime/core/.
PACKAGE = Path(edgeprefill.runtime.core.engine.__file__).parents[2]


def traced_files(engine: Engine) -> list[str]:
    """The package's files whose code ran in one `engine.iterate()`, in first-call order."""
    seen: dict[str, None] = {}

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(str(PACKAGE)):
            seen.setdefault(str(Path(path).relative_to(PACKAGE)), None)
        return None

    sys.settrace(tracer)
    try:
        engine.iterate()
    finally:
        sys.settrace(None)
    return list(seen)


def main() -> None:
    with LlamaCppBackend(LlamaCppConfig(model=default_model_path(), n_ctx=8192)) as backend:
        policy = parse_policy("cadence")
        engine = Engine(backend, policy, profile=probe_device(backend))
        prompt = backend.tokenizer.encode("the river " * 400, add_bos=True, special=True)
        engine.add(Request("chat", "foreground", 0.0, prompt[:40], 8))
        while not engine.scheduler.running or engine.scheduler.running[0].remaining_prompt:
            engine.iterate()
        engine.add(Request("doc", "background", 0.0, prompt, 8))
        admitting = traced_files(engine)
        plain = traced_files(engine)
    print(f"{len(plain)} files in one iteration (a chat's decode beside a document's chunk):")
    for f in plain:
        print(f"  {f}")
    print(f"and {len(admitting)} where it admits the document (its saved prefix looked up):")
    for f in admitting:
        if f not in plain:
            print(f"  {f}")


if __name__ == "__main__":
    main()
