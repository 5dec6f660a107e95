"""A per-process, short-lived cache of pod metadata and known models.

A prediction needs each matched pod's engine block size and incomplete flag, and
the set of models the index knows; both change rarely (a restart, a gap), so
keeping them ~1 s saves a Valkey round trip on nearly every request while
reflecting changes within about a second. Concurrent misses for the same pod
share one fetch, so an expiry under load costs one round trip, not one per request;
the misses of one request are read together, pipelined (``PodMeta.pod_infos``), so a
prompt that thousands of pods hold costs a few round trips, not thousands of
concurrent calls (which exhausted the connection pool: a 503).

Only what scoring needs is read (``PodMeta.scoring_infos``: two fields of each pod's meta), and each
pod is renewed at its own point of its ``ttl_s`` (a fraction fixed by its id): pods first read
together are renewed in small groups spread over the interval, not as one read of a thousand pods
that stalls the requests behind it once a second (that lump was the p99 of a fleet-wide prefix).
"""
from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kv_preflight.index.read_side import ReadSide
from kv_preflight.index.pod_meta import ScoringInfo
from kv_preflight.index.rank_pods import RANK_SEPARATOR, base_pod

DEFAULT_TTL_S = 1.0
# A pod is renewed behind the requests once this fraction of its ttl has passed, a fraction
# between these two fixed by its id (so pods read together are renewed apart).
RENEW_FROM, RENEW_SPREAD = 0.35, 0.3
# A model missing from the cached set is re-checked at most this often, so a
# flood of requests for an unknown model cannot turn into a flood of HGETALLs.
MODEL_MISS_RECHECK_S = 0.1


class _SingleFlight:
    """At most one fetch per key at a time; every waiter gets its result or its error."""

    def __init__(self) -> None:
        self._running: dict[Any, asyncio.Task] = {}

    async def run(self, key: Any, fetch: Callable[[], Awaitable[Any]]) -> Any:
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(fetch())
            self._running[key] = task
            task.add_done_callback(lambda t, k=key: self._done(k, t))
        # shield: a waiter that gives up (timeout, disconnect) must not cancel the others' fetch
        return await asyncio.shield(task)

    def _done(self, key: Any, task: asyncio.Task) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an abandoned failure is not logged as "never retrieved"


class IndexMetadata:
    def __init__(self, index: ReadSide, *, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.index = index
        self.ttl_s = ttl_s
        self.clock = clock
        self._pods: dict[str, tuple[float, float, ScoringInfo]] = {}  # pod -> (renew at, expires at, info)
        self._models: frozenset[str] = frozenset()
        self._pod_models: dict[str, str] = {}
        self._pod_adapters: dict[str, dict[str, str]] = {}  # pod -> its adapters (kvpf:adapters), each -> its model
        self._by_model: dict[str, frozenset[str]] = {}  # model -> its pods, made once per read of the registry
        self._models_at: float | None = None
        self._dp_pods: frozenset[str] = frozenset()  # pods with data-parallel ranks, per read of the registry
        self._flight = _SingleFlight()
        self._pod_tasks: dict[str, asyncio.Task] = {}  # pod -> the fetch that is reading it now
        self._renewing: asyncio.Task | None = None  # the renewal behind the requests, if one is running

    async def pod_infos(self, pod_ids: Iterable[str]) -> dict[str, ScoringInfo]:
        """Info for each pod: cached while younger than ``ttl_s``, else fetched (stale pods in one pipelined read).

        An entry past its renewal point (35-65 % of ``ttl_s``, by pod) is answered from the cache and read
        again behind the request, so under steady traffic entries are renewed before they expire: a prompt
        a thousand pods hold would otherwise wait, once a second, for a thousand pods' metadata (tens of
        ms, the p99 of such prompts). A change still shows within ``ttl_s`` (plus one read): an expired
        entry is read first."""
        now = self.clock()
        out: dict[str, ScoringInfo] = {}
        stale: list[str] = []
        behind: list[str] = []
        cached = self._pods.get
        for pod in pod_ids:
            hit = cached(pod)
            if hit is not None and hit[1] > now:
                out[pod] = hit[2]
                if hit[0] <= now:
                    behind.append(pod)
            else:
                stale.append(pod)
        if behind and self._renewing is None:
            # One renewal in flight at a time: under load many requests would each start one (and each
            # take connections on every shard); the pods left due are renewed by the next request after it.
            task = self._renewing = asyncio.ensure_future(self._renew(behind))
            task.add_done_callback(self._renewed)
        if stale:
            out.update(await self._fetch_pods(stale))
        return out

    async def _fetch_pods(self, pods: list[str]) -> dict[str, ScoringInfo]:
        """Pods another request is already fetching are awaited; the rest are read in one pipelined fetch."""
        tasks = self._start_fetch(pods)
        out: dict[str, ScoringInfo] = {}
        for task in dict.fromkeys(tasks.values()):
            # shield: a waiter that gives up (timeout, disconnect) must not cancel the others' fetch
            out.update(await asyncio.shield(task))
        return {pod: out[pod] for pod in pods}

    async def _renew(self, pods: list[str]) -> None:
        for task in dict.fromkeys(self._start_fetch(pods).values()):
            await asyncio.shield(task)

    def _renewed(self, task: asyncio.Task) -> None:
        self._renewing = None
        if not task.cancelled():
            task.exception()  # errors are retrieved here; the entries expire as usual and are read then

    def _start_fetch(self, pods: list[str]) -> dict[str, asyncio.Task]:
        """The fetch reading each pod: one already running, or one new pipelined fetch for the rest."""
        tasks: dict[str, asyncio.Task] = {}
        missing = []
        for pod in pods:
            task = self._pod_tasks.get(pod)
            if task is None:
                missing.append(pod)
            else:
                tasks[pod] = task
        if missing:
            task = asyncio.ensure_future(self._load_pods(missing))
            for pod in missing:
                self._pod_tasks[pod] = tasks[pod] = task
            task.add_done_callback(lambda t, ps=tuple(missing): self._pods_done(ps, t))
        return tasks

    def _pods_done(self, pods: tuple[str, ...], task: asyncio.Task) -> None:
        for pod in pods:
            if self._pod_tasks.get(pod) is task:
                del self._pod_tasks[pod]
        if not task.cancelled():
            task.exception()  # retrieved here so an abandoned failure is not logged as "never retrieved"

    async def known_models(self, wanted: str | None = None) -> frozenset[str]:
        """Models the index has pods for, LoRA adapters included (the adapters its pods' events stored blocks of);
        re-read when older than ``ttl_s`` or when ``wanted`` is missing."""
        if self._models_stale(wanted):
            await self._flight.run("models", self._load_models)
        return self._models

    def _models_stale(self, wanted: str | None = None) -> bool:
        """``known_models``'s rule for reading the registry again: older than ``ttl_s``, or ``wanted`` missing from
        a read older than ``MODEL_MISS_RECHECK_S``."""
        age = None if self._models_at is None else self.clock() - self._models_at
        return age is None or age >= self.ttl_s or (wanted is not None and wanted not in self._models
                                                    and age >= MODEL_MISS_RECHECK_S)

    async def pods_of(self, model: str) -> set[str]:
        """Pods the index lists under ``model`` (their topic's model, or an adapter whose blocks their events
        stored), as fresh as ``known_models``."""
        await self.known_models()
        return set(self.cached_pods_of(model))

    def fresh_pods_of(self, model: str) -> frozenset[str] | None:
        """``pods_of`` when what was read last is fresh enough to answer it without a read, else None."""
        return None if self._models_stale() else self.cached_pods_of(model)

    def cached_pods_of(self, model: str) -> frozenset[str]:
        """``pods_of`` from what was read last, without a read (empty before the first). A frozenset made once
        per read of the registry: every answer asks, and a fleet has thousands of pods."""
        got = self._by_model.get(model)
        if got is None:
            got = self._by_model[model] = frozenset(
                [p for p, m in self._pod_models.items() if m == model]
                + [p for p, adapters in self._pod_adapters.items() if model in adapters])
        return got

    def cached_dp_pods(self) -> frozenset[str]:
        """Pods the registry, as last read, lists data-parallel ranks of (``<pod>@dp<r>``); no read of its own."""
        return self._dp_pods

    def base_of(self, adapter: str) -> str | None:
        """The model of the pods serving a LoRA adapter (the base it adapts), from what was read last; None for a
        name no pod's events stored adapter blocks under."""
        for adapters in self._pod_adapters.values():
            if adapter in adapters:
                return adapters[adapter]
        return None

    def adapters_of(self, model: str) -> frozenset[str]:
        """The LoRA adapters of a base model that the index holds blocks of, from what was read last."""
        return frozenset(a for adapters in self._pod_adapters.values() for a, m in adapters.items() if m == model)

    async def all_pods(self) -> frozenset[str]:
        """Every pod the index's registry lists, as fresh as ``known_models``."""
        await self.known_models()
        return frozenset(self._pod_models)

    async def _load_pods(self, pods: list[str]) -> dict[str, ScoringInfo]:
        infos = await self.index.meta.scoring_infos(pods)
        now = self.clock()
        ttl = self.ttl_s
        for info in infos:
            share = zlib.crc32(info.pod_id.encode()) / 0xFFFFFFFF
            self._pods[info.pod_id] = (now + ttl * (RENEW_FROM + RENEW_SPREAD * share), now + ttl, info)
        if len(self._pods) > 4096:  # pods come and go; never let departed ones pile up
            self._pods = {p: e for p, e in self._pods.items() if e[1] > now}
        return {info.pod_id: info for info in infos}

    async def _load_models(self) -> None:
        pods = await self.index.meta.pod_ids()
        adapters = await self.index.meta.adapters()
        self._pod_models = pods
        self._dp_pods = frozenset(base_pod(p) for p in pods if RANK_SEPARATOR in p)
        self._pod_adapters = {p: a for p, a in adapters.items() if p in pods}  # a pod forgotten meanwhile: not listed
        self._by_model = {}
        self._models = frozenset([m for m in pods.values() if m]
                                 + [a for got in self._pod_adapters.values() for a in got])
        self._models_at = self.clock()
