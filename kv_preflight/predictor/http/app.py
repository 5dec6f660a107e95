"""HTTP routes of the predictor: thin adapters between Starlette and the Predictor.

All state (Valkey client, engine client, caches, counters) hangs off
``app.state.predictor``, created by ``create_app`` so each worker process owns its own.
Request limits (media type, size, read time, pods filter, JSON depth) are enforced in
predictor/http/body.py and predictor/request.py; the time to send headers in predictor/http/protocols.py.
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from kv_preflight.collector import tuned_collector
from kv_preflight.predictor.http.auth import ApiKeyAuth, load_api_keys
from kv_preflight.predictor.http.body import read_json_body
from kv_preflight.predictor.errors import PredictorError, RequestTimeout
from kv_preflight.predictor.explain.handler import explain as explain_request, parse_explain
from kv_preflight.predictor.http.openapi import openapi_document
from kv_preflight.predictor.request import parse_keyed, parse_request
from kv_preflight.predictor.index_gauges import IndexReadings, fleet_numbers, read_index_numbers
from kv_preflight.predictor.prediction import Predictor
from kv_preflight.predictor.settings import SettingsMismatch, read_index_settings, reconcile, refusal
from kv_preflight.predictor.stats import StatsQuery
from kv_preflight.config import Config
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.layout_version import check_layout
from kv_preflight.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

log = logging.getLogger("kvpf.predictor")

_encoder = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status_code=status, media_type="application/json")


def error_response(predictor: Predictor, exc: PredictorError) -> Response:
    predictor.counters.errors[exc.kind] += 1
    if exc.kind == "valkey":
        predictor.metrics.valkey_errors.inc()
    response = json_response({"error": exc.message}, exc.status)
    if isinstance(exc, RequestTimeout):
        response.headers["connection"] = "close"  # the rest of a late body must not be read as a next request
    return response


def client_gone(request: Request, endpoint: str) -> Response:
    """A client that disconnected mid-body: its own doing, so counted as such, and one log line, no traceback."""
    predictor: Predictor = request.app.state.predictor
    predictor.counters.errors["client_disconnect"] += 1
    predictor.metrics.client_disconnects.inc()
    client = request.client
    log.info("client %s disconnected before sending the whole %s request body",
             f"{client.host}:{client.port}" if client else "?", endpoint)
    return json_response({"error": "client disconnected"}, 400)  # nobody reads it: the connection is gone


def _observe(predictor: Predictor, endpoint: str, outcome: str, started: float, answer: Any = None) -> None:
    """A request's latency and outcome, its answer's freshness state, and what its lookups added to the index's
    counters."""
    predictor.metrics.request(endpoint, outcome, time.perf_counter() - started)
    freshness = getattr(answer, "freshness", None)
    if freshness is not None:
        predictor.metrics.answered(endpoint, freshness.state)
    index = predictor.index
    predictor.metrics.index_counts(index.gap_walks, index.foreign_reads, index.late_reads)
    _engine_counts(predictor)


def _engine_counts(predictor: Predictor) -> None:
    """The engines' faults this process counted (failed scrapes, tokenize failovers), into the metrics."""
    load = predictor.load
    predictor.metrics.engine_counts(load.scrape_errors if load is not None else 0, predictor.tokenizer.failovers)


async def _answer(request: Request, endpoint: str, keyed_fn, parsed_fn, cached_tokens) -> Response:
    """Shared by predict and route: the token_ids fast path (one C pass over the raw JSON) when the
    body allows it, the full parser (which explains any error) otherwise; metrics either way."""
    predictor: Predictor = request.app.state.predictor
    started = time.perf_counter()
    cfg = predictor.cfg
    try:
        body = await read_json_body(request, limit=cfg.max_body_bytes, timeout_s=cfg.request_read_timeout_s)
        keyed = parse_keyed(body, max_tokens=cfg.max_tokens, hash_seed=cfg.hash_seed, block_size=cfg.block_size,
                            max_pods=cfg.max_pods_filter) if cfg.hash_algo == "fnv64a" else None  # C: FNV only
        if keyed is not None:
            result = await keyed_fn(predictor, keyed)
        else:
            result = await parsed_fn(predictor, parse_request(body, max_tokens=cfg.max_tokens,
                                                              max_pods=cfg.max_pods_filter))
    except PredictorError as exc:
        _observe(predictor, endpoint, exc.kind, started)
        return error_response(predictor, exc)
    except ClientDisconnect:
        return client_gone(request, endpoint)
    _observe(predictor, endpoint, "hit" if cached_tokens(result) else "miss", started, result)
    return json_response(result)


async def predict(request: Request) -> Response:
    response = await _answer(request, "predict", Predictor.predict_keyed, Predictor.predict,
                             lambda p: p.predicted_cached_tokens)
    if response.status_code == 200:
        request.app.state.predictor.counters.predictions += 1
    return response


async def route(request: Request) -> Response:
    """The pod to send this request to, and why (predictor/scoring/route.py, docs/routing.md)."""
    return await _answer(request, "route", Predictor.route_keyed, Predictor.route, lambda d: d.cached_tokens)


async def explain(request: Request) -> Response:
    """Why this prompt would (not) hit, optionally against the earlier ``compare`` one (predictor/explain/handler.py)."""
    predictor: Predictor = request.app.state.predictor
    started = time.perf_counter()
    cfg = predictor.cfg
    try:
        body = await read_json_body(request, limit=cfg.max_body_bytes, timeout_s=cfg.request_read_timeout_s)
        req, other = parse_explain(body, max_tokens=cfg.max_tokens, max_pods=cfg.max_pods_filter)
        result = await explain_request(predictor, req, other)
    except PredictorError as exc:
        _observe(predictor, "explain", exc.kind, started)
        return error_response(predictor, exc)
    except ClientDisconnect:
        return client_gone(request, "explain")
    _observe(predictor, "explain", "hit" if result.predicted_cached_tokens else "miss", started, result)
    return json_response(result)


async def metrics(request: Request) -> Response:
    """The counters, and the fleet and the index in numbers as this worker reads them (predictor/index_gauges.py:
    within half a second whatever Valkey does; with Valkey down a while, the index's part is left out)."""
    predictor: Predictor = request.app.state.predictor
    gauges = fleet_numbers(predictor.fleet)
    gauges.index = await request.app.state.index_readings.latest()
    _engine_counts(predictor)
    return Response(predictor.metrics.exposition(gauges), media_type=METRICS_CONTENT_TYPE)


async def metrics_pods(request: Request) -> Response:
    """The index's series per pod (blocks, memory; the pods holding most), apart from /metrics, which has none."""
    predictor: Predictor = request.app.state.predictor
    gauges = fleet_numbers(None)
    gauges.index = await request.app.state.index_readings.latest()
    return Response(predictor.metrics.pods_exposition(gauges), media_type=METRICS_CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


async def health(request: Request) -> Response:
    predictor: Predictor = request.app.state.predictor
    ok, why = await predictor.healthy()
    if ok:  # it can answer (200); whether its answers may be stale is the body's (docs/routing.md "Freshness")
        reasons = predictor.fleet.health_reasons() if predictor.fleet is not None else []
        return json_response({"status": "degraded", "reasons": reasons} if reasons else {"status": "ok"})
    return json_response({"status": "unavailable", "error": why}, 503)


async def ready(request: Request) -> Response:
    """Readiness, for routers and probes: 503 until the fleet records are read (a request for a model then
    answers 503 too, never a 400 that says the model is unknown) and while Valkey does not answer."""
    predictor: Predictor = request.app.state.predictor
    ok, why = await predictor.ready()
    if ok:
        return json_response({"status": "ready"})
    return json_response({"status": "not ready", "error": why}, 503)


async def stats(request: Request) -> Response:
    """A summary and one page of pods (``pods_offset``, ``pods_limit``), or one pod (``pod``): predictor/stats.py."""
    predictor: Predictor = request.app.state.predictor
    try:
        return json_response(await predictor.stats(StatsQuery.parse(request.query_params)))
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
        # Start-up: one line per dependency with its state, also when it is down (engines: predictor/load.py).
        where = cfg.valkey_url.split("@")[-1]
        try:
            # An index of another layout version is refused before serving (kv-preflight index migrate).
            version = await check_layout(predictor.index.client)
            log.info("start-up: Valkey %s: up, index layout %s", where, version)
        except VALKEY_ERRORS as exc:  # Valkey down: serve 503s now, the index is read when it is back
            log.warning("start-up: Valkey %s: unreachable (%s); predictions answer 503 until it is back, "
                        "index layout not checked yet", where, exc)
        # Hash seed, block size, entry format: the index's unless given explicitly (predictor/settings.py).
        found = await read_index_settings(predictor.index.fleet, predictor.valkey_deadline_s)
        cfg_now, adopted, problems = reconcile(predictor.cfg, found)
        if problems:
            log.error("%s", refusal(problems))
            raise SettingsMismatch(refusal(problems))
        if adopted:
            log.info("adopted the index's settings: %s", ", ".join(adopted))
            predictor.cfg = cfg_now
            predictor.index.entry_format = cfg_now.entry_format
        if predictor.fleet is not None:
            await predictor.fleet.read_once()  # routes and tokenization know the fleet from the first request
            tasks.append(asyncio.create_task(predictor.fleet.run()))
        if predictor.tokenization.pending():
            # before serving: a model whose local tokenizer disagrees with its engine must not be used
            await predictor.tokenization.run_checks()
            if predictor.tokenization.pending():
                tasks.append(asyncio.create_task(predictor.tokenization.keep_checking()))
        for model, tok in predictor.tokenization.status().items():
            log.info("start-up: tokenizer for %s: %s (check %s)%s", model, tok["source"], tok["check"],
                     f": {tok['detail']}" if tok.get("detail") else "")
        if predictor.load is not None:
            tasks.append(asyncio.create_task(predictor.load.run()))
        try:
            with tuned_collector():  # what the worker imported and loaded by now: out of every pass (collector.py)
                yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await app.state.index_readings.aclose()
            await predictor.aclose()

    middleware = []
    if keys:
        middleware.append(Middleware(ApiKeyAuth, keys=keys, on_reject=predictor.metrics.unauthorized.inc))
    app = Starlette(
        routes=[
            Route("/v1/cache/predict", predict, methods=["POST"]),
            Route("/v1/cache/route", route, methods=["POST"]),
            Route("/v1/cache/explain", explain, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/metrics/pods", metrics_pods, methods=["GET"]),
            Route("/openapi.json", openapi, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
    )
    app.state.predictor = predictor
    app.state.index_readings = IndexReadings(lambda: read_index_numbers(predictor.index),
                                             timeout_s=predictor.valkey_deadline_s * 4)
    app.state.openapi = msgspec.json.encode(openapi_document(cfg, auth=bool(keys)))
    return app
