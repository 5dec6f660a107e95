"""The fleet as the ingesters describe it in Valkey (``kvpf:fleet``, ``kvpf:load``), re-read every ~1 s.

With this a predictor given only ``--valkey-url`` knows every pod: which are retired (never offered
again), unreachable (not routed to), which models each serves, which engine URL tokenizes for a
model, and each pod's load with its age. Load is scraped once per pod for the whole fleet by the pod's
owning ingester; its age is measured on Valkey's clock (``at_ms`` against the view's ``now_ms``) plus
the local time since the view was read, so no two hosts' clocks are compared. A route reads the last
view from memory; a Valkey outage leaves the last view in place (and its loads turn stale).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.freshness import (UNKNOWN_POD, PodFreshness, fleet_health, leases_by_pod,
                                                       pod_freshness)
from kv_preflight.fleet.records import FleetView
from kv_preflight.index.index import VALKEY_ERRORS, Index

log = logging.getLogger("kvpf.predictor")


@dataclass
class FleetWatcher:
    index: Index
    interval_s: float = 1.0
    timeout_s: float = 2.0
    clock: Callable[[], float] = time.monotonic
    view: FleetView | None = None
    read_at: float = 0.0  # local monotonic time of the last successful read
    reads: int = 0
    read_errors: int = 0
    failing: str | None = None  # the last read error, while reads fail
    _models: dict[str, frozenset[str]] = field(default_factory=dict)
    _fresh: dict = field(default_factory=dict)  # pod -> its PodFreshness as of the view (predictor/scoring/freshness.py)

    async def run(self) -> None:
        task = asyncio.current_task()
        while True:
            started = self.clock()
            await self.read_once()
            if task is not None and task.cancelling():
                # a cancel that arrived mid-read can be swallowed below us (redis-py, asyncio.timeout on
                # 3.11): honour it here, or the process's shutdown waits on this task forever
                raise asyncio.CancelledError
            await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))

    async def read_once(self) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                view = await self.index.fleet.fleet_view()
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self.read_errors += 1
            if self.failing is None:
                log.warning("fleet: cannot read the fleet records (keeping the last view): %s: %s",
                            type(exc).__name__, exc)
            self.failing = f"{type(exc).__name__}: {exc}"
            return False
        if self.failing is not None:
            log.info("fleet: fleet records readable again")
            self.failing = None
        self.set_view(view)
        return True

    def set_view(self, view: FleetView) -> None:
        self.view, self.read_at = view, self.clock()
        self.reads += 1
        self._models = {p: frozenset(r.models) for p, r in view.pods.items() if r.models}
        listing = leases_by_pod(view)
        # every pod's freshness once per read (a request only looks its pods up): as of the view's time
        self._fresh = pod_freshness(view, listing, view.now_ms, time.time(), listing)

    def freshness(self, pods: Iterable[str]) -> dict[str, PodFreshness]:
        """Each pod's ingestion state (predictor/scoring/freshness.py) as of the last view, ``unknown`` for a
        pod no lease lists; ``aged`` brings one's staleness and lag to now."""
        return {p: self._fresh.get(p, UNKNOWN_POD) for p in pods}

    def listed(self) -> frozenset[str]:
        """The pods some ingester's lease lists (data-parallel ranks among them, before they publish)."""
        return frozenset(self._fresh)

    def aged(self, fresh: PodFreshness) -> PodFreshness:
        """``fresh`` with the time since the view was read added to its staleness and lag."""
        if fresh.staleness_ms is None and fresh.index_lag_ms is None:
            return fresh
        extra = int((self.clock() - self.read_at) * 1000)
        return msgspec.structs.replace(
            fresh, staleness_ms=None if fresh.staleness_ms is None else fresh.staleness_ms + extra,
            index_lag_ms=None if fresh.index_lag_ms is None else fresh.index_lag_ms + extra)

    def health_reasons(self) -> list[str]:
        reasons = fleet_health(self.view)
        if self.failing is not None:
            reasons.append(f"fleet records not readable: {self.failing[:200]}")
        return reasons

    # ---- what routing and prediction ask

    def known(self) -> frozenset[str]:
        """Pods with a fleet record that are not retired."""
        return frozenset(self.view.offered()) if self.view else frozenset()

    @property
    def ready(self) -> bool:
        """Whether the records were read at least once: until then no pod or model is known."""
        return self.view is not None

    def models(self) -> frozenset[str]:
        """Every model a pod's record lists, retired pods aside."""
        retired = self.retired()
        return frozenset(m for p, ms in self._models.items() if p not in retired for m in ms)

    def retired(self) -> frozenset[str]:
        if self.view is None:
            return frozenset()
        return frozenset(p for p, r in self.view.pods.items() if r.state == "retired")

    def unreachable(self) -> frozenset[str]:
        if self.view is None:
            return frozenset()
        return frozenset(p for p, r in self.view.pods.items() if r.state == "unreachable")

    def models_of(self, pod_id: str) -> frozenset[str] | None:
        """The models a pod's record lists (base and LoRA names); None when it lists none yet."""
        return self._models.get(pod_id)

    def base_of(self, adapter: str) -> str | None:
        """The base model of a LoRA adapter a pod's record lists (records list the base first, then its adapters,
        as the engine's /v1/models does); None when none lists it as an adapter."""
        if self.view is None:
            return None
        for record in self.view.pods.values():
            if adapter in record.models[1:]:
                return record.models[0]
        return None

    def serving(self, model: str) -> frozenset[str]:
        """Pods, not retired, whose record lists ``model``."""
        retired = self.retired()
        return frozenset(p for p, ms in self._models.items() if model in ms and p not in retired)

    def engines_of(self, model: str) -> list[str]:
        """Engine URLs of the live pods serving ``model`` (sorted by pod, one per URL): tokenization targets."""
        if self.view is None:
            return []
        urls = [r.engine_url.rstrip("/") for p, r in sorted(self.view.pods.items())
                if r.state == "live" and r.engine_url and model in r.models]
        return list(dict.fromkeys(urls))

    def load(self, pod_id: str, stale_s: float) -> PodLoad | None:
        """The pod's shared load if younger than ``stale_s`` (as the local scraper's PodLoad), else None."""
        if self.view is None:
            return None
        ld = self.view.load.get(pod_id)
        age = self.view.load_age_s(pod_id)
        if ld is None or age is None:
            return None
        now = self.clock()
        age += now - self.read_at
        if age > stale_s:
            return None
        return PodLoad(ld.running, ld.waiting, min(max(ld.kv_usage, 0.0), 1.0), at=now - age)

    def status(self, stale_s: float) -> dict:
        """For /stats: each pod's state and load age, and whether the records are being read."""
        out: dict = {"reads": self.reads, "read_errors": self.read_errors, "error": self.failing, "pods": {}}
        if self.view is None:
            return out
        now = self.clock()
        for pod, r in sorted(self.view.pods.items()):
            age = self.view.load_age_s(pod)
            out["pods"][pod] = {
                "state": r.state, "engine_url": r.engine_url, "models": r.models, "owner": r.owner,
                "load_age_s": None if age is None else round(age + now - self.read_at, 3),
                "load_fresh": self.load(pod, stale_s) is not None,
            }
        return out
