"""The gateway's routes, on top of the predictor's app (the same /v1/cache/*, /health, /ready, /stats, /metrics).

Per request (``Gateway.proxy``): the body is read within ``--max-body-bytes`` and the read timeout, what
routing needs is read from it (gateway/openai.py), tokenized once and decided by ``/route``'s code
(``Predictor.request_keys``, ``Predictor.route_keys``); the body goes to the chosen pod's engine as sent and
its answer comes back byte for byte, with ``x-kvpf-pod``, ``x-kvpf-predicted-cached-tokens`` and
``x-kvpf-reason``. A failure before the answer's first byte is retried once on the next candidate (the pod
avoided meanwhile, the fleet told when it refused the connection). A client that goes away cancels the
upstream request: the connection to the engine is closed, which the engine takes as an abort.

When the index cannot decide (Valkey down, the prompt not tokenizable here) the request still goes out, to a
pod known to serve the model, by load then prompt hash (``x-kvpf-reason: not_indexed``): a router that
fails requests because its index is down would be worse than no router.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kv_preflight.config import Config
from kv_preflight.index.index import Index
from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.routed import RoutedStore, keys_blob
from kv_preflight.predictor.gateway.approximate import IDLE_MS, Approximations
from kv_preflight.predictor.gateway.booking import Booking, Bookings
from kv_preflight.predictor.gateway.engines import GatewayEngines, tell_unreachable
from kv_preflight.predictor.gateway.forward import Cut, Response, Upstream, UpstreamFailed, answer_headers
from kv_preflight.predictor.gateway.metrics import GatewayMetrics
from kv_preflight.predictor.gateway.openai import Routable, error_body, read_routable
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.http.auth import load_api_keys
from kv_preflight.predictor.http.body import read_json
from kv_preflight.predictor.errors import (BadRequest, EngineUnavailable, IndexUnavailable, NotReady,
                                                PredictorError, UnknownModel, clip)
from kv_preflight.predictor.load import LoadMonitor
from kv_preflight.predictor.prediction import Predictor
from kv_preflight.predictor.routed import RoutedState
from kv_preflight.predictor.scoring.route import RouteDecision, decide
from kv_preflight.predictor.scoring.score import Prediction

log = logging.getLogger("kvpf.gateway")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# a prompt its pod already holds to within this many tokens gains nothing from speculative entries (the engine
# recomputes its last block anyway; two blocks of 32 on vLLM CPU): the write, 4K-token prompts' largest, is skipped
SPECULATE_MARGIN = 64
_JSON = (b"content-type", b"application/json")


class _Decided(msgspec.Struct):
    """A route decided for one request, with what deciding again needs (the keys: tokenized once)."""

    decision: RouteDecision
    model: str
    keys: list[int]
    n_tokens: int
    indexed: bool  # False: by load and hash, the index could not decide


class _OnSent:
    """What a request leaves in its pod's cache, written once its bytes are on their way to the engine (``sent``,
    called by the upstream client; once, whatever the client's own retry): a pod whose engine could not be reached
    never holds the prompt's speculative or approximate entries."""

    __slots__ = ("write",)

    def __init__(self, write: Callable[[], None]) -> None:
        self.write: Callable[[], None] | None = write

    def sent(self) -> None:
        if self.write is not None:
            write, self.write = self.write, None
            write()


class Gateway:
    def __init__(self, cfg: Config, predictor: Predictor, engines: GatewayEngines, routed: RoutedState,
                 metrics: GatewayMetrics, *, own_keys: bool = False):
        self.cfg, self.predictor, self.engines, self.routed, self.metrics = cfg, predictor, engines, routed, metrics
        self.own_keys = own_keys  # the gateway checks API keys: a client's Authorization is the gateway's, kept here
        self.upstream: Upstream | None = None
        self.bookings: Bookings | None = None  # set in running(); None: --gateway-booking-ttl 0
        self.speculative_ms = int(cfg.gateway_speculative_ttl_s * 1000)
        self.approximations: Approximations | None = None  # set in running()
        self.inflight = 0
        self.background: set[asyncio.Task] = set()

    # ---- the ASGI endpoints

    def endpoint(self, path: str) -> "_Asgi":
        chat = path == CHAT
        return _Asgi(lambda scope, receive, send: self.proxy(scope, receive, send, path=path, chat=chat,
                                                             name="chat" if chat else "completions"))

    async def proxy(self, scope: Scope, receive: Receive, send: Send, *, path: str, chat: bool, name: str) -> None:
        cfg = self.cfg
        try:
            body = await read_json(scope, receive, limit=cfg.max_body_bytes, timeout_s=cfg.request_read_timeout_s)
            settings = self.predictor.cfg  # the index's hash seed and block size, adopted at start
            routable = read_routable(body, chat=chat, max_tokens=cfg.max_tokens, hash_seed=settings.hash_seed,
                                     block_size=settings.block_size, hash_algo=settings.hash_algo)
        except ClientDisconnect:
            self.metrics.request(name, "client_gone")
            return
        except PredictorError as exc:
            self.metrics.request(name, "bad_request")
            await _error(send, exc.status, exc.message, "BadRequestError" if exc.status < 500 else exc.kind)
            return
        if self.inflight >= cfg.gateway_max_inflight:
            self.metrics.request(name, "busy")
            await _error(send, 503, f"the gateway has {self.inflight} requests in flight, its limit "
                                    "(--gateway-max-inflight); retry", "ServiceUnavailableError", retry_after=True)
            return
        self.inflight += 1
        self.metrics.inflight.inc()
        task = asyncio.current_task()
        sending = [True]  # False once the answer's last byte went out: the watcher must not cancel after it

        def client_left(_: asyncio.Future) -> None:
            if sending[0] and task is not None:
                task.cancel()

        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(client_left)
        try:
            outcome = await self._exchange(send, scope, path, body, routable, sending)
        except asyncio.CancelledError:
            if not watcher.done():
                raise
            outcome = "client_gone"  # the connection to the engine was closed on the way out: an abort there
            if task is not None:
                task.uncancel()
        finally:
            sending[0] = False
            watcher.cancel()
            self.inflight -= 1
            self.metrics.inflight.dec()
        self.metrics.request(name, outcome)

    # ---- one request's decision, upstream exchange and answer

    async def _exchange(self, send: Send, scope: Scope, path: str, body: bytes, routable: Routable,
                        sending: list[bool]) -> str:
        started = time.perf_counter()
        try:
            decided = await self._decide(routable, body)
        except PredictorError as exc:
            kind = ("NotFoundError" if isinstance(exc, UnknownModel) else
                    "BadRequestError" if exc.status < 500 else "ServiceUnavailableError")
            await _error(send, 404 if isinstance(exc, UnknownModel) else exc.status, exc.message, kind,
                         retry_after=exc.status == 503)
            return exc.kind
        headers = scope["headers"]
        if self.own_keys:
            headers = [(k, v) for k, v in headers if k != b"authorization"]
        failed: str | None = None
        booking: Booking | None = None
        try:
            while True:
                decision = decided.decision
                pod = decision.pod_id
                if pod is None:
                    await _error(send, 503, f"no pod to send this request to: {decision.detail}",
                                 "ServiceUnavailableError", retry_after=True)
                    return "no_pod"
                url = self.engines.url_of(pod)
                self.metrics.decision.observe(time.perf_counter() - started)
                # booked now, so this process's next decisions count it whatever the upstream takes (a connect);
                # what it leaves in the pod's cache once its bytes are on their way (``_OnSent``)
                booking = self._book(decided, routable)
                on_sent = _OnSent(lambda d=decided: self._remember_sent(d))
                try:
                    if url is None:
                        raise UpstreamFailed("no_url", f"no engine URL is known for pod {pod} (no fleet record "
                                                       "names one, no --engine is it)", connect=False)
                    response = await self._open(url + path, body, headers, decision, on_sent.sent)
                except UpstreamFailed as exc:
                    self._release(booking)
                    booking = None
                    self._failed(pod, exc)
                    if failed is None:
                        again = await self._decide_again(decided)
                        if again.decision.pod_id not in (None, pod):
                            self.metrics.retries.inc()
                            failed, decided = pod, again
                            started = time.perf_counter()
                            continue
                    await _error(send, 502, clip(f"pod {pod} failed ({exc.detail})" + (
                        f", after pod {failed} failed" if failed else "")), "BadGatewayError")
                    return "upstream_failed"
                break
            self.metrics.sent(pod)
            try:
                extra = decision_headers(decided.decision, failed)
                await send({"type": "http.response.start", "status": response.status_code,
                            "headers": answer_headers(response) + extra})
                async for chunk, last in response.aiter_last():
                    if last:
                        sending[0] = False
                    await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            except Cut as exc:  # the engine cut its answer short: so is the client's (no 2nd start)
                log.warning("pod %s: answer cut short: %s: %s", pod, type(exc).__name__, exc)
                self.metrics.failure("cut_short")
            finally:
                await response.aclose()
        finally:
            self._release(booking)  # however the request ended: answered, failed, or its client gone
        return f"{response.status_code // 100}xx"

    def _book(self, decided: _Decided, routable: Routable) -> Booking | None:
        """The request's cost booked on its pod (the prompt's tokens not cached there, and what it will decode),
        written in the background (a failure only counted); None: no bookings here, or nothing decided by the index."""
        if self.bookings is None or not decided.indexed or decided.decision.pod_id is None:
            return None
        d = decided.decision
        decode = routable.max_tokens if routable.max_tokens is not None else self.cfg.gateway_decode_tokens
        return self.bookings.book(d.pod_id, max(0, d.total_prompt_tokens - d.cached_tokens) + max(0, decode))

    def _remember_sent(self, decided: _Decided) -> None:
        """``_remember``, from the upstream client's callback: written (a coroutine run), and whatever goes wrong
        only counted, never raised into the exchange (the engine would see its request abandoned)."""
        try:
            remember = self._remember(decided)
            if remember is not None:
                self._spawn(remember)
        except Exception as exc:  # a bug, not the request's failure
            self.metrics.write_failed("speculative")
            log.warning("what request left in pod %s's cache was not written: %s: %s", decided.decision.pod_id,
                        type(exc).__name__, exc)

    def _remember(self, decided: _Decided):
        """The write of what the request leaves in its pod's cache (kv_preflight/index/routed.py): on a pod no
        ingester feeds, its keys used now (its approximate index); elsewhere, unless the pod holds the prompt to
        within its last ``SPECULATE_MARGIN`` tokens already, its blocks counted there until its events confirm them
        or the TTL lapses (speculative). Written now on the lean connection (its failure counted when it comes), else
        the coroutine that writes it is returned to be run; None: nothing (more) to run."""
        store, d = self.routed.store, decided.decision
        pod = d.pod_id
        if store is None or not decided.indexed or not decided.keys or pod is None:
            return None
        blob = keys_blob(decided.keys)
        if pod in self.routed.approximate and self.approximations is not None:
            capacity = self.approximations.capacity_blocks(pod)
            sent = store.approximate_now(pod, blob, capacity, IDLE_MS)
            if sent is None:
                return self._quietly(store.approximate(pod, blob, capacity, IDLE_MS), "approximate")
            self._counted(sent, "approximate")
            return None
        held = d.cached_tokens > 0 and d.cached_tokens >= d.total_prompt_tokens - SPECULATE_MARGIN
        if self.speculative_ms > 0 and not held:
            sent = store.speculate_now(pod, blob, self.speculative_ms)
            if sent is None:
                return self._quietly(store.speculate(pod, blob, self.speculative_ms), "speculative")
            self._counted(sent, "speculative")
        return None

    def _counted(self, sent: asyncio.Future, what: str) -> None:
        """A write sent already (``RoutedStore.*_now``): its failure counted as ``_quietly``'s are."""
        def done(f: asyncio.Future) -> None:
            if not f.cancelled() and (exc := f.exception()) is not None:
                self.metrics.write_failed(what)
                log.debug("a %s write failed: %s: %s", what, type(exc).__name__, exc)

        sent.add_done_callback(done)

    async def _quietly(self, work, what: str) -> None:
        try:
            async with asyncio.timeout(self.predictor.valkey_deadline_s):
                await work
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self.metrics.write_failed(what)
            log.debug("a %s write failed: %s: %s", what, type(exc).__name__, exc)

    def _release(self, booking: Booking | None) -> None:
        if booking is not None and self.bookings is not None:
            self.bookings.release(booking)

    async def _open(self, url: str, body: bytes, headers: Any, decision: RouteDecision, sent=None) -> Response:
        assert self.upstream is not None
        # data-parallel ranks (docs/routing.md): a decision that names a rank pins the request to it
        return await self.upstream.open(url, body, headers, dp_rank=getattr(decision, "dp_rank", None), sent=sent)

    def _failed(self, pod: str, exc: UpstreamFailed) -> None:
        self.metrics.failure(exc.kind)
        log.warning("pod %s failed a request (%s): %s; avoided for %gs", pod, exc.kind, exc.detail,
                    self.cfg.gateway_avoid_s)
        self.routed.avoid(pod, self.cfg.gateway_avoid_s)
        if exc.connect:  # a 5xx proves the engine answers: its owner's next health check would undo the mark
            self._spawn(self._tell_fleet(pod, f"gateway: {exc.detail}"))

    async def _tell_fleet(self, pod: str, why: str) -> None:
        if await tell_unreachable(self.predictor.index, self.predictor.fleet, pod, why):
            self.metrics.fleet_told.inc()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ---- deciding

    async def _decide(self, routable: Routable, body: bytes) -> _Decided:
        p = self.predictor
        req = routable.request
        try:
            model, keys, n_tokens, _ = await p.request_keys(req)
        except (EngineUnavailable, BadRequest) as exc:
            if isinstance(exc, UnknownModel):
                raise
            # not tokenizable here (no engine answers /tokenize, a template the local tokenizer refuses): the
            # engine is the judge of its input, and a pod that serves the model may still be found
            return self._unrouted(req.model or "", body, "not_tokenized", exc.message)
        except IndexUnavailable as exc:
            return self._unrouted(req.model or "", body, "index_unavailable", exc.message)
        try:
            decision = await p.route_keys(model, keys, n_tokens)
        except IndexUnavailable as exc:
            return self._unrouted(model, body, "index_unavailable", exc.message, n_tokens)
        return _Decided(decision, model, keys, n_tokens, indexed=True)

    async def _decide_again(self, decided: _Decided) -> _Decided:
        """After a failure: the same keys, decided again (the failed pod is avoided now)."""
        if decided.indexed:
            try:
                decision = await self.predictor.route_keys(decided.model, decided.keys, decided.n_tokens)
                return _Decided(decision, decided.model, decided.keys, decided.n_tokens, indexed=True)
            except PredictorError:
                pass
        return self._unrouted(decided.model, b"", "index_unavailable", "deciding again", decided.n_tokens,
                              affinity=decided.keys[0] if decided.keys else 0)

    def _unrouted(self, model: str, body: bytes, why: str, detail: str, n_tokens: int = 0,
                  affinity: int | None = None) -> _Decided:
        """A decision without the index: the pods known to serve ``model`` (fleet records, scraped engines), by
        load then a hash of the body, so one prompt keeps going to one pod."""
        p = self.predictor
        if p.fleet is not None and not p.fleet.ready and not self.engines.named:
            raise NotReady(f"not ready: the fleet records have not been read yet ({detail})")
        pods = set(p.fleet.serving(model)) - p.fleet.unreachable() if p.fleet is not None else set()
        if p.load is not None:
            pods |= set(p.load.serving(model) or ())
        pods = self.routed.usable(pods)
        if affinity is None:
            affinity = int.from_bytes(hashlib.blake2b(body[:4096], digest_size=8).digest(), "big")
        empty = Prediction(predicted_cached_tokens=0, total_prompt_tokens=n_tokens, blocks_total=0, blocks_cached=0,
                           cache_hit_ratio=0.0, best_pod=None, pod_affinities=[])
        decision = decide(empty, pods, {pod: p.load_of(pod) for pod in pods}, policy=p.policy,
                          ttft=p.ttft.for_model(model), affinity_key=affinity)
        decision = msgspec.structs.replace(decision, reason="not_indexed", detail=clip(
            f"{why}: {detail}; by load, then prompt hash ({decision.detail})"))
        self.metrics.not_routed(why)
        return _Decided(decision, model, [], n_tokens, indexed=False)

    # ---- /v1/models

    async def models(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The fleet's models and adapters: each live pod's record (base model first, then its adapters) and
        each scraped engine's own list."""
        p = self.predictor
        base_of: dict[str, str | None] = {}
        view = p.fleet.view if p.fleet is not None else None
        if view is not None:
            for record in view.pods.values():
                if record.state == "retired" or not record.models:
                    continue
                base_of.setdefault(record.models[0], None)
                for adapter in record.models[1:]:
                    base_of.setdefault(adapter, record.models[0])
        if p.load is not None:
            for served in p.load.served.values():
                for m in served:
                    base_of.setdefault(m, None)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kv-preflight",
                 "root": base or m, "parent": base} for m, base in sorted(base_of.items())]
        payload = msgspec.json.encode({"object": "list", "data": data})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [_JSON, (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    # ---- life

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self.upstream = Upstream(self.cfg)
        # the engines' discovery paths and metrics (not the request path): httpx, as the predictor's scrapes
        control = httpx.AsyncClient(timeout=httpx.Timeout(self.cfg.gateway_connect_timeout_s))
        tasks = []
        if self.routed.store is not None and self.cfg.gateway_booking_ttl_s > 0:
            self.bookings = Bookings(self.routed.store, self.routed, self.cfg.gateway_booking_ttl_s,
                                     timeout_s=self.predictor.valkey_deadline_s)
            tasks.append(asyncio.create_task(self.bookings.run()))
        if self.engines.urls:
            await self.engines.resolve_once(control)
            tasks.append(asyncio.create_task(self.engines.run(control)))
        if self.routed.store is not None:
            self.approximations = Approximations(self.predictor, self.engines, self.routed.store, self.routed,
                                                 capacity_tokens=self.cfg.gateway_kv_capacity,
                                                 timeout_s=self.predictor.valkey_deadline_s)
            await self.approximations.refresh(control)
            tasks.append(asyncio.create_task(self.approximations.run(control)))
        try:
            yield
        finally:
            for t in [*tasks, *self.background]:
                t.cancel()
            await asyncio.gather(*tasks, *self.background, return_exceptions=True)
            if self.bookings is not None:
                await self.bookings.aclose()
            await self.upstream.aclose()
            await control.aclose()


def decision_headers(d: RouteDecision, failed: str | None = None) -> list[tuple[bytes, bytes]]:
    """The decision on the answer: the pod as the index names it (a data-parallel rank r >= 1 of pod P is
    ``P@dp<r>``), the tokens predicted cached there, why it was chosen, and the pod that failed first if any."""
    rank = getattr(d, "dp_rank", None)
    pod = d.pod_id if not rank else f"{d.pod_id}@dp{rank}"
    out = [(b"x-kvpf-pod", str(pod).encode()),
           (b"x-kvpf-predicted-cached-tokens", str(d.cached_tokens).encode()),
           (b"x-kvpf-reason", d.reason.encode())]
    if failed is not None:
        out.append((b"x-kvpf-retried-from", failed.encode()))
    return out


async def _disconnected(receive: Receive) -> None:
    """Returns once the client is gone (its body was read whole before this is started)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _error(send: Send, status: int, message: str, kind: str, *, retry_after: bool = False) -> None:
    payload = error_body(message, status, kind)
    headers = [_JSON, (b"content-length", str(len(payload)).encode())]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def create_gateway_app(cfg: Config, index: Index | None = None) -> Starlette:
    """The predictor's app (its routes, API keys, lifespan) with the gateway's routes and life added."""
    app = create_app(cfg, index)
    predictor: Predictor = app.state.predictor
    # on a single node the index's lean connection carries the routed scripts too (kv_preflight/index/routed.py), and
    # what is written on it in one turn of the loop goes in one send: a decision's lookup and the read beside it, the
    # bookings and speculative entries of the requests decided in that turn (kv_preflight/index/resp.py)
    fast = predictor.index.backend.fast
    if fast is not None:
        fast.coalesce = True
    store = RoutedStore(predictor.index.client, fast)
    routed = RoutedState(store=store, deadline_s=predictor.valkey_deadline_s,
                         window_ms=int(cfg.route_placement_window_s * 1000), pending_ms=int(cfg.route_pending_s * 1000))
    predictor.routed = routed
    if predictor.load is None:  # the --engine engines are scraped for load and models once named
        predictor.load = LoadMonitor([], interval_s=cfg.metrics_interval_s,
                                     timeout_s=min(0.8 * cfg.metrics_interval_s, 2.0))
    engines = GatewayEngines(cfg.engines, predictor.fleet, predictor.load, timeout_s=cfg.gateway_connect_timeout_s)
    fleet_engines = predictor.tokenizer.discovered
    predictor.tokenizer.discovered = lambda model: [*(fleet_engines(model) if fleet_engines else ()),
                                                    *engines.urls_serving(model)]
    gateway = Gateway(cfg, predictor, engines, routed, GatewayMetrics(predictor.metrics, cfg.max_pod_series),
                      own_keys=bool(load_api_keys(cfg.api_keys_file, cfg.api_keys)))
    app.router.routes[0:0] = [
        Route(COMPLETIONS, gateway.endpoint(COMPLETIONS), methods=["POST"]),
        Route(CHAT, gateway.endpoint(CHAT), methods=["POST"]),
        Route("/v1/models", _Asgi(gateway.models), methods=["GET"]),
    ]
    predictor_life = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        async with predictor_life(a), gateway.running():
            yield

    app.router.lifespan_context = lifespan
    app.state.gateway = gateway
    return app


class _Asgi:
    """An ASGI callable as a Route endpoint: Starlette takes a function or method for request -> response, an
    object for ASGI."""

    def __init__(self, handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)
