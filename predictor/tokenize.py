"""Tokenize prompts and chat messages with the engine that serves the model.

The engine's own ``POST /tokenize`` applies exactly the tokenizer and chat
template it will use for the real request, so the tokens (and thus the block
keys) match what it caches; a local tokenizer could drift from it silently.
Every call is bounded by ``timeout_s`` overall: an engine that is down or slow
becomes EngineUnavailable (503), never a hang.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import msgspec

from predictor.errors import ECHO_LIMIT, EngineRejected, EngineUnavailable, clip
from predictor.request import TokenId
from shared.engines.vllm import ENGINE as VLLM


class _TokenizeReply(msgspec.Struct):
    tokens: list[TokenId]


_reply_decoder = msgspec.json.Decoder(_TokenizeReply)
_encoder = msgspec.json.Encoder()


def tokenize_body(model: str, *, prompt: str | None = None, messages: list[Any] | None = None) -> dict[str, Any]:
    """The vLLM /tokenize request: completion form for a prompt, chat form (with generation prompt) for messages."""
    if messages is not None:
        return {"model": model, "messages": messages, "add_generation_prompt": True}
    return {"model": model, "prompt": prompt}


class EngineTokenizer:
    def __init__(self, engine_urls: Mapping[str, str], timeout_s: float, client: httpx.AsyncClient | None = None):
        self.engine_urls = dict(engine_urls)
        self.timeout_s = timeout_s
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    def has_engine(self, model: str) -> bool:
        return model in self.engine_urls

    async def tokenize(self, model: str, *, prompt: str | None = None, messages: list[Any] | None = None) -> list[int]:
        base = self.engine_urls[model]
        url = f"{base}{VLLM.tokenize_path}"  # the engine adapter's endpoint (shared/engines/vllm.py)
        body = _encoder.encode(tokenize_body(model, prompt=prompt, messages=messages))
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self.client.post(url, content=body, headers={"content-type": "application/json"})
        except (TimeoutError, httpx.TimeoutException):
            raise EngineUnavailable(f"engine {base} did not answer /tokenize within {self.timeout_s}s") from None
        except httpx.HTTPError as exc:
            raise EngineUnavailable(
                f"engine {base} unreachable for /tokenize: {type(exc).__name__}: {clip(str(exc))}") from None
        if 400 <= resp.status_code < 500:
            raise EngineRejected(f"engine {base} rejected the input ({resp.status_code}): {_error_text(resp)}")
        if resp.status_code != 200:
            raise EngineUnavailable(f"engine {base} /tokenize failed ({resp.status_code}): {_error_text(resp)}")
        try:
            return _reply_decoder.decode(resp.content).tokens
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(
                f"engine {base} /tokenize returned no usable token list: {clip(str(exc))}") from None

    async def aclose(self) -> None:
        await self.client.aclose()


def _error_text(resp: httpx.Response, limit: int = ECHO_LIMIT) -> str:
    """The engine's error message if it sent one (OpenAI-style or FastAPI-style), else the raw body; clipped,
    as engines often quote the prompt back."""
    try:
        data = msgspec.json.decode(resp.content)
    except msgspec.DecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return clip(str(err["message"]), limit)
        for key in ("message", "detail", "error"):
            if data.get(key):
                return clip(str(data[key]), limit)
    return clip(resp.text, limit) or "(empty body)"
