"""HTTP routes of the predictor: thin adapters between Starlette and the Predictor.

All state (Valkey client, engine client, caches, counters) hangs off
``app.state.predictor``, created by ``create_app`` so each worker process owns its own.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from predictor.errors import BadRequest, BodyTooLarge, PredictorError
from predictor.request import parse_keyed, parse_request
from predictor.service import Predictor
from shared.config import Config
from shared.index import Index

log = logging.getLogger("kvpf.predictor")

_encoder = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status_code=status, media_type="application/json")


def error_response(predictor: Predictor, exc: PredictorError) -> Response:
    predictor.counters.errors[exc.kind] += 1
    return json_response({"error": exc.message}, exc.status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed ``limit``: by header, else while streaming."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length {declared!r}") from None
        if size > limit:
            raise BodyTooLarge(f"body of {size} bytes exceeds the limit of {limit} bytes (max_body_bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def predict(request: Request) -> Response:
    predictor: Predictor = request.app.state.predictor
    try:
        body = await read_body(request, predictor.cfg.max_body_bytes)
        cfg = predictor.cfg
        keyed = parse_keyed(body, max_tokens=cfg.max_tokens, hash_seed=cfg.hash_seed, block_size=cfg.block_size)
        if keyed is not None:
            prediction = await predictor.predict_keyed(keyed)
        else:
            prediction = await predictor.predict(parse_request(body, max_tokens=cfg.max_tokens))
    except PredictorError as exc:
        return error_response(predictor, exc)
    predictor.counters.predictions += 1
    return json_response(prediction)


async def health(request: Request) -> Response:
    predictor: Predictor = request.app.state.predictor
    ok, why = await predictor.healthy()
    if ok:
        return json_response({"status": "ok"})
    return json_response({"status": "unavailable", "error": why}, 503)


async def stats(request: Request) -> Response:
    predictor: Predictor = request.app.state.predictor
    try:
        return json_response(await predictor.stats())
    except PredictorError as exc:
        return error_response(predictor, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """404/405 and friends as JSON too, so clients parse one error shape."""
    assert isinstance(exc, HTTPException)
    return json_response({"error": exc.detail}, exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    request.app.state.predictor.counters.errors["internal"] += 1
    return json_response({"error": f"internal error: {type(exc).__name__}"}, 500)


def create_app(cfg: Config, index: Index | None = None) -> Starlette:
    """The ASGI app; ``index`` is for callers that own one (tests), else one is made from ``cfg``."""
    predictor = Predictor.create(cfg, index)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await predictor.aclose()

    app = Starlette(
        routes=[
            Route("/v1/cache/predict", predict, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.predictor = predictor
    return app
