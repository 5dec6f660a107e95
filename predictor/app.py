"""HTTP routes of the predictor: thin adapters between Starlette and the Predictor.

All state (Valkey client, engine client, caches, counters) hangs off
``app.state.predictor``, created by ``create_app`` so each worker process owns its own.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from predictor.auth import ApiKeyAuth, load_api_keys
from predictor.errors import BadRequest, BodyTooLarge, PredictorError
from predictor.openapi import openapi_document
from predictor.request import parse_keyed, parse_request
from predictor.service import Predictor
from shared.config import Config
from shared.index import Index
from shared.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger("kvpf.predictor")

_encoder = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status_code=status, media_type="application/json")


def error_response(predictor: Predictor, exc: PredictorError) -> Response:
    predictor.counters.errors[exc.kind] += 1
    if exc.kind == "valkey":
        predictor.metrics.valkey_errors.inc()
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


async def _answer(request: Request, endpoint: str, keyed_fn, parsed_fn, cached_tokens) -> Response:
    """Shared by predict and route: the token_ids fast path (one C pass over the raw JSON) when the
    body allows it, the full parser (which explains any error) otherwise; metrics either way."""
    predictor: Predictor = request.app.state.predictor
    started = time.perf_counter()
    try:
        body = await read_body(request, predictor.cfg.max_body_bytes)
        cfg = predictor.cfg
        keyed = parse_keyed(body, max_tokens=cfg.max_tokens, hash_seed=cfg.hash_seed, block_size=cfg.block_size)
        if keyed is not None:
            result = await keyed_fn(predictor, keyed)
        else:
            result = await parsed_fn(predictor, parse_request(body, max_tokens=cfg.max_tokens))
    except PredictorError as exc:
        predictor.metrics.request(endpoint, exc.kind, time.perf_counter() - started)
        return error_response(predictor, exc)
    predictor.metrics.request(endpoint, "hit" if cached_tokens(result) else "miss", time.perf_counter() - started)
    return json_response(result)


async def predict(request: Request) -> Response:
    response = await _answer(request, "predict", Predictor.predict_keyed, Predictor.predict,
                             lambda p: p.predicted_cached_tokens)
    if response.status_code == 200:
        request.app.state.predictor.counters.predictions += 1
    return response


async def route(request: Request) -> Response:
    """The pod to send this request to, and why (predictor/route.py, docs/routing.md)."""
    return await _answer(request, "route", Predictor.route_keyed, Predictor.route, lambda d: d.cached_tokens)


async def metrics(request: Request) -> Response:
    predictor: Predictor = request.app.state.predictor
    return Response(predictor.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


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
    keys = load_api_keys(cfg.api_keys_file, cfg.api_keys)
    predictor = Predictor.create(cfg, index)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        tasks = []
        if predictor.tokenization.pending():
            # before serving: a model whose local tokenizer disagrees with its engine must not be used
            await predictor.tokenization.run_checks()
            if predictor.tokenization.pending():
                tasks.append(asyncio.create_task(predictor.tokenization.keep_checking()))
        if predictor.load is not None:
            tasks.append(asyncio.create_task(predictor.load.run()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await predictor.aclose()

    middleware = []
    if keys:
        middleware.append(Middleware(ApiKeyAuth, keys=keys, on_reject=predictor.metrics.unauthorized.inc))
    app = Starlette(
        routes=[
            Route("/v1/cache/predict", predict, methods=["POST"]),
            Route("/v1/cache/route", route, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.predictor = predictor
    app.state.openapi = msgspec.json.encode(openapi_document(cfg, auth=bool(keys)))
    return app
