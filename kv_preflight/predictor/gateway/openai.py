"""What routing needs from an OpenAI request body, read in one typed pass; the body itself is forwarded untouched.

``/v1/completions`` takes ``prompt`` as a string, a list of token ids, or a list of one of those (a batch of
several is routed by its first prompt: the engine serves the batch on one pod); ``/v1/chat/completions``
takes ``messages``. A token-id prompt is keyed straight from the JSON text (the predictor's C fast path);
any other input goes through the predictor's tokenization, once. Unknown fields are the engine's business:
ignored here, forwarded as sent.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kv_preflight.predictor.errors import BadRequest, clip
from kv_preflight.predictor.request import (MAX_MESSAGES_DEPTH, KeyedRequest, PredictRequest, check_depth,
                                                 check_token_count, without_list)
from kv_preflight.keys.chain import request_keys_json


class _Body(msgspec.Struct):
    model: str | None = None
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    cache_salt: str | None = None


_decoder = msgspec.json.Decoder(_Body)
_prompt_decoder = msgspec.json.Decoder(str | list[int | str | list[int]])
_messages_decoder = msgspec.json.Decoder(list[dict[str, Any]])


class Routable(msgspec.Struct, frozen=True):
    """One request as routing sees it: the predictor's input, whether the answer streams, and its decode budget."""

    request: PredictRequest | KeyedRequest
    stream: bool
    max_tokens: int | None  # what the body asks for (None: the engine's default)


def read_routable(body: bytes, *, chat: bool, max_tokens: int, hash_seed: str, block_size: int,
                  hash_algo: str) -> Routable:
    """The routing input of a completions (``chat=False``) or chat completions body; BadRequest names what is wrong."""
    if not chat and hash_algo == "fnv64a":
        keyed = _keyed_in_place(body, max_tokens=max_tokens, hash_seed=hash_seed, block_size=block_size)
        if keyed is not None:
            return keyed
    try:
        shape = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid request: {clip(str(exc))}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON: {clip(str(exc))}") from None
    except RecursionError:
        raise BadRequest("invalid JSON: nested too deeply (1000 levels or more)") from None
    if not shape.model:
        raise BadRequest("missing model: give the model name as the engine serves it (the adapter name for LoRA)")
    budget = shape.max_completion_tokens if shape.max_completion_tokens is not None else shape.max_tokens
    stream = bool(shape.stream)
    if chat:
        if not len(shape.messages):
            raise BadRequest("missing messages: a chat completion takes a list of messages")
        try:
            messages = _messages_decoder.decode(shape.messages)
        except (msgspec.DecodeError, RecursionError):
            raise BadRequest("messages must be a list of chat message objects") from None
        if not messages:
            raise BadRequest("messages is empty")
        check_depth(messages, MAX_MESSAGES_DEPTH, "messages")
        return Routable(PredictRequest(model=shape.model, messages=messages, cache_salt=shape.cache_salt),
                        stream, budget)
    raw = shape.prompt
    if not len(raw):
        raise BadRequest("missing prompt")
    if bytes(memoryview(raw)[:1]) == b"[" and shape.cache_salt is None and hash_algo == "fnv64a":
        got = request_keys_json(raw, model=shape.model, hash_seed=hash_seed, block_size=block_size)
        if got is not None and 0 < got[1] <= max_tokens:  # a list of token ids: keyed in C from the JSON text
            return Routable(KeyedRequest(model=shape.model, keys=got[0], n_tokens=got[1], pods=None,
                                         raw_token_ids=raw), stream, budget)
    try:
        prompt = _prompt_decoder.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        raise BadRequest("prompt must be a string, a list of token ids, or a list of those") from None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: routed by its first prompt
    elif isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        raise BadRequest("prompt must be a string, a list of token ids, or a list of those")
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty")
        return Routable(PredictRequest(model=shape.model, prompt=prompt, cache_salt=shape.cache_salt), stream, budget)
    if not prompt:
        raise BadRequest("prompt is empty")
    check_token_count(len(prompt), max_tokens)
    return Routable(PredictRequest(model=shape.model, token_ids=list(prompt), cache_salt=shape.cache_salt),
                    stream, budget)


def _keyed_in_place(body: bytes, *, max_tokens: int, hash_seed: str, block_size: int) -> Routable | None:
    """A token-id prompt keyed from its text where it lies, the rest of the body decoded with ``[]`` in its place
    (``without_list``: the decoder's scan of the digits was a sixth of what the gateway spent on a forwarded
    request). None for anything else (no C routines, another prompt, a salt, an error): ``read_routable``'s
    ordinary way, which also words the error."""
    cut = without_list(body, b"prompt")
    if cut is None:
        return None
    try:
        shape = _decoder.decode(cut[0])
    except (msgspec.DecodeError, RecursionError):
        return None
    if not shape.model or shape.cache_salt is not None or bytes(shape.prompt) != b"[]":
        return None
    raw = cut[1]
    got = request_keys_json(raw, model=shape.model, hash_seed=hash_seed, block_size=block_size)
    if got is None or not 0 < got[1] <= max_tokens:
        return None
    budget = shape.max_completion_tokens if shape.max_completion_tokens is not None else shape.max_tokens
    return Routable(KeyedRequest(model=shape.model, keys=got[0], n_tokens=got[1], pods=None, raw_token_ids=raw),
                    bool(shape.stream), budget)


def error_body(message: str, status: int, kind: str) -> bytes:
    """An error in the shape OpenAI clients (and vLLM) use: ``{"error": {message, type, param, code}}``."""
    return msgspec.json.encode({"error": {"message": message, "type": kind, "param": None, "code": status}})
