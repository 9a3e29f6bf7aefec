"""The GGUF model's own tokenizer and chat template, through llama.cpp."""

from __future__ import annotations

import ctypes

import llama_cpp as lc

from edgeprefill.backends.llamacpp.native import LlamaModel

_USER_MARK = "\x1eEDGEPREFILL_USER\x1e"


class LlamaTokenizer:
    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self._vocab = model.vocab
        self.vocab_size = lc.llama_vocab_n_tokens(self._vocab)

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        data = text.encode()
        n_max = len(data) + 8
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:  # buffer too small: -n is the size needed
            n_max = -n
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:
            raise RuntimeError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
        return list(buf[:n])

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        """Render the model's template around a marker and split there, so prompts of an
        exact token length can be built by filling the middle."""
        template = self._model.chat_template()
        if template is None:  # a base model: a plain transcript it can continue
            return ((system + "\n\n" if system else "") + "User: ", "\nAssistant:")
        messages = ([("system", system)] if system else []) + [("user", _USER_MARK)]
        keep = [(r.encode(), c.encode()) for r, c in messages]  # alive during the call
        chat = (lc.llama_chat_message * len(keep))(
            *(lc.llama_chat_message(role=r, content=c) for r, c in keep)
        )
        size = 4096
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(template, chat, len(keep), True, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = lc.llama_chat_apply_template(template, chat, len(keep), True, buf, n)
        if n < 0:
            raise RuntimeError("llama.cpp could not apply the model's chat template")
        rendered = buf.raw[:n].decode()
        before, _, after = rendered.partition(_USER_MARK)
        return before, after

    def is_normal(self, token: int) -> bool:
        return bool(lc.llama_vocab_get_attr(self._vocab, token) & lc.LLAMA_TOKEN_ATTR_NORMAL)

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    def decode(self, tokens: list[int]) -> str:
        """Token ids back to text (for people reading results, not for the hot path)."""
        out = bytearray()
        buf = ctypes.create_string_buffer(256)
        for t in tokens:
            n = lc.llama_token_to_piece(self._vocab, t, buf, len(buf), 0, False)
            out += buf.raw[: max(n, 0)]
        return out.decode(errors="replace")
