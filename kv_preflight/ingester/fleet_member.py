"""An ingester's part in the fleet: its lease, the engines it owns, their health, load and records.

Every second (``FleetMember.tick``, from the ingester's chores) an ingester:

1. reads its engine sources (``--engine``, ``--engines-from``, engines registered at run time in
   ``kvpf:engines``), each change held ``--membership-hold`` seconds before it counts;
2. renews its lease in ``kvpf:ingesters`` on Valkey's clock, listing the engines it knows, and reads
   everyone's: the live ingesters and the union of the engines they know;
3. ingests exactly the engines that rendezvous hashing gives it (``--copies`` ingesters per engine),
   letting go of the others; an engine it takes over resumes from the pod's persisted seq by replay;
4. for the engines it is the primary owner of: checks their health, scrapes their load into
   ``kvpf:load``, and keeps their pods' records in ``kvpf:fleet`` (engine URL, models, block size,
   state), which is what lets ``serve --valkey-url URL`` alone know the fleet;
5. retires pods whose engine left every ingester's view, or stayed unreachable ``--retire-after``
   seconds: their entries cleared, their record kept (state, reason, time) for
   ``--retired-retention`` seconds, then dropped; both through the one pod lifecycle
   (fleet/lifecycle.py: every ingester lets the pod go before its keys go), in tasks of their own.

The rules are pure functions in ingester/membership_rules.py; this module does their I/O, its lease (step 2,
and ``vouch``) ingester/lease.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import httpx
import msgspec

from kv_preflight.config import Config
from kv_preflight.engines import DEFAULT
from kv_preflight.engines.endpoints import check_zmq_endpoint
from kv_preflight.ingester.engine_probe import probe
from kv_preflight.ingester.retirement import Retirements
from kv_preflight.events import topic_or_none
from kv_preflight.fleet.records import PodLoad, PodRecord
from kv_preflight.index.rank_pods import RANK_SEPARATOR, rank_pod, split_rank_pod
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.discovery import discover_logged
from kv_preflight.ingester.engines_from import EnginesFrom, observe, parse_engines_from
from kv_preflight.ingester.lease import LeaseHolder
from kv_preflight.ingester.membership_rules import (Debounced, EngineSpec, Health, address_pod_id, after_check,
                                                    balanced_owners)
from kv_preflight.ingester.sources import Source
from kv_preflight.ingester.watchdog import Progress

log = logging.getLogger("kvpf.ingester")

MODELS_EVERY = 10  # ticks between reads of an engine's /v1/models and the pod's block size
RECORD_REFRESH_S = 10.0  # a record unchanged is written again this often (its owner may have changed)
SLOW_ROUND_S = 2.0  # a round slower than this logs where its time went at info (else at debug)


def _given_here(spec: EngineSpec) -> str:
    if spec.origin == "engine":
        return "--engine here"
    if spec.origin == "registered":
        return "registered through the remote-indexer API"
    return f"discovered here by {spec.origin}"


def default_ingester_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class _Attached:
    spec: EngineSpec
    pods: set[str]
    family: str = DEFAULT  # its engine adapter (kv_preflight/engines/): which /metrics series say its load


@dataclass
class _Retry:
    attempts: int = 0
    next_at: float = 0.0

    def backoff(self, now: float) -> None:
        self.attempts += 1
        self.next_at = now + min(30.0, 0.5 * 2 ** min(self.attempts - 1, 6))


class Ingesting(Protocol):
    """What the fleet membership asks of the ingester it belongs to (ingester/ingester.py ``Ingester``)."""

    progress: Progress
    counters: Counters

    def lag_s(self) -> dict[str, float]: ...

    async def attach_engine(self, spec: EngineSpec, found: list[Source]) -> set[str]: ...

    def detach_engine(self, key: str) -> None: ...

    def schedule_rebuild(self, pod: str) -> None: ...

    async def not_reset(self, pod: str, why: str, exc: PodLogError) -> None: ...

    def endpoints(self) -> dict[str, str]: ...

    def pods(self) -> list[str]: ...

    def ingest_state(self) -> tuple[str, list[str]]: ...

    def batch_ts(self) -> dict[str, float]: ...


class FleetMember(LeaseHolder):
    def __init__(self, ingester: Ingesting, cfg: Config, index: Index) -> None:
        self.ing = ingester
        self.index = index
        self.cfg = cfg
        self.me = cfg.ingester_id or default_ingester_id()
        self.static = [EngineSpec(url=u.rstrip("/")) for u in cfg.engines]
        self.sources: list[EnginesFrom] = [parse_engines_from(s) for s in cfg.engines_from]
        self.observed: dict[str, list[EngineSpec]] = {}  # source spec -> its last answer
        self.discovered = Debounced(cfg.membership_hold_s)
        self.next_discovery = 0.0
        self.attached: dict[str, _Attached] = {}  # engine key (URL, or source endpoint) -> what we subscribed
        self.retries: dict[str, _Retry] = {}
        self.unusable: set[str] = set()  # registrations skipped (logged once)
        # HTTP runs in the background, so a slow or dead engine never holds up the ingest loop: the round
        # starts a fetch and uses its answer in a later round.
        self.observing: asyncio.Task | None = None  # --engines-from sources being read (DNS, files)
        self.fetches: dict[str, asyncio.Task] = {}  # engine URL -> /kv_event_sources
        self.probes: dict[str, asyncio.Task] = {}  # engine URL -> /health (+ /metrics, /v1/models)
        # retirements and drops under way, and pods no lease lists (ingester/retirement.py)
        self.retirements = Retirements(index, cfg, ingester.counters, ingester.schedule_rebuild, ingester.not_reset)
        self.health: dict[str, Health] = {}  # pod -> failures in a row (primary owner only)
        self.records: dict[str, PodRecord] = {}  # pod -> what we last wrote
        self.records_made: set[str] = set()  # pods of URL-less feeds whose record this process wrote if none was
        self.written_at: dict[str, float] = {}
        self.ticks = 0
        self.known: dict[str, EngineSpec] = {}  # the engines this ingester knows (its lease lists them)
        self.renewed_at = 0.0  # monotonic time of the last lease renewal
        self.renewer: asyncio.Task | None = None  # renew_forever's task (start_renewing)
        self.forget_seen_ms = 0  # the newest forget request carried out (IngesterLease.forget_seen_ms)
        self.current_ms = 0  # Valkey's time of the last renewal at which every pod not listed behind was current
        self.pod_current_ms: dict[str, int] = {}  # pod -> the last renewal at which it was current (ingester/lease.py)
        self._steps: list[tuple[str, float]] = []  # (step, monotonic start) of the round under way
        self.started_ms = 0
        self.live: list[str] = [self.me]
        self.owners: dict[str, list[str]] = {}  # engine key -> its owners this round, primary first
        self.share: tuple[int, int, int] = (-1, -1, -1)  # (engines here, engines known, live ingesters) last logged
        self.http = httpx.AsyncClient(timeout=cfg.health_timeout_s)
        self.vouched: set[str] = set()  # pods a lease put by this process listed (or tried to): ``vouch``
        self._vouching: asyncio.Future | None = None  # the lease put a new pod's first write waits for

    @property
    def active(self) -> bool:
        """Whether this ingester takes part in membership (it has engines to share, or may get some)."""
        return bool(self.static or self.sources or self.cfg.registered_engines)

    async def close(self) -> None:
        for task in [*self.fetches.values(), *self.probes.values(), *self.retirements.leaving.values(),
                     *([self.observing] if self.observing else [])]:
            task.cancel()
        if self.renewer is not None:  # ended first: a renewal in flight would put the lease back after its drop,
            self.renewer.cancel()     # and this ingester's pods would read current for a TTL after it left
            await asyncio.gather(self.renewer, return_exceptions=True)
        await self.http.aclose()
        try:
            await self.index.fleet.drop_leases([self.me])  # the others take over now, not a TTL later
        except VALKEY_ERRORS:
            pass

    # ---- one round

    async def tick(self) -> None:
        self.ticks += 1
        self._steps = []
        started = time.monotonic()
        self.ing.progress.begin_round(self.round_deadline_s)
        try:
            await self._round(started)
        finally:
            self.ing.progress.end_round()
            took = time.monotonic() - started
            marks = self._steps + [("end", started + took)]
            steps = ", ".join(f"{name} {end - at:.2f} s" for (name, at), (_, end) in zip(marks, marks[1:]))
            # a slow round says where its time went (the watchdog, ingester/watchdog.py, covers one that never ends)
            log.log(logging.INFO if took > SLOW_ROUND_S else logging.DEBUG, "membership round %d took %.2f s: %s",
                    self.ticks, took, steps or "nothing")

    @property
    def round_deadline_s(self) -> float:
        """How long a round may take before the watchdog says it overran: half the lease TTL."""
        return max(2.0, self.cfg.lease_ttl_s / 2)

    def _step(self, name: str) -> None:
        self._steps.append((name, time.monotonic()))
        self.ing.progress.mark(f"membership round {self.ticks}: {name}")
        log.debug("membership round %d: %s", self.ticks, name)

    async def _round(self, now: float) -> None:
        self._step("reading Valkey's time")
        # The round's reads and its lease are bounded as a whole (a call that never answers must not stall
        # the ingester's loop, nor keep its lease from being renewed next round); what follows them
        # (attaching engines, replays) has bounds of its own.
        async with asyncio.timeout(max(2.0, self.cfg.lease_ttl_s / 2)):
            now_ms = await self.index.fleet.now_ms()
            self.started_ms = self.started_ms or now_ms
            if now >= self.next_discovery:
                self._step("discovery")
                await self._discover(now)
                self.next_discovery = now + self.cfg.discovery_interval_s
            known = {s.key: s for s in self.static}
            known.update({s.key: s for s in self.discovered.current if s.key not in known})
            self.known = known
            private = self.cfg.private
            # a private ingester's lease says only how fresh its pods are (``private``): nobody hands it engines,
            # nor counts on it, nor takes its
            self._step("renewing the lease")
            await self._put_lease(now_ms)
            self._step("reading the fleet")
            view = await self.index.fleet.fleet_view()
            forgotten = await self.index.fleet.forgotten()
        await self._let_go_of_forgotten(forgotten)
        live = {} if private else {i: lease for i, lease in view.live_ingesters().items() if not lease.private}
        self.live = sorted(set(live) | {self.me})
        dead = [i for i, lease in view.ingesters.items()
                if lease.expires_ms + int(self.cfg.lease_ttl_s * 1000) < view.now_ms]
        if dead and not private:
            self._step("dropping expired leases")
            await self.index.fleet.drop_leases(dead)
        fleet_known = dict(known)
        origin = {k: _given_here(s) for k, s in known.items()}  # engine key -> where this ingester learnt of it
        for ingester, lease in sorted(live.items()):
            for raw in lease.known:
                try:
                    spec = msgspec.convert(raw, EngineSpec)
                except msgspec.ValidationError:
                    continue
                if spec.key and spec.key not in fleet_known:
                    fleet_known[spec.key] = spec
                    origin[spec.key] = f"from ingester {ingester}'s list"
        if self.ticks == 1 and set(live) - {self.me}:
            return  # others are about: take a share once they have seen our lease too (no start-up churn)
        self.owners = balanced_owners(fleet_known, self.live, self.cfg.copies)
        mine = {k: s for k, s in fleet_known.items() if self.me in self.owners[k] and s.pod not in forgotten}
        share = (len(mine), len(fleet_known), len(self.live))
        if share != self.share:  # an ingester given no engine is idle, not stuck: say which, and from where
            self.share = share
            log.info("share: %d of %d engine(s) ingested here, %d live ingester(s), --copies %d%s", *share,
                     self.cfg.copies, (": " + "; ".join(f"{k} ({origin.get(k, '?')})" for k in sorted(mine)))
                     if mine else "")
        for key in sorted(set(self.attached) - set(mine)):
            self._step(f"letting go of {key}")
            await self._detach(key, "owned by other ingesters now" if key in fleet_known else "left discovery")
        for key, spec in sorted(mine.items()):
            if key not in self.attached:
                self._step(f"attaching {key}")
                await self._attach(spec, view.pods, fleet_known, now)
        if private:  # pod records, health, load and retirement are the fleet's
            return
        for key, att in sorted(self.attached.items()):
            if att.spec.url and self.owners.get(key, [""])[0] == self.me:
                self._step(f"watching {key}")
                await self._watch(att, view, now_ms)
            elif att.spec.url and (new := [p for p in sorted(att.pods) if p not in view.pods]):
                self._step(f"recording the pods of {key}")
                await self._record_new(att, new, now_ms)
        # every other pod ingested here with no record yet (a --source or --bind feed, a pod named by its frames):
        # recorded with no engine URL, so a pod this fleet ingested is retired like any other once nobody does
        # (``unlisted``): a one-off ingester naming an engine's pod its own way leaves no ghost for good
        of_engines = {p for a in self.attached.values() if a.spec.url for p in a.pods}  # recorded by their owners
        if unrecorded := [p for p in self.ing.pods()
                          if p not in view.pods and p not in of_engines and p not in self.records_made]:
            self._step("recording the pods of sources")
            await self._record_sourced(unrecorded, now_ms)
        if self.discovered.started or not self.sources:
            self._step("retiring departed pods")
            await self.retirements.sweep(view, set(fleet_known), now_ms, self.me, self.live,
                                         {p for a in self.attached.values() for p in a.pods})

    async def _let_go_of_forgotten(self, forgotten: dict[str, int]) -> None:
        """Pods being forgotten (``/unregister``, ``index clear --forget``): their engines let go now (not a
        membership hold later) and their frames refused, then the lease says so (``forget_seen_ms``), and
        whoever forgets them clears their keys once every live lease does: no batch can bring them back."""
        self.ing.routes.forgotten = set(forgotten)
        # what this process cached of them goes too, whoever feeds them (an engine, or a --source socket, which
        # has no engine to let go of): a row or number remembered past the forget is not in Valkey any more
        self.index.forget_cached(forgotten)
        for key, att in sorted(self.attached.items()):
            if att.pods & set(forgotten) or att.spec.pod in forgotten:
                self._step(f"letting go of {key}")
                await self._detach(key, "its pod is being forgotten")
        if forgotten:
            self.forget_seen_ms = max(self.forget_seen_ms, max(forgotten.values()))

    async def _observe_sources(self) -> dict[str, list[EngineSpec]]:
        found = {}
        for src in self.sources:
            got = await observe(src)
            if got is not None:
                found[src.spec] = got
        return found

    async def _discover(self, now: float) -> None:
        # DNS and files are read in a task of their own (a resolver that times out costs its 5 s there, not
        # in the round the ingest loop waits on); the round takes the last answer that came back.
        task = self.observing
        if task is not None and task.done():
            self.observing = None
            if not task.cancelled() and task.exception() is None:
                self.observed.update(task.result())
            elif not task.cancelled():
                log.warning("engines: discovery failed (%s); keeping the engines known", task.exception())
        if self.sources and self.observing is None:
            self.observing = asyncio.ensure_future(self._observe_sources())
            if not self.discovered.started:  # the first answer at start is waited for (as before)
                await asyncio.wait([self.observing])
                self.observed.update(self.observing.result() if self.observing.exception() is None else {})
                self.observing = None
        if self.cfg.registered_engines:
            try:
                registered = await self.index.fleet.registered_engines()
            except VALKEY_ERRORS as exc:
                log.warning("engines: registered engines not read now (%s)", exc)
            else:
                self.observed["registered"] = [
                    EngineSpec(url=reg.url.rstrip("/"), pod=reg.pod or (address_pod_id(reg.url) if reg.url else ""),
                               origin="registered", source=reg.source, replay=reg.replay, model=reg.model)
                    for name, reg in sorted(registered.items()) if self._usable(name, reg)]
        seen = {s for specs in self.observed.values() for s in specs}
        before = self.discovered.current
        after = self.discovered.observe(seen, now)
        for s in sorted(after - before, key=lambda s: s.key):
            log.info("engine %s joined (%s, pod %s)", s.key, s.origin, s.pod or "from its topic")
        for s in sorted(before - after, key=lambda s: s.key):
            log.info("engine %s left %s", s.key, s.origin)

    def _usable(self, name: str, reg) -> bool:
        """A registration an ingester can subscribe to; any other (written by an older API, or by hand) is
        skipped, said once: a record in ``kvpf:engines`` must never be able to end an ingester."""
        if not (reg.url or reg.source):
            return False
        try:
            if reg.source:
                check_zmq_endpoint(reg.source, bind=False)
            if reg.replay:
                check_zmq_endpoint(reg.replay, bind=False)
            if reg.pod and "@" in reg.pod:
                raise ValueError(f"pod {reg.pod[:80]!r} contains '@'")
        except ValueError as exc:
            if name not in self.unusable:
                self.unusable.add(name)
                self.ing.counters.tally("registrations_skipped")
                log.error("registered engine %s skipped: %s", name[:120], exc)
            return False
        return True

    # ---- owning engines

    async def _attach(self, spec: EngineSpec, records: dict[str, PodRecord], fleet_known: dict[str, EngineSpec],
                      now: float) -> None:
        retry = self.retries.setdefault(spec.key, _Retry())
        if now < retry.next_at:
            return
        claimed = self._claimed_elsewhere(spec, records, fleet_known)
        if claimed:
            if retry.attempts < 3 or retry.attempts % 20 == 0:
                log.error("engine %s: pod id %r is already claimed by %s; refused (give each engine its own pod: "
                          "a \"pod\" in the engines file, or its own topic)", spec.key, spec.pod, claimed)
            self._conflict(retry, now)
            return
        if spec.url:
            task = self.fetches.get(spec.url)
            if task is None:  # ask now, attach in a later round (the loop goes on meanwhile)
                self.fetches[spec.url] = asyncio.ensure_future(discover_logged(
                    spec.url, retry.attempts, tuple(int(p) for p in self.cfg.target_ports)))
                return
            if not task.done():
                return
            del self.fetches[spec.url]
            found = None if task.cancelled() or task.exception() else task.result()
            if found is None:
                retry.backoff(now)
                return
        else:  # registered by its ZMQ source
            found = [Source(endpoint=spec.source, replay=spec.replay or None)]
        if not self.cfg.private:  # a private ingester leaves the fleet's records alone
            await self._take_over_moved(spec, found, records, fleet_known)
        try:
            pods = await self.ing.attach_engine(spec, found)
        except Exception as exc:  # noqa: BLE001 - whatever one engine's sockets do, it is that engine's fault alone
            self._attach_failed(spec, retry, now, exc)
            return
        conflict = [p for p in pods for a in self.attached.values() if p in a.pods]
        conflict += [p for p in pods if (r := records.get(p)) is not None and r.state != "retired"
                     and r.engine_url and r.engine_url != spec.url and r.engine_url in fleet_known]
        if conflict:
            log.error("engine %s: pod(s) %s already published by another live engine; refused (two sources "
                      "writing one pod would corrupt it)", spec.key, sorted(set(conflict)))
            self.ing.detach_engine(spec.key)
            self._conflict(retry, now)
            return
        del self.retries[spec.key]
        self.attached[spec.key] = _Attached(spec=spec, pods=pods, family=found[0].engine if found else DEFAULT)
        log.info("engine %s: ingesting pod(s) %s (owners: %s)", spec.key, sorted(pods) or "named by its frames",
                 ", ".join(self.owners.get(spec.key, [])))

    async def _take_over_moved(self, spec: EngineSpec, found: list[Source], records: dict[str, PodRecord],
                               fleet_known: dict[str, EngineSpec]) -> None:
        """A pod id last served by an engine that has left, now published by this one (a restarted stack
        naming its engines as before): its old entries go, and its record names the new engine, before the
        first event is applied, so retiring the old engine's record cannot clear the new one's entries."""
        now_ms = await self.index.fleet.now_ms()
        ranks: dict[str, set[str]] = {}  # pod -> its data-parallel ranks' index pods (rank_pods.py)
        for src in found:
            topic = src.named_topic or topic_or_none(src.topic)
            pod = spec.pod or (topic.pod_id if topic else "")
            if pod:
                ranks.setdefault(pod, {pod}).add(rank_pod(pod, src.rank))
        for pod, index_pods in ranks.items():
            rec = records.get(pod)
            if rec is None or not rec.engine_url or rec.engine_url == spec.url or rec.engine_url in fleet_known:
                continue
            new = PodRecord(state="live", since_ms=now_ms, engine_url=spec.url, owner=self.me)
            if await self.index.fleet.replace_pod_record(pod, rec, new) or rec.state == "retired":
                # A new engine: the pod starts as it does (no seq, not incomplete), and is replayed from its
                # seq 0. Clearing the entries alone kept the old seq and the retirement flag, so the pod read
                # incomplete for good (and a new engine further on than the old seq would skip its start).
                cleared, unread = 0, []
                for index_pod in sorted(index_pods):
                    try:
                        cleared += await self.index.reset_pod(index_pod)
                    except PodLogError as exc:  # its old entries cannot be found to clear: left, flagged; the engine
                        # is ingested all the same (its batches fail as any batch of such a pod)
                        unread.append(index_pod)
                        await self.ing.not_reset(index_pod, f"taken over from {rec.engine_url}", exc)
                await self.index.fleet.put_pod_records({pod: new})
                log.warning("pod %s: now published by %s (its engine %s left): %d old entries cleared, starts "
                            "from the new engine's seq 0%s", pod, spec.url, rec.engine_url, cleared,
                            f" (but {', '.join(unread)}: not reset, its state log does not read)" if unread else "")

    def _attach_failed(self, spec: EngineSpec, retry: _Retry, now: float, exc: BaseException) -> None:
        """An engine whose sources could not be subscribed (an address in use, an endpoint libzmq refuses,
        no descriptor left, the source cap): refused alone, logged with its URL, counted, tried again later."""
        try:
            self.ing.detach_engine(spec.key)
        except Exception:  # noqa: BLE001 - nothing of it may be left; a failure to close is not worth a crash
            log.exception("engine %s: closing after a failed attach", spec.key)
        self.ing.counters.tally("attach_errors")
        retry.backoff(now)
        if retry.attempts <= 3 or retry.attempts % 20 == 0:
            log.error("engine %s: not ingested (%s: %s); trying again in %.0f s", spec.key, type(exc).__name__,
                      str(exc)[:300], retry.next_at - now)

    def _conflict(self, retry: _Retry, now: float) -> None:
        self.ing.counters.tally("pod_conflicts")
        retry.backoff(now)

    def _claimed_elsewhere(self, spec: EngineSpec, records: dict[str, PodRecord],
                           fleet_known: dict[str, EngineSpec]) -> str:
        """Another live engine whose pod id is this engine's: two sources writing one pod would corrupt it."""
        if not spec.pod:
            return ""
        for key, other in fleet_known.items():
            if key != spec.key and other.pod == spec.pod:
                return key
        rec = records.get(spec.pod)
        if rec is not None and rec.state != "retired" and rec.engine_url and rec.engine_url != spec.url \
                and rec.engine_url in fleet_known:
            return rec.engine_url
        return ""

    async def _detach(self, key: str, why: str) -> None:
        att = self.attached.pop(key)
        try:
            self.ing.detach_engine(key)
        except Exception:  # noqa: BLE001 - a socket that fails to close ends nothing but itself
            self.ing.counters.tally("detach_errors")
            log.exception("engine %s: error while letting go of it", key)
        task = self.probes.pop(key, None)
        if task is not None:
            task.cancel()
        for pod in att.pods:
            self.health.pop(pod, None)
            self.records.pop(pod, None)
        log.info("engine %s: no longer ingested here (%s)", key, why)

    # ---- the primary owner's duties

    async def _watch(self, att: _Attached, view, now_ms: int) -> None:
        """Use the last finished probe of the engine (health, load, models) and start the next one."""
        url = att.spec.url
        task = self.probes.get(url)
        if task is None or not task.done():
            if task is None:
                self.probes[url] = asyncio.ensure_future(_timed(probe(
                    self.http, url, att.family,
                    self.ticks % MODELS_EVERY == 1 or any(p not in self.records for p in att.pods))))
            return
        self.probes[url] = asyncio.ensure_future(_timed(probe(self.http, url, att.family,
                                                              self.ticks % MODELS_EVERY == 1)))
        if task.cancelled() or task.exception():
            return
        (ok, detail, load, models), done = task.result()
        scraped_ms = now_ms - max(0, int((time.monotonic() - done) * 1000))  # its load is as old as the probe
        ranked = any(RANK_SEPARATOR in p for p in att.pods)  # data-parallel ranks: each rank's own load
        for pod in sorted(att.pods):
            if pod in self.retirements.leaving:  # its record waits until its entries are cleared (a return meanwhile too)
                continue
            current = view.pods.get(pod) or self.records.get(pod) or PodRecord(since_ms=now_ms)
            was_retired = current.state == "retired"
            record, self.health[pod] = after_check(
                current, self.health.get(pod, Health()), ok, now_ms, failures_needed=self.cfg.health_failures,
                retire_after_ms=int(self.cfg.retire_after_s * 1000), detail=detail)
            if was_retired and ok:
                record = self.retirements.returned(pod, record, now_ms)
            record = msgspec.structs.replace(record, engine_url=url, owner=self.me)
            if models:
                record = msgspec.structs.replace(record, models=models)
            if self.ticks % MODELS_EVERY == 1 or not record.block_size:
                try:
                    info = await self.index.meta.pod_info(pod)
                    if info.engine_block_size:
                        record = msgspec.structs.replace(record, block_size=info.engine_block_size)
                except VALKEY_ERRORS:
                    pass
            if record.state == "retired" and current.state != "retired":
                await self.retirements.retire(pod, record)
            await self._write(pod, record)
            if load is not None and record.state == "live":
                mine = load[1].get(split_rank_pod(pod)[1]) if ranked else None
                await self.index.fleet.put_load({pod: PodLoad(*(mine or load[0]), at_ms=scraped_ms)})

    async def _record_new(self, att: _Attached, pods: list[str], now_ms: int) -> None:
        """A copy's pods the fleet has no record of yet (this ingester is not the engine's primary owner, whose
        records are fuller): a record naming the engine, written only if there is still none, so a pod of the
        fleet always has one. An ingester that leaves without its pods being ingested by another (a one-off
        run naming pods its own way) leaves them recorded, and the fleet retires them (``unlisted``)."""
        for pod in pods:
            await self.index.fleet.replace_pod_record(pod, None, PodRecord(
                state="live", since_ms=now_ms, engine_url=att.spec.url, owner=self.owners.get(att.spec.key, [""])[0]))

    async def _record_sourced(self, pods: list[str], now_ms: int) -> None:
        """``_record_new`` for pods of feeds with no engine URL (written only if there is still none, once per
        pod and process: ``records_made``)."""
        for pod in pods:
            await self.index.fleet.replace_pod_record(pod, None, PodRecord(state="live", since_ms=now_ms, owner=self.me))
            self.records_made.add(pod)

    async def _write(self, pod: str, record: PodRecord) -> None:
        now = time.monotonic()
        if self.records.get(pod) == record and now - self.written_at.get(pod, 0.0) < RECORD_REFRESH_S:
            return
        await self.index.fleet.put_pod_records({pod: record})
        self.records[pod] = record
        self.written_at[pod] = now


async def _timed(probing):
    """A probe's answer and when it came (monotonic): the load it read is the engine's of that moment, a round before
    the round that writes it (gateways take a scrape less the requests that ended since it: predictor/routed.py)."""
    return await probing, time.monotonic()
