"""Tokenize prompts and chat messages with the engine that serves the model.

The engine's own ``POST /tokenize`` applies exactly the tokenizer and chat
template it will use for the real request, so the tokens (and thus the block
keys) match what it caches; a local tokenizer could drift from it silently.
Every call is bounded by ``timeout_s`` overall: an engine that is down or slow
becomes EngineUnavailable (503), never a hang.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
import msgspec

from kv_preflight.engines import DEFAULT, engine
from kv_preflight.predictor.errors import ECHO_LIMIT, EngineRejected, EngineUnavailable, clip
from kv_preflight.predictor.request import TokenId

log = logging.getLogger("kvpf.predictor")

ENGINE = engine(DEFAULT)  # the family of the engines the predictor tokenizes with


class _TokenizeReply(msgspec.Struct):
    tokens: list[TokenId]


_reply_decoder = msgspec.json.Decoder(_TokenizeReply)
_encoder = msgspec.json.Encoder()


class EngineTokenizer:
    """``/tokenize`` on an engine of the model: the configured ones (``--engine-url``, several per model
    allowed), else the engines the fleet records list for it (``discovered``). An engine that is down or
    fails (timeout, connection error, 5xx, or a 4xx that is not about the input, e.g. 401, 404, 429) is skipped
    for the next; the one that answered is tried first next time, so a dead engine costs one failed attempt per
    switch, not one per request. A 400, 413 or 422 is the input's fault and is returned at once: another engine
    of the model would reject it too."""

    def __init__(self, engine_urls: Mapping[str, str | Sequence[str]], timeout_s: float,
                 client: httpx.AsyncClient | None = None,
                 discovered: Callable[[str], Sequence[str]] | None = None):
        self.engine_urls = {m: (u,) if isinstance(u, str) else tuple(u) for m, u in engine_urls.items()}
        self.timeout_s = timeout_s
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
        self.discovered = discovered
        self.failovers = 0  # kvpf_tokenize_failovers_total
        self._last_good: dict[str, str] = {}  # model -> URL that answered last

    def urls_for(self, model: str) -> tuple[str, ...]:
        if model in self.engine_urls:
            return self.engine_urls[model]
        return tuple(self.discovered(model)) if self.discovered is not None else ()

    def has_engine(self, model: str) -> bool:
        return bool(self.urls_for(model))

    async def tokenize(self, model: str, *, prompt: str | None = None, messages: list[Any] | None = None) -> list[int]:
        urls = list(self.urls_for(model))
        if not urls:
            raise EngineUnavailable(f"no engine is known to serve {clip(repr(model))} for /tokenize")
        good = self._last_good.get(model)
        if good in urls:
            urls.remove(good)
            urls.insert(0, good)
        body = _encoder.encode(ENGINE.tokenize_body(model, prompt=prompt, messages=messages))
        failure: EngineUnavailable | None = None
        for i, base in enumerate(urls):
            try:
                tokens = await self._tokenize_at(base, body)
            except EngineUnavailable as exc:
                failure = exc
                if i + 1 < len(urls):
                    self.failovers += 1
                    log.warning("tokenize: %s failed for %s, trying %s: %s", base, model, urls[i + 1], exc.message)
                continue
            self._last_good[model] = base
            return tokens
        assert failure is not None
        if len(urls) > 1:
            raise EngineUnavailable(f"all {len(urls)} engines of {clip(repr(model))} failed; last: {failure.message}")
        raise failure

    async def _tokenize_at(self, base: str, body: bytes) -> list[int]:
        url = f"{base}{ENGINE.tokenize_path}"
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self.client.post(url, content=body, headers={"content-type": "application/json"})
        except (TimeoutError, httpx.TimeoutException):
            raise EngineUnavailable(f"engine {base} did not answer /tokenize within {self.timeout_s}s") from None
        except httpx.HTTPError as exc:
            raise EngineUnavailable(
                f"engine {base} unreachable for /tokenize: {type(exc).__name__}: {clip(str(exc))}") from None
        if resp.status_code in INPUT_REJECTED:
            raise EngineRejected(f"engine {base} rejected the input ({resp.status_code}): {_error_text(resp)}")
        if resp.status_code != 200:
            raise EngineUnavailable(f"engine {base} /tokenize failed ({resp.status_code}): {_error_text(resp)}"
                                    f"{_likely_fix(resp.status_code)}")
        try:
            return _reply_decoder.decode(resp.content).tokens
        except msgspec.DecodeError as exc:
            raise EngineUnavailable(
                f"engine {base} /tokenize returned no usable token list: {clip(str(exc))}") from None

    async def aclose(self) -> None:
        await self.client.aclose()


# The engine's statuses that judge the input itself (malformed, too long, unprocessable): the client's fault,
# a 400. Any other 4xx (an API key the engine wants, a wrong model or path, its rate limit) is the server's
# set-up or state, which the client cannot fix: a 503.
INPUT_REJECTED = frozenset({400, 413, 422})

_FIXES = {
    401: "the engine wants an API key the predictor does not send: open its /tokenize without one, or give "
         "serve --tokenizer MODEL=DIR to tokenize locally",
    403: "the engine wants an API key the predictor does not send: open its /tokenize without one, or give "
         "serve --tokenizer MODEL=DIR to tokenize locally",
    404: "the engine has no /tokenize for this model there: check the engine URL (--engine-url or its fleet "
         "record) and that it serves the model",
    429: "the engine is rate-limiting: retry later, or give serve --tokenizer MODEL=DIR to tokenize locally",
}


def _likely_fix(status: int) -> str:
    """A hint for a server-side 4xx, so an operator reading the 503 knows what to change; none for a 5xx."""
    if 400 <= status < 500:
        return "; " + _FIXES.get(status, "a server-side refusal, not the input's: check the engine's set-up")
    return ""


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
