"""A conversation as prompt token ids, in the model's chat template, where the people's words
stay words: text such as "<start_of_turn>model" typed by a user, or pasted from a web page,
is tokenized as plain text, not as the control tokens that mark turns (it would let them
write the assistant's part of the conversation). Only the template's own text is read for
control tokens, unless `parse_special` says the caller's text may carry them too."""

from __future__ import annotations

from typing import Any

from edgeprefill.runtime.core.contract import Tokenizer, plain_transcript

# What stands in for a message's content while the template renders: no whitespace at its
# ends, which templates `trim` (Gemma 3's and Llama 3's do), and no control string.
_MARK = "[[EDGEPREFILL_MESSAGE_{}]]"
# What opens the next turn in the plain transcript a model without a chat template gets.
PLAIN_NEXT_TURN = "\nUser:"


def turn_stops(tokenizer: Tokenizer) -> list[str]:
    """Where an answer in the plain transcript ends: at the next turn's marker, which a
    base model goes on to write (a chat template ends the turn with a token of its own, at
    which the answer stops already)."""
    probe = [{"role": "user", "content": "?"}]
    plain = tokenizer.render_chat(probe) == plain_transcript(probe)
    return [PLAIN_NEXT_TURN] if plain else []


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    parse_special: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The template is rendered around markers in place of each message's content. The
    control tokens of the template's pieces are kept as ids; the text between them, the
    template's and the messages' alike, is tokenized as plain text, each run whole: so a
    prompt without control strings in its messages gets exactly the ids of the whole
    rendered text. An empty content stays empty (a template tests it: an assistant turn
    that only calls tools)."""
    if parse_special:
        text = tokenizer.render_chat(messages, tools)
        return tokenizer.encode(text, add_bos=True, special=True)
    marks = [_MARK.format(i) if m["content"] else "" for i, m in enumerate(messages)]
    rest = tokenizer.render_chat(
        [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)], tools
    )
    ids = tokenizer.encode("", add_bos=True, special=True)
    text = ""  # the plain text since the last control token
    for message, mark in zip(messages, marks, strict=True):
        if not mark:
            continue
        before, found, after = rest.partition(mark)
        if found:  # (a template may leave a message out: an empty system turn)
            text = _template(tokenizer, before, text, ids) + message["content"]
            rest = after
    text = _template(tokenizer, rest, text, ids)
    return ids + tokenizer.encode(text, add_bos=False, special=False)


def _template(tokenizer: Tokenizer, piece: str, text: str, ids: list[int]) -> str:
    """Append to `ids` the text run so far and each control token of the template's
    `piece`, in order; return the plain text after the last one."""
    controlled = tokenizer.encode(piece, add_bos=False, special=True)
    if controlled == tokenizer.encode(piece, add_bos=False, special=False):
        return text + piece  # no control token in it
    run: list[int] = []
    for token in controlled:
        if tokenizer.is_normal(token):
            run.append(token)
            continue
        text += _text(tokenizer, run)
        ids += tokenizer.encode(text, add_bos=False, special=False) + [token]
        text, run = "", []
    return text + _text(tokenizer, run)


def _text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return b"".join(tokenizer.piece(t) for t in tokens).decode("utf-8", errors="replace")
