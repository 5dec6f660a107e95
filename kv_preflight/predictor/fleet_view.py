"""The fleet as the ingesters describe it in Valkey (``kvpf:fleet``, ``kvpf:load``), re-read every ~1 s.

With this a predictor given only ``--valkey-url`` knows every pod: which are retired (never offered
again), unreachable (not routed to, never a current holder), which models each serves, which engine URL
tokenizes for a model, and each pod's load with its age. Load is scraped once per pod for the whole fleet by the
pod's owning ingester; its age is measured on Valkey's clock (``at_ms`` against the view's ``now_ms``) plus
the local time since the view was read, so no two hosts' clocks are compared. The pods' freshness is judged the
same way, at the view's Valkey time brought forward by the local clock: a lease nobody renewed since ages in
every answer, whether its ingester froze or this predictor can no longer read the leases. A route reads the last
view from memory; a Valkey outage leaves the last view in place (its loads turn stale, its leases age, and
every answer says the records could not be read).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.freshness import (UNKNOWN_POD, PodFreshness, accounted_pods, fleet_health,
                                                       leases_by_pod, next_turn_ms, pod_freshness)
from kv_preflight.fleet.records import FleetView
from kv_preflight.index.index import VALKEY_ERRORS, Index

log = logging.getLogger("kvpf.predictor")
REREAD_MIN_S = 0.25  # reads of the records an unlisted holder asks for (``catch_up``): at most one this often
REREAD_WAIT_S = 0.2  # how long an answer waits for such a read before it goes on with the last view


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
    _by_state: dict[str, frozenset[str]] = field(default_factory=dict)  # record state -> its pods
    _engines: dict[str, list[str]] = field(default_factory=dict)  # model -> engines_of(model), for this view
    _fresh: dict = field(default_factory=dict)  # pod -> its PodFreshness at _as_of_ms (predictor/scoring/freshness.py)
    _as_of_ms: int = 0  # the Valkey time _fresh was judged at
    _listed: frozenset[str] = frozenset()  # the pods some lease lists
    _turn_ms: int | None = None  # when a lease's account turns next (late, expired): _fresh is judged again then
    _reading: asyncio.Future | None = None  # a read ``catch_up`` started, while under way
    _reread_at: float = float("-inf")  # local monotonic time ``catch_up`` last started one

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

    async def catch_up(self, holders: Iterable[str]) -> None:
        """Read the records again now when a pod holding blocks of the prompt is one the last read knows nothing
        of: an engine just attached, whose ingester put a lease listing it before its first write
        (ingester/lease.py ``vouch``), would otherwise read ``unknown`` (its hits not routed by) for up to
        ``interval_s``. A pod no ingester vouches for stays unknown at the cost of one read per ``REREAD_MIN_S``
        across all requests; an answer waits at most ``REREAD_WAIT_S`` for it, then uses the last view."""
        fresh = self._fresh
        if self.view is not None and all(p in fresh for p in holders):
            return
        if self._reading is None or self._reading.done():
            if self.clock() - self._reread_at < REREAD_MIN_S:
                return
            self._reread_at = self.clock()
            self._reading = asyncio.ensure_future(self.read_once())
        try:
            await asyncio.wait_for(asyncio.shield(self._reading), REREAD_WAIT_S)
        except TimeoutError:
            pass  # the read goes on in the background; this answer uses the last view

    def set_view(self, view: FleetView) -> None:
        self.view, self.read_at = view, self.clock()
        self.reads += 1
        self._models = {p: frozenset(r.models) for p, r in view.pods.items() if r.models}
        self._engines = {}
        by_state: dict[str, set[str]] = {}
        for pod, record in view.pods.items():
            by_state.setdefault(record.state, set()).add(pod)
        self._by_state = {state: frozenset(pods) for state, pods in by_state.items()}  # asked once per request
        self._judge(view.now_ms)

    def _judge(self, now_ms: int) -> None:
        """Every pod's freshness at ``now_ms``, once per read and once per turn of a lease (a request only looks
        its pods up): between turns only the staleness grows, which ``aged`` adds."""
        view = self.view
        assert view is not None
        listing = leases_by_pod(view)
        self._listed = frozenset(listing)
        self._fresh = pod_freshness(view, accounted_pods(view, listing), now_ms, time.time(), listing)
        self._as_of_ms, self._turn_ms = now_ms, next_turn_ms(view, now_ms)

    def now_ms(self) -> int:
        """Valkey's time now, as this process knows it: the last view's plus the local time since it was read."""
        assert self.view is not None
        return self.view.now_ms + int((self.clock() - self.read_at) * 1000)

    def freshness(self, pods: Iterable[str]) -> dict[str, PodFreshness]:
        """Each pod's ingestion state (predictor/scoring/freshness.py) now, ``unknown`` for a pod no lease lists
        and no record marks: judged again first if a lease has turned since (late, expired). Its staleness and lag
        are as of that judgement: ``aged`` brings one to now (an answer ages only the pods it lists)."""
        if self.view is None:
            return {p: UNKNOWN_POD for p in pods}
        if self._turn_ms is not None and self.now_ms() >= self._turn_ms:
            self._judge(self.now_ms())
        fresh = self._fresh
        return {p: fresh.get(p, UNKNOWN_POD) for p in pods}

    def listed(self) -> frozenset[str]:
        """The pods some ingester's lease lists (data-parallel ranks among them, before they publish)."""
        return self._listed

    def aged(self, fresh: PodFreshness) -> PodFreshness:
        """``fresh`` (as of the last judgement) with the time since added to its staleness and lag."""
        return _aged(fresh, self.now_ms() - self._as_of_ms) if self.view is not None else fresh

    def problem(self) -> str | None:
        """Why every pod's account may be old (the records have not been read lately, or ever), for every answer's
        freshness; None while reads succeed. A read is due every ``interval_s`` and given ``timeout_s``."""
        if self.view is None:
            return f"the fleet records were never read ({self.failing[:200]})" if self.failing else None
        age_ms = int((self.clock() - self.read_at) * 1000)
        if self.failing is None and age_ms <= (2 * self.interval_s + self.timeout_s) * 1000:
            return None
        why = self.failing[:200] if self.failing else "a read has not answered"
        return (f"the fleet records (ingester leases, pod records) not read for {age_ms} ms ({why}): each pod's "
                "account is as of the last successful read")

    def health_reasons(self) -> list[str]:
        reasons = fleet_health(self.view, self.now_ms() if self.view is not None else None)
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
        return self._by_state.get("retired", frozenset())

    def unreachable(self) -> frozenset[str]:
        return self._by_state.get("unreachable", frozenset())

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
        """Engine URLs of the live pods serving ``model`` (sorted by pod, one per URL): tokenization targets. Kept
        per view (asked on every request a model check makes: a sort of every pod's record each time), not to be
        changed by the caller."""
        if self.view is None:
            return []
        known = self._engines.get(model)
        if known is None:
            urls = [r.engine_url.rstrip("/") for p, r in sorted(self.view.pods.items())
                    if r.state == "live" and r.engine_url and model in r.models]
            known = self._engines[model] = list(dict.fromkeys(urls))
        return known

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


def _aged(fresh: PodFreshness, extra_ms: int) -> PodFreshness:
    """``fresh`` with ``extra_ms`` added to its staleness and lag."""
    if extra_ms <= 0 or (fresh.staleness_ms is None and fresh.index_lag_ms is None):
        return fresh
    return msgspec.structs.replace(
        fresh, staleness_ms=None if fresh.staleness_ms is None else fresh.staleness_ms + extra_ms,
        index_lag_ms=None if fresh.index_lag_ms is None else fresh.index_lag_ms + extra_ms)
