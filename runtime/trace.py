"""A workload turned into requests: arrival times, lengths, prompts, sampling seeds.

Each stream draws from its own seeded generators (one for arrivals, one for lengths, one for
prompt text), keyed by the workload seed and the stream's name, so adding a stream or
changing a prompt source never shifts another stream's arrivals.
"""

from __future__ import annotations

import zlib

import numpy as np

from edgeprefill.backends.base import Tokenizer
from edgeprefill.runtime.arrivals import arrival_times
from edgeprefill.runtime.prompts import PromptBuilder
from edgeprefill.runtime.request import Request, SamplingParams
from edgeprefill.runtime.workload import Range, Workload


def _rng(seed: int, stream: str, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(stream.encode()), purpose])


def _draw(r: Range, rng: np.random.Generator) -> int:
    return int(rng.integers(r.min, r.max + 1))


def build_requests(
    workload: Workload, tokenizer: Tokenizer, seed: int | None = None
) -> list[Request]:
    """All requests of the workload, sorted by arrival time (ties by stream order)."""
    seed = workload.seed if seed is None else seed
    builder = PromptBuilder(tokenizer)
    requests: list[Request] = []
    for name, stream in workload.streams.items():
        times = arrival_times(stream.arrivals, _rng(seed, name, 0))
        lengths = _rng(seed, name, 1)
        text = _rng(seed, name, 2)
        for i, t in enumerate(times):
            n_prompt = _draw(stream.prompt.tokens, lengths)
            n_out = _draw(stream.output_tokens, lengths)
            s = stream.sampling
            sample_seed = s.seed if s.seed is not None else (seed * 1_000_003 + i) & 0xFFFFFFFF
            requests.append(
                Request(
                    id=f"{name}-{i}",
                    cls=stream.cls,
                    arrival_s=t,
                    prompt=builder.build(stream.prompt, n_prompt, text),
                    max_tokens=n_out,
                    sampling=SamplingParams(s.temperature, s.top_p, sample_seed),
                    ignore_eos=stream.ignore_eos,
                )
            )
    requests.sort(key=lambda r: r.arrival_s)
    return requests
