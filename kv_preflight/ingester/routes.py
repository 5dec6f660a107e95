"""Where each pod's batches come from: its model, its source and replay endpoint, its engine adapter, and
the source of each of its data-parallel ranks; which pod each replay socket served (persisted in the
index, so a restarted ingester replays those pods at start); both names of a pod that ``--pod-id
endpoint`` renames.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kv_preflight.config import Config
from kv_preflight.engines import DEFAULT, Engine, engine
from kv_preflight.events import topic_or_none
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.rank_pods import base_pod, rank_pod
from kv_preflight.ingester.sources import Source
from kv_preflight.ingester.valkey_retry import ValkeyRetry


log = logging.getLogger("kvpf.ingester")


@dataclass
class PodRoute:
    model: str
    replay: str | None = None
    source: str | None = None  # the endpoint its frames arrive on
    engine: str = DEFAULT  # the adapter of its source (kv_preflight/engines/)


class Routes:
    def __init__(self, cfg: Config, index: Index, valkey: ValkeyRetry):
        self.cfg = cfg
        self.index = index
        self.valkey = valkey
        self.pods: dict[str, PodRoute] = {}
        self.forgotten: set[str] = set()  # pods being forgotten (kvpf:forget): their frames are refused
        # (pod, data-parallel rank) -> the source its batches come from: with data parallelism one
        # pod (topic) has one PUB and one replay socket per rank, each rank with its own seq.
        self.rank_sources: dict[tuple[str, int], Source] = {}
        self._feeds: dict[tuple[str, int], tuple[str, str]] = {}  # (replay endpoint, rank) -> (pod, model) persisted
        self._aliased: set[tuple[str, str]] = set()  # (topic pod, serving address) recorded in kvpf:aliases
        self._aliases_due: set[tuple[str, str]] = set()
        self._replays: dict[str, Source] = {}  # replay endpoint -> its source (limits, CURVE keys)
        self._ranks_checked: set[str] = set()  # data-parallel ranks' pods whose pod was checked for merged ranks
        self.on_merged: Callable[[str], None] | None = None  # a pod to rebuild: it held its ranks merged

    def add(self, sources: list[Source]) -> set[str]:
        """Routes for sources whose topic is known (discovered, or named on the source); returns their pods."""
        pods = set()
        for src in sources:
            self._know_replay(src)
            topic = src.named_topic or topic_or_none(src.topic)  # pod=,model= given, or a kv@POD@MODEL topic
            if topic is not None:
                # a discovered engine named by its address keeps its topic's model
                pod = rank_pod(src.pod, src.rank) if src.pod else self.pod_name(src, topic.pod_id, src.rank)
                self.pods[pod] = PodRoute(model=topic.model, replay=src.replay, source=src.endpoint, engine=src.engine)
                pods.add(pod)
                if src.rank is not None:
                    self.rank_sources[(pod, src.rank)] = src
        return pods

    def drop(self, endpoints: set[str]) -> None:
        """Forget the pods and ranks whose frames came from these endpoints (an engine let go)."""
        for pod, route in list(self.pods.items()):
            if route.source in endpoints:
                del self.pods[pod]
        for key, src in list(self.rank_sources.items()):
            if src.endpoint in endpoints:
                del self.rank_sources[key]
        for replay, src in list(self._replays.items()):
            if src.endpoint in endpoints:
                del self._replays[replay]

    def pods_on(self, endpoints: set[str]) -> set[str]:
        """The pods a rank of which is published on one of these source endpoints."""
        if not endpoints:
            return set()
        return ({p for p, r in self.pods.items() if r.source in endpoints}
                | {p for (p, _), s in self.rank_sources.items() if s.endpoint in endpoints})

    def ranks_on(self, endpoint: str) -> list[tuple[str, int]]:
        """(pod, rank) published on this source endpoint, as far as known (rank 0 for a pod with no rank noted)."""
        ranks = {key for key, s in self.rank_sources.items() if s.endpoint == endpoint}
        ranks |= {(p, 0) for p, r in self.pods.items() if r.source == endpoint and not any(k[0] == p for k in ranks)}
        return sorted(ranks)

    def publisher_of(self, pod: str, rank: int) -> str | None:
        """The endpoint of the socket this pod's rank is published on here (the first to publish it, or to be
        attached for it, since the engine or source that brought it was let go), None if none is yet."""
        owner = self.rank_sources.get((pod, rank))
        return owner.endpoint if owner is not None else None

    async def note(self, src: Source, pod: str, model: str, rank: int) -> PodRoute:
        """The route a frame of ``pod`` just arrived on (the model and source it names are the current ones)."""
        route = self.pods.setdefault(pod, PodRoute(model=model, replay=src.replay, source=src.endpoint,
                                                   engine=src.engine))
        route.model = model
        route.source = src.endpoint
        route.engine = src.engine
        if src.replay and not route.replay:
            route.replay = src.replay
        self.rank_sources[(pod, rank)] = src
        self._know_replay(src)
        await self._remember_feed(src, rank, pod, route.model)
        if rank and pod not in self._ranks_checked:
            await self._unmerge(pod, rank)
        return route

    async def _unmerge(self, pod: str, rank: int) -> None:
        """Before data-parallel ranks were pods of their own, every rank was written into its pod: a pod whose meta
        holds this rank's seq holds this rank's blocks too, credited to rank 0. Such a pod is flagged and rebuilt
        once, when its rank first shows up here (``on_merged``: the ingester's rebuild from the engine's seq 0,
        which clears the pod first), so it holds rank 0's blocks alone; it stays flagged if rank 0's replay
        buffer no longer reaches back that far."""
        base = base_pod(pod)
        try:
            info = await self.index.meta.pod_info(base)
            if str(rank) in info.seqs:
                await self.index.meta.mark_incomplete(base, f"held its data-parallel rank {rank}'s blocks; rebuilding")
                log.warning("pod %s holds the blocks of its data-parallel rank %d (written before each rank was "
                            "indexed as a pod of its own, now %s): flagged, and rebuilt from its engine", base, rank,
                            pod)
                if self.on_merged is not None:
                    self.on_merged(base)
            self._ranks_checked.add(pod)
        except VALKEY_ERRORS:
            pass  # checked again with the rank's next frame

    def _know_replay(self, src: Source) -> None:
        if src.replay:
            self._replays[src.replay] = src

    def replay_source(self, endpoint: str) -> Source:
        """The source a replay endpoint belongs to, so its DEALER gets that source's frame and queue limits
        and CURVE keys; a bare source for an endpoint no source here names."""
        return self._replays.get(endpoint) or Source(endpoint)

    def replay_endpoint(self, pod: str, rank: int) -> str | None:
        owner = self.rank_sources.get((pod, rank))
        if owner is not None and owner.replay:
            return owner.replay
        route = self.pods.get(pod)
        return route.replay if route else None

    def engine_of(self, pod: str) -> Engine:
        """The adapter of the pod's source; the default family for a pod with no route (``index rebuild``)."""
        route = self.pods.get(pod)
        return engine(route.engine if route else DEFAULT)

    # ---- pod names (--pod-id endpoint)

    def pod_name(self, src: Source, topic_pod: str, rank: int | None = None) -> str:
        """The pod id written into the index: the topic's (or the source's ``pod=``), each data-parallel rank
        r >= 1 as ``<pod>@dp<r>`` (its own cache: kv_preflight/index/rank_pods.py); or with ``--pod-id
        endpoint`` the rank's serving address as llm-d-router v0.10 names it (one per rank already:
        kv_preflight/engines/endpoints.py ``serving_address``)."""
        if self.cfg.pod_id == "endpoint" and src.serving:
            if (topic_pod, src.serving) not in self._aliased:
                self._aliases_due.add((topic_pod, src.serving))
            return src.serving
        return rank_pod(topic_pod, rank)

    async def write_aliases(self) -> None:
        """Both names of each renamed pod, for pods filters that use either (once per pair and process)."""
        if not self._aliases_due:
            return
        due, self._aliases_due = self._aliases_due, set()
        try:
            await self.index.fleet.add_aliases(due)
            self._aliased |= due
        except VALKEY_ERRORS:
            self._aliases_due |= due  # again with the next message

    # ---- feeds: which pod each replay socket served

    async def _remember_feed(self, src: Source, rank: int, pod: str, model: str) -> None:
        """Persist which pod this source's replay socket serves (once per process and change)."""
        if not src.replay or self._feeds.get((src.replay, rank)) == (pod, model):
            return
        self._feeds[(src.replay, rank)] = (pod, model)
        try:
            await self.index.fleet.remember_feed(src.replay, rank, pod, model)
        except VALKEY_ERRORS:
            self._feeds.pop((src.replay, rank), None)  # written again with the next frame

    async def learn_feeds(self, sources: list[Source]) -> None:
        """Routes for every pod a source of ours served before (persisted by ``note``), so the ingester
        replays them at start (ingester/resume.py), not when the engine next publishes."""
        by_replay = {s.replay: s for s in sources if s.replay}
        for src in by_replay.values():
            self._know_replay(src)
        for replay, rank, pod, model in await self.valkey.call(self.index.fleet.feeds, list(by_replay)):
            src = by_replay[replay]
            self._feeds[(replay, rank)] = (pod, model)
            route = self.pods.setdefault(pod, PodRoute(model=model, replay=replay, source=src.endpoint, engine=src.engine))
            route.replay = route.replay or replay
            self.rank_sources.setdefault((pod, rank), src)
