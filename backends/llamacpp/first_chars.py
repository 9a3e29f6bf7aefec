"""Which tokens a grammar may allow, found from their first characters.

Where the grammar rejects the token a chain drew, llama.cpp filters the vocabulary: it
matches every token's text against the grammar, ~50 ms for 262k tokens on a 2-core Zen 3,
and every stream's next token waits for it. That happened for 1-2% of a JSON chat's
tokens beside documents, where the grammar allows a few tokens the model does not expect
(the `{` that opens the answer, the rest of a key's name), and those iterations were the
chats' P99 token gap.

A token the grammar allows has a first character the grammar allows on its own (it
accepts a prefix of what it can match). So the grammar first checks one token per
character that begins some token, the token that is that character alone (19k of them
for Gemma 3's vocabulary: every first character has one), and then only the tokens that
begin with an allowed character; the others cannot pass. Tokens with no such character
(a lone byte of a character, an empty text) and end-of-generation tokens are always
checked. The tokens it leaves are exactly those the whole pass leaves.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp as lc
import numpy as np


class FirstChars:
    """A vocabulary's tokens by first character, read once where a format is first checked,
    off the engine thread (0.9-1.3 s for 262k tokens on a 2-core Zen 3, 3 runs, 7 Dec 2026;
    the engine thread shares the interpreter with it meanwhile)."""

    def __init__(self, vocab: Any, n_vocab: int) -> None:
        buf = ctypes.create_string_buffer(512)
        index: dict[str, int] = {}  # first character -> its number
        first = np.full(n_vocab, -1, dtype=np.int32)  # -1: always checked
        alone: dict[str, int] = {}  # a character -> the token that is that character
        for token in range(n_vocab):
            n = lc.llama_token_to_piece(vocab, token, buf, len(buf), 0, True)
            char = _first_char(buf.raw[: max(n, 0)])
            if char is None or lc.llama_vocab_is_eog(vocab, token):
                continue
            first[token] = index.setdefault(char, len(index))
            if n == len(char.encode()):
                alone.setdefault(char, token)
        probe = np.full(len(index), -1, dtype=np.int32)
        for char, i in index.items():
            probe[i] = alone.get(char, -1)
        # A character without a token of its own cannot be checked alone: always checked.
        unprobed = np.flatnonzero(probe < 0)
        first[np.isin(first, unprobed)] = -1
        self.first = first
        self.probe_ids = probe[probe >= 0]
        self.probe_chars = np.flatnonzero(probe >= 0)
        self.n_chars = len(index)

    def candidates(self, allowed_chars: np.ndarray) -> np.ndarray:
        """The token ids a grammar that allows the probed characters `allowed_chars` (a
        bool per probe) may allow, in id order."""
        ok = np.zeros(self.n_chars + 1, dtype=bool)  # the last: the always-checked -1
        ok[self.probe_chars[allowed_chars]] = True
        ok[-1] = True
        return np.flatnonzero(ok[self.first])


def _first_char(piece: bytes) -> str | None:
    """The first character of a token's text; None where it has none whole (empty, or a
    lone byte of a longer character)."""
    if not piece:
        return None
    lead = piece[0]
    size = 1 if lead < 0x80 else 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
    try:
        return piece[:size].decode("utf-8")
    except UnicodeDecodeError:
        return None
