"""Approximate mode: engines no ingester feeds, indexed by what the gateways send them (docs/gateway.md).

An engine whose KV events nobody ingests (events off, an older or managed engine, a rollout under way) would
read as holding nothing, and every prompt sent to it would look new. Each gateway finds such pods once a
second: the engines it knows (its ``--engine`` URLs and the fleet records) that no live ingester's lease lists
and the index's registry does not name. For them the prompts routed there are kept in Valkey, shared by every
gateway (``kvpf:{<pod>}:approximate``, kv_preflight/index/routed.py): each request's keys marked as used now,
at most the engine's KV capacity of them, least recently used first out, as SGLang's approximate radix tree
and Dynamo's capacity-bounded LRU do. The capacity is the engine's (its metrics: the engine adapter's
``read_kv_capacity``, read again every minute) unless ``--gateway-kv-capacity`` sets it; an engine that says
nothing gets ``DEFAULT_CAPACITY_TOKENS``.

Such a pod's freshness reads ``approximate`` and an answer naming it is never ``exact``: the engine may have
evicted sooner, or served traffic that did not come through a gateway (SGLang measured a 2.6x gap to
event-driven routing under cache pressure). When its events start flowing (a lease lists it, the registry
names it) it is exact again, and what was guessed for it is dropped.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from kv_preflight.engines import DEFAULT, engine
from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.routed import RoutedStore
from kv_preflight.predictor.gateway.engines import GatewayEngines
from kv_preflight.predictor.prediction import Predictor
from kv_preflight.predictor.routed import RoutedState
from kv_preflight.predictor.scoring.freshness import UNKNOWN

log = logging.getLogger("kvpf.gateway")

ENGINE = engine(DEFAULT)
DEFAULT_CAPACITY_TOKENS = 131_072  # an engine that does not say its KV capacity, and no --gateway-kv-capacity
CAPACITY_EVERY_S = 60.0  # an engine's capacity is read again this often
IDLE_MS = 3_600_000  # an approximate pod's keys expire after an hour without a request routed there
REFRESH_S = 1.0


@dataclass
class Approximations:
    predictor: Predictor
    engines: GatewayEngines
    store: RoutedStore
    state: RoutedState
    capacity_tokens: int = 0  # --gateway-kv-capacity (0: the engine's)
    timeout_s: float = 2.0
    _capacity: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # pod -> (tokens, block, read at)

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.refresh(client)
            await asyncio.sleep(REFRESH_S)

    def known(self) -> set[str]:
        """The engines this gateway routes to: its --engine pods and every pod a fleet record lists."""
        out = set(self.engines.pods())
        view = self.predictor.fleet.view if self.predictor.fleet is not None else None
        if view is not None:
            out |= {p for p, r in view.pods.items() if r.state != "retired"}
        return out

    async def refresh(self, client: httpx.AsyncClient) -> None:
        p = self.predictor
        known = self.known()
        fed: set[str] = set()
        if p.fleet is not None:
            fed = {pod for pod, f in p.fleet.freshness(known).items() if f.state != UNKNOWN}
        try:
            async with asyncio.timeout(self.timeout_s):
                fed |= await p.metadata.all_pods()  # pods the index has events of (an ingester without a lease)
        except (TimeoutError, *VALKEY_ERRORS):
            return  # Valkey away: keep what was decided last
        guessed = frozenset(known - fed)
        exact_now = self.state.approximate - guessed
        for pod in sorted(guessed - self.state.approximate):
            log.info("pod %s: no ingester feeds it: routed approximately, by what the gateways send it", pod)
        if exact_now:
            log.info("pod(s) %s: their KV events flow now: exact again, their approximate index dropped",
                     ", ".join(sorted(exact_now)))
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self.store.forget_approximate(exact_now & known)
            except (TimeoutError, *VALKEY_ERRORS) as exc:
                log.warning("could not drop the approximate index of %s: %s", sorted(exact_now), exc)
        await asyncio.gather(*(self._read_capacity(client, pod) for pod in guessed))
        self.state.approximate_block_size = {pod: c[1] for pod, c in self._capacity.items() if pod in guessed and c[1]}
        self.state.approximate = guessed

    def capacity_blocks(self, pod: str) -> int:
        """The pod's KV capacity in request-key blocks: how many keys its approximate index keeps."""
        tokens = self.capacity_tokens or self._capacity.get(pod, (DEFAULT_CAPACITY_TOKENS, 0, 0.0))[0]
        return max(1, tokens // self.predictor.cfg.block_size)

    async def _read_capacity(self, client: httpx.AsyncClient, pod: str) -> None:
        known = self._capacity.get(pod)
        if known is not None and time.monotonic() - known[2] < CAPACITY_EVERY_S:
            return
        url = self.engines.url_of(pod)
        found = None
        if url is not None and ENGINE.read_kv_capacity is not None:
            try:
                resp = await client.get(url + "/metrics", timeout=self.timeout_s)
                if resp.status_code == 200:
                    found = ENGINE.read_kv_capacity(resp.text)
            except httpx.HTTPError:
                pass
        tokens, block = found or (DEFAULT_CAPACITY_TOKENS, 0)
        if known is None:
            log.info("pod %s: KV capacity %d tokens%s", pod, self.capacity_tokens or tokens,
                     " (--gateway-kv-capacity)" if self.capacity_tokens else
                     "" if found else " (the engine does not say: the default; --gateway-kv-capacity sets it)")
        self._capacity[pod] = (tokens, block, time.monotonic())
