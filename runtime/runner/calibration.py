"""Device profiles for policy defaults: a few timed iterations at startup, a finished
run's records (`edgeprefill calibrate`), or a cost-model file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgeprefill.runtime.core.contract import Backend, SeqWork, timing_of
from edgeprefill.runtime.core.costs.costmodel import CostModel
from edgeprefill.runtime.core.costs.profile import TYPICAL_DECODE_CTX, DeviceProfile, target_for
from edgeprefill.runtime.core.driver import SchedulingBackend
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.core.plan import IterationTiming
from edgeprefill.runtime.core.request import SamplingParams
from edgeprefill.runtime.traffic.prompts import PromptBuilder


def probe_device(backend: Backend | SchedulingBackend, seed: int = 0) -> DeviceProfile:
    """Time decode-only iterations, decodes beside prompt chunks of several sizes, chunks deep
    in a context and two decodes sharing a pass, then fit the cost model (about 5 s on a
    2-core CPU)."""
    if not isinstance(backend, Backend):
        return _probe_self_scheduling(backend, seed)
    cap = backend.capacity
    if cap.n_ctx_seq < 128 or cap.n_batch < 32:
        raise UserError(
            f"a context of {cap.n_ctx_seq} cells and a batch of {cap.n_batch} tokens are too "
            "small to probe the device; pass --calibration none or a cost-model file"
        )
    script = _Script(backend, seed)
    try:
        script.run([script.chunk(script.foreground, 32, sample=True)])
        decode_times = [script.run([script.decode(script.foreground)]) for _ in range(6)]
        script.chunks_beside_a_decode((16, 64, 128, 256, 512, 64, 16))
        script.two_decodes(3)
    finally:
        script.release()
    decode_s = float(np.median(decode_times))
    return DeviceProfile(
        CostModel.fit(script.timings),
        decode_s,
        target_for(decode_s),
        cap.n_batch,
        cap.min_chunk,
        "probe",
        script.timings,
        cap.chunk_quantum,
    )


class _Script:
    """Timed iterations of a foreground sequence and a background one (the same on a
    single-sequence device), each continuing where it left off."""

    def __init__(self, backend: Backend, seed: int) -> None:
        self.backend = backend
        self.tokens = PromptBuilder(backend.tokenizer).synthetic(1600, np.random.default_rng(seed))
        self.foreground, self.background = 0, min(1, backend.capacity.n_seq_max - 1)
        self.pos = {self.foreground: 0, self.background: 0}
        self.timings: list[IterationTiming] = []

    def run(self, work: list[SeqWork]) -> float:
        result = self.backend.execute(work)
        self.timings.append(timing_of(work, result.duration_s))
        return result.duration_s

    def chunk(self, seq: int, n: int, sample: bool = False) -> SeqWork:
        pos = self.pos[seq]
        self.pos[seq] += n
        return SeqWork(seq, self.tokens[pos : pos + n], pos, SamplingParams() if sample else None)

    def decode(self, seq: int) -> SeqWork:
        return self.chunk(seq, 1, sample=True)

    def chunks_beside_a_decode(self, sizes: tuple[int, ...]) -> None:
        """Background chunks, each beside a foreground decode (alone on one sequence)."""
        cap = self.backend.capacity
        for c in sizes:
            c = min(
                c,
                cap.n_batch - 1,
                cap.max_chunk or c,
                cap.n_ctx_seq - 64 - self.pos[self.background],
            )
            if c < 1:
                break
            work = [self.chunk(self.background, c)]
            if self.background != self.foreground:
                work.insert(0, self.decode(self.foreground))
            self.run(work)

    def two_decodes(self, n: int) -> None:
        """Two decodes in one pass: separates a pass from a sampled row."""
        if self.background != self.foreground:
            for _ in range(n):
                self.run([self.decode(self.foreground), self.decode(self.background)])

    def release(self) -> None:
        for seq in {self.foreground, self.background}:
            self.backend.release(seq)


def _probe_self_scheduling(backend: SchedulingBackend, seed: int) -> DeviceProfile:
    """vLLM plans its own batches: the backend's probe steers them with a scripted budget."""
    timings = backend.probe_timings(seed)
    alone = [t.duration_s for t in timings if t.n_decode == 1 and t.n_prefill == 0]
    if not alone or len(timings) < 6:
        raise UserError("the vLLM startup probe saw too few iterations; pass --calibration none")
    decode_s = float(np.median(alone))
    n_batch = backend.describe()["n_batch"]
    cost = CostModel.fit(timings)
    return DeviceProfile(cost, decode_s, target_for(decode_s), n_batch, 1, "probe", timings)


def profile_from_run(run_dir: Path) -> DeviceProfile:
    """Fit the cost model to a finished run's iterations.jsonl (`edgeprefill calibrate`)."""
    path = run_dir / "iterations.jsonl"
    try:
        lines = path.read_text().splitlines()
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError as e:
        raise UserError(
            f"{e.filename} not found: pass a folder written by `edgeprefill run`"
        ) from None
    fields = IterationTiming.__dataclass_fields__
    timings = []
    for line in lines:
        rec = json.loads(line)
        if rec.get("error") is None:
            values = {k: rec[k] for k in fields if k in rec}
            if "rows_decode" in rec:  # the pass's rows, not the plan's requests
                values |= {"n_decode": rec["rows_decode"], "n_prefill": rec["rows_prefill"]}
            timings.append(IterationTiming(**values))
    try:
        cost = CostModel.fit(timings)
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None
    alone = [t.duration_s for t in timings if t.n_prefill == 0 and t.n_decode == 1]
    decode_s = float(np.median(alone)) if alone else cost.predict(1, 0, 0, TYPICAL_DECODE_CTX)
    backend = summary.get("backend", {})
    return DeviceProfile(
        cost,
        decode_s,
        target_for(decode_s),
        backend.get("n_batch", 2048),
        backend.get("min_chunk", 1),
        str(run_dir),
        timings,
        backend.get("chunk_quantum", 1),
    )


def save_profile(profile: DeviceProfile, path: Path) -> None:
    path.write_text(
        json.dumps(
            {
                **profile.describe(),
                "n_batch": profile.n_batch,
                "min_chunk": profile.min_chunk,
                "chunk_quantum": profile.chunk_quantum,
                "decode_s": profile.decode_s,
                # What the model did not explain, iteration by iteration: the simulator
                # can add them back (`--sim-noise measured`).
                "residuals_ms": [round(float(r) * 1e3, 3) for r in residuals(profile)],
            },
            indent=2,
        )
        + "\n"
    )


def residuals(profile: DeviceProfile) -> np.ndarray:
    """Measured minus predicted time of each iteration the model was fitted to."""
    return profile.cost.residuals(profile.timings) if profile.timings else np.zeros(0)


def load_residuals(path: Path) -> list[float]:
    """The fitted run's residuals in seconds, for a simulator that is as noisy as the
    device was."""
    try:
        values = json.loads(path.read_text())["residuals_ms"]
    except (OSError, ValueError, KeyError, TypeError):
        values = None
    if not values:
        raise UserError(
            f"{path} has no measured residuals (written before they were kept): run "
            "`edgeprefill calibrate RUN_DIR` again, or leave out --sim-noise"
        )
    return [float(v) / 1e3 for v in values]


def load_profile(path: Path) -> DeviceProfile:
    try:
        d = json.loads(path.read_text())
        return DeviceProfile(
            CostModel.from_dict(d["cost_model"]),
            d["decode_s"],
            target_for(d["decode_s"]),
            d["n_batch"],
            d["min_chunk"],
            str(path),
            chunk_quantum=d.get("chunk_quantum", 1),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path} is not a cost model written by `edgeprefill calibrate`: {e}"
        ) from None
