"""Prompts of an exact token length, built with the model's own tokenizer.

Text prompts are English generated deterministically from a fixed word list (sentences and
paragraphs), so tokenization behaves like real prose; synthetic prompts are random plain-text
token ids for exact, model-independent lengths; document prompts are the user's own files,
split to fit.
"""

from __future__ import annotations

import numpy as np

from edgeprefill.runtime.core.contract import Tokenizer
from edgeprefill.runtime.core.errors import UserError
from edgeprefill.runtime.traffic.workload import DocumentsPrompt, SyntheticPrompt, TextPrompt

_WORDS = """
the of and to in is was that for on with as by at from his her their it this which be are
were had have not but or an they one all would there been has when who will more no if out
so said what up its about into than them can only other new some could time these two may
then do first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people
how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come
since against go came right used take three states himself few house use during without again
place around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact though water
less public put think almost hand enough far took head yet government system better set told
nothing night end why called didn't eyes find going look asked later knew point next program
city business give group toward young days let room president side social given present
several order national possible rather second face per among form important often things
looking early white case john become large big need four within felt children along saw best
church ever least power development light thing family interest want members mind country area
others done turned although open god service certain kind problem began different door thus
help sense means whole matter perhaps itself york times law human line above name example
action company hands local show whether five history gave today either act feet across taken
past quite anything seen having death week experience body word half really field am car words
already themselves information tell together college shall money period held keep sure free
seemed political real behind miss question air office making brought whose special heard major
problems ago became federal moment study available known result street economic boy position
reason change south board individual job areas society west close turn love community true
court force full seems am river letter garden summer winter morning evening market village
""".split()


def generate_text(rng: np.random.Generator, n_words: int) -> str:
    """Sentences of 6-18 words in paragraphs of 3-7 sentences."""
    words = rng.choice(_WORDS, size=n_words)
    out: list[str] = []
    i = 0
    while i < n_words:
        paragraph: list[str] = []
        for _ in range(int(rng.integers(3, 8))):
            if i >= n_words:
                break
            n = int(rng.integers(6, 19))
            sentence = list(words[i : i + n])
            i += n
            sentence[0] = sentence[0].capitalize()
            end = "?" if rng.random() < 0.08 else "."
            paragraph.append(" ".join(sentence) + end)
        out.append(" ".join(paragraph))
    return "\n\n".join(out)


class PromptBuilder:
    """Turns a prompt spec and a target length into token ids."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self._normal_cache: dict[int, bool] = {}

    def build(
        self, spec: TextPrompt | SyntheticPrompt, n_tokens: int, rng: np.random.Generator
    ) -> list[int]:
        if isinstance(spec, SyntheticPrompt):
            return self.synthetic(n_tokens, rng)
        return self.text(spec, n_tokens, rng)

    def frame(self, spec: TextPrompt | DocumentsPrompt) -> tuple[list[int], list[int]]:
        """Token ids before and after the body: chat prefix; instruction + chat suffix."""
        head, tail = self._chat(spec)
        instr = (
            self.tok.encode("\n\n" + spec.instruction, add_bos=False, special=False)
            if spec.instruction
            else []
        )
        return head, instr + tail

    def _chat(self, spec: TextPrompt | DocumentsPrompt) -> tuple[list[int], list[int]]:
        if spec.chat_template:
            before, after = self.tok.chat_parts(spec.system)
        else:
            before, after = ((spec.system + "\n\n") if spec.system else "", "")
        head = self.tok.encode(before, add_bos=True, special=True)
        return head, self.tok.encode(after, add_bos=False, special=True)

    def question(
        self,
        document: list[int],
        spec: TextPrompt | DocumentsPrompt,
        n_tokens: int,
        rng: np.random.Generator,
    ) -> list[int]:
        """A question of `n_tokens` generated tokens about `document` (its chat prefix and
        body, as the indexer's prompt began), closed by the same chat suffix."""
        _, tail = self._chat(spec)
        words = generate_text(rng, n_tokens)
        question = self.tok.encode("\n\n" + words, add_bos=False, special=False)
        return document + question[:n_tokens] + tail

    def next_turn(self, spec: TextPrompt, n_tokens: int, rng: np.random.Generator) -> list[int]:
        """What a conversation's next turn adds after the previous answer: the template's
        text that closes an answer and opens a user message, a question of `n_tokens`
        generated tokens, and the text that opens the next answer."""
        between, after = self._next_turn_parts(spec)
        words = self.tok.encode(generate_text(rng, n_tokens), add_bos=False, special=False)
        return between + words[:n_tokens] + after

    def _next_turn_parts(self, spec: TextPrompt) -> tuple[list[int], list[int]]:
        if not spec.chat_template:
            return self.tok.encode("\n\n", add_bos=False, special=False), []
        answer, question = "\x1eANSWER\x1e", "\x1eQUESTION\x1e"
        rendered = self.tok.render_chat(
            [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": answer},
                {"role": "user", "content": question},
            ]
        )
        between, _, after = rendered.partition(answer)[2].partition(question)
        encode = self.tok.encode
        return encode(between, add_bos=False, special=True), encode(
            after, add_bos=False, special=True
        )

    def text(self, spec: TextPrompt, n_tokens: int, rng: np.random.Generator) -> list[int]:
        """[chat prefix] + generated text cut to fit + [instruction] + [chat suffix]."""
        head, tail = self.frame(spec)
        n_body = n_tokens - len(head) - len(tail)
        if n_body < 1:
            raise UserError(
                f"a prompt of {n_tokens} tokens cannot hold the template, system prompt and "
                f"instruction ({n_tokens - n_body} tokens); raise prompt.tokens"
            )
        # Every word is at least one token, so n_body words always give enough tokens.
        body = self.tok.encode(generate_text(rng, n_body), add_bos=False, special=False)
        return head + body[:n_body] + tail

    def documents(self, spec: DocumentsPrompt) -> list[tuple[str, list[int]]]:
        """(label, prompt) per document piece, by the rule in `DocumentsPrompt`."""
        head, tail = self.frame(spec)
        room = spec.chunk_tokens - len(head) - len(tail)
        if room < 16:
            raise UserError(
                f"prompt.chunk_tokens {spec.chunk_tokens} leaves {room} tokens for the "
                "document after the template and instruction; raise it"
            )
        out: list[tuple[str, list[int]]] = []
        for path in spec.files:
            try:
                text = path.read_text(errors="replace")
            except OSError as e:
                raise UserError(f"cannot read document {path}: {e.strerror}") from None
            pieces = self._split(text, room)
            for i, body in enumerate(pieces, 1):
                out.append((f"{path.name} {i}/{len(pieces)}", head + body + tail))
        if not out:
            raise UserError(f"every document in {spec.folder} is empty")
        return out

    def _split(self, text: str, room: int) -> list[list[int]]:
        """Whole paragraphs while they fit; a paragraph longer than a piece is cut at token
        boundaries. Paragraph breaks are kept as text, so no token is lost."""
        pieces: list[list[int]] = []
        current: list[int] = []
        for para in (p for p in text.split("\n\n") if p.strip()):
            ids = self.tok.encode(para + "\n\n", add_bos=False, special=False)
            if current and len(current) + len(ids) > room:
                pieces.append(current)
                current = []
            while len(ids) > room:
                pieces.append(ids[:room])
                ids = ids[room:]
            current += ids
        if current:
            pieces.append(current)
        return pieces

    def synthetic(self, n_tokens: int, rng: np.random.Generator) -> list[int]:
        """BOS then random plain-text token ids (control and byte tokens rejected)."""
        bos = self.tok.encode("", add_bos=True, special=True)[:1]
        out = list(bos)
        while len(out) < n_tokens:
            for t in rng.integers(0, self.tok.vocab_size, size=n_tokens - len(out)):
                t = int(t)
                ok = self._normal_cache.get(t)
                if ok is None:
                    ok = self._normal_cache[t] = self.tok.is_normal(t)
                if ok:
                    out.append(t)
        return out[:n_tokens]
