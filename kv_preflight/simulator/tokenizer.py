"""A built-in byte tokenizer and chat template, shaped like the tiny test model's.

Ids 0-3 are the tiny model's specials (BOS, EOS text, ``<|im_start|>``,
``<|im_end|>``); every UTF-8 byte ``b`` is id ``4 + b``. A prompt string gets BOS
first, as the tiny model's tokenizer adds it; token-id prompts are used as given.
The chat template is the tiny model's: ``BOS`` then per message
``<|im_start|>role\\ncontent<|im_end|>\\n``, then ``<|im_start|>assistant\\n`` when a
generation prompt is asked for. The real token ids differ from the tiny model's,
which is fine: prefix caching depends on token equality, not on the vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

BOS = 0
END_OF_TEXT = 1
IM_START = 2
IM_END = 3
BYTE_OFFSET = 4
SPECIALS = {BOS: "<|begin_of_text|>", END_OF_TEXT: "<|end_of_text|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
# Generated text: lower-case letters and spaces, so responses decode to readable strings.
OUTPUT_ALPHABET = tuple(BYTE_OFFSET + c for c in b"abcdefghijklmnopqrstuvwxyz    ")


class TemplateError(ValueError):
    pass


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    ids = [BYTE_OFFSET + b for b in text.encode("utf-8")]
    return [BOS, *ids] if add_bos else ids


def decode(token_ids: Iterable[int]) -> str:
    out = bytearray()
    for t in token_ids:
        if t in SPECIALS:
            out += SPECIALS[t].encode()
        elif BYTE_OFFSET <= t < BYTE_OFFSET + 256:
            out.append(t - BYTE_OFFSET)
    return out.decode("utf-8", "replace")


def _content_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise TemplateError("only text content parts are supported")
        return "".join(parts)
    raise TemplateError("message content must be a string or a list of text parts")


def apply_chat_template(messages: Sequence[Any], *, add_generation_prompt: bool) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list")
    ids = [BOS]
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise TemplateError("each message needs a string role")
        ids += [IM_START, *encode(f"{m['role']}\n{_content_text(m.get('content'))}", add_bos=False), IM_END]
        ids += encode("\n", add_bos=False)
    if add_generation_prompt:
        ids += [IM_START, *encode("assistant\n", add_bos=False)]
    return ids
