"""A sampled token's log-probability and the likeliest alternatives, from its logits row.

Read from the raw logits (before bias, penalties, a grammar or temperature), as llama-server
reports them by default and OpenAI documents them: what the model thought of each token, not
what the sampler then allowed. Only rows whose request asked pay for it (~1 ms of host time
for Gemma 3's 262k-token vocabulary).
"""

from __future__ import annotations

import numpy as np

from edgeprefill.runtime.core.request import TokenLogprob


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-softmax in `logits` and the `top` likeliest (token, log-probability).
    In float32 with NumPy's pairwise sum (float64 took ~4x as long for no digit a client
    reads); the likeliest found by partial sort of the logits, whose order the shift keeps."""
    peak = float(logits.max())
    norm = peak + float(np.log(np.exp(logits - peak).sum()))
    best = np.argpartition(logits, -top)[-top:] if top else np.empty(0, dtype=np.int64)
    best = best[np.argsort(-logits[best], kind="stable")]
    return TokenLogprob(
        float(logits[token]) - norm, tuple((int(t), float(logits[t]) - norm) for t in best)
    )
