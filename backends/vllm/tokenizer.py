"""A Hugging Face model folder's tokenizer, as the runtime's `Tokenizer` protocol.

vLLM gets token-id prompts and returns token ids: the runtime builds every prompt itself
(exact lengths, the same trace as on llama.cpp), so the tokenizer the runtime uses lives
here (vLLM loads its own only for structured outputs' grammars).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgeprefill.runtime.core.contract import plain_transcript

_USER_MARK = "\x1eEDGEPREFILL_USER\x1e"


class HFTokenizer:
    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(folder))
        self.vocab_size = len(self._tok)
        special = set(self._tok.all_special_ids) | set(self._tok.added_tokens_decoder)
        self._special = special
        self._eog = {t for t in self._eos_ids(folder) if t is not None}

    def _eos_ids(self, folder: Path) -> list[int | None]:
        """The tokenizer's end-of-sequence token and the generation config's, which lists
        the chat model's end-of-turn tokens as well."""
        ids: list[int | None] = [self._tok.eos_token_id]
        gen = folder / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos]
        return ids

    @property
    def eog_ids(self) -> list[int]:
        return sorted(self._eog)

    def encode(self, text: str, *, add_bos: bool, special: bool) -> list[int]:
        ids: list[int] = self._tok.encode(
            text, add_special_tokens=False, split_special_tokens=not special
        )
        bos = self._tok.bos_token_id
        if add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def chat_parts(self, system: str | None) -> tuple[str, str]:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": _USER_MARK}
        ]
        before, _, after = self.render_chat(messages).partition(_USER_MARK)
        return before, after

    def render_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        if not self._tok.chat_template:
            return plain_transcript(messages)
        text: str = self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        return text

    def tool_calls_form(self) -> str:
        """ "json": the engine holds an answer to a JSON schema through vLLM's structured
        outputs, not to JSON between tags or to a call or a reply's text, so tools take
        the generic JSON format here."""
        return "json"

    def piece(self, token: int) -> bytes:
        """A token's text; none for a special token (end of text, a turn's marker), as
        llama.cpp renders its control tokens in an answer: `<eos>` is not text to a client."""
        return str(self._tok.decode([token], skip_special_tokens=True)).encode()

    def is_normal(self, token: int) -> bool:
        if token in self._special:
            return False
        text = self._tok.decode([token])
        return bool(text.strip()) and text.isprintable() and "\ufffd" not in text

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def decode(self, tokens: list[int]) -> str:
        return str(self._tok.decode(tokens))
