"""The GGUF model's own tokenizer and chat template, through llama.cpp."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import jinja2
import llama_cpp as lc
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from edgeprefill.backends.llamacpp.native import LlamaModel
from edgeprefill.runtime.core.contract import plain_transcript

_USER_MARK = "\x1eEDGEPREFILL_USER\x1e"


class LlamaTokenizer:
    """Reads the model's vocabulary, which lives inside the model's native memory: every
    use that reads it checks that the model is still loaded, so a tokenizer kept after its
    backend was closed raises instead of reading freed memory."""

    def __init__(self, model: LlamaModel) -> None:
        self._model = model
        self.vocab_size = lc.llama_vocab_n_tokens(model.vocab)
        # End-of-generation tokens, asked once for the whole vocabulary (~80 ms for 262k
        # tokens): asked per sampled token, it was a ctypes call of ~20 us between two
        # device calls, where a chat's next token waits.
        is_eog = lc.llama_vocab_is_eog
        self._eog = frozenset(t for t in range(self.vocab_size) if is_eog(model.vocab, t))

    @property
    def _vocab(self) -> object:
        if not self._model.ptr:
            raise RuntimeError("the model was closed with its backend: this tokenizer is unusable")
        return self._model.vocab

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
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _USER_MARK}
        ]
        before, _, after = self.render_chat(messages).partition(_USER_MARK)
        return before, after

    @functools.cached_property
    def _template(self) -> Jinja2ChatFormatter | None:
        """The model's Jinja chat template, compiled once, rendered in Jinja's sandbox as
        llama-server's `--jinja`, vLLM and transformers render it: the template is code
        from the model file, and a sandbox keeps it from reaching the server's objects."""
        vocab = self._vocab  # the check that the model is loaded
        source = self._model.chat_template()
        if source is None:
            return None
        bos, eos = lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab)
        return Jinja2ChatFormatter(
            source.decode(errors="replace"), eos_token=self._text(eos), bos_token=self._text(bos)
        )

    def _text(self, token: int) -> str:
        """A token's text, control tokens' included ("<bos>"), as a template writes them."""
        return self._piece(token, special=True).decode(errors="replace") if token >= 0 else ""

    def tool_calls_form(self) -> str:
        """The template's form of tool calls, detected as llama.cpp's chat formats detect
        it: calls between <tool_call> tags (Hermes 2 Pro, Qwen 2.5 and 3), or Llama 3.x's
        (a template with its `ipython` role's header)."""
        source = self._template.template if self._template is not None else ""
        if "<tool_call>" in source and "tools" in source:
            return "tagged"
        if "<|start_header_id|>ipython<|end_header_id|>" in source:
            return "llama3"
        return "json"

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """A conversation in the model's own chat template, ending where the assistant's
        answer starts; a base model without a template gets a plain transcript. The
        beginning-of-text token a template writes is left to `encode(add_bos=True)`, which
        adds it once. ValueError where the template refuses the conversation (roles out of
        order, a tool result without its call)."""
        self._vocab  # noqa: B018 (the check that the model is loaded)
        template = self._template
        if template is None:
            return plain_transcript(messages)
        try:
            text = template(messages=messages, tools=tools).prompt  # type: ignore[arg-type]
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise ValueError(f"the model's chat template refused the conversation: {e}") from None
        return text.removeprefix(template.bos_token) if template.bos_token else text

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (a character may span several tokens)."""
        return self._piece(token, special=False)

    def _piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[: max(n, 0)]

    def is_normal(self, token: int) -> bool:
        return bool(lc.llama_vocab_get_attr(self._vocab, token) & lc.LLAMA_TOKEN_ATTR_NORMAL)

    def is_eog(self, token: int) -> bool:
        self._vocab  # noqa: B018 (the check that the model is loaded)
        return token in self._eog

    def decode(self, tokens: list[int]) -> str:
        """Token ids back to text (for people reading results, not for the hot path)."""
        return b"".join(self.piece(t) for t in tokens).decode(errors="replace")
