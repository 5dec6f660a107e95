"""The ingester loop: frames -> decoded batches -> planned mutations -> one script call per batch.

Ordering and exactly-once come from the index script's seq check (kv_preflight/index/index.py):
a batch applies only if it is the next seq of its (pod, dp rank). Everything else
is recovery: a gap asks the engine's replay socket for what was missed, a seq that
went backwards with a newer timestamp is an engine restart (clear, then apply),
and an older duplicate (another ingester got there first) is skipped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from redis.exceptions import (AskError, ClusterDownError, NoScriptError, OutOfMemoryError, ReadOnlyError, ResponseError, TryAgainError)

from kv_preflight.ingester.bridge import ChainState, Plan, plan_batch, seed_state, unresolved_parents
from kv_preflight.ingester.metrics import IngesterMetrics
from kv_preflight.ingester.recovery import MAX_STEPS, Done, Force, Replay, Reset, ResetIfThenCheck, next_step
from kv_preflight.ingester.replay import fetch_replay
from kv_preflight.ingester.sources import Source, parse_source, secure_sources
from kv_preflight.ingester.subscriber import Subscriber
from kv_preflight.ingester.watchdog import Progress, Watchdog
from kv_preflight.config import Config
from kv_preflight.engines import DEFAULT, engine
from kv_preflight.events import DecodedFrame, EventBatch, topic_or_none
from kv_preflight.index.index import VALKEY_ERRORS, ApplyResult, Index, MarkIncomplete

log = logging.getLogger("kvpf.ingester")

# How often the loop does its chores (see Ingester.chores), whether frames arrive or not.
CHORES_S = 1.0
# Batches sent to Valkey in one round trip when several messages are already queued.
PIPELINE_BATCHES = 64


@dataclass
class PodRoute:
    model: str
    replay: str | None = None
    source: str | None = None  # the endpoint its frames arrive on
    engine: str = DEFAULT  # the adapter of its source (kv_preflight/engines/)


@dataclass
class Stats:
    counts: Counter = field(default_factory=Counter)

    def inc(self, name: str, n: int = 1) -> None:
        self.counts[name] += n


class Ingester:
    def __init__(self, cfg: Config, index: Index, sources: list[Source]):
        self.cfg = cfg
        self.index = index
        self.sources = sources
        self.state = ChainState()
        self.routes: dict[str, PodRoute] = {}
        # (pod, data-parallel rank) -> the source its batches come from: with data parallelism one
        # pod (topic) has one PUB and one replay socket per rank, each rank with its own seq.
        self.rank_sources: dict[tuple[str, int], Source] = {}
        self.stats = Stats()
        self.metrics = IngesterMetrics(max_pod_series=cfg.max_pod_series)
        self.progress = Progress()  # the last step the loop reached (ingester/watchdog.py reports stalls)
        self.subscriber: Subscriber | None = None
        self._stopping = asyncio.Event()
        # set once start-up is over (engines attached, feeds learned, known pods resumed from their replay
        # sockets): from then on a batch reaches this ingester by its SUB socket only
        self.started = asyncio.Event()
        self._feeds: dict[tuple[str, int], tuple[str, str]] = {}  # (replay endpoint, rank) -> (pod, model) persisted
        self.engine_sources: dict[str, list[Source]] = {}  # engine URL -> its sources (ingester/fleet_member.py owns which)
        self.last_applied: dict[str, float] = {}  # pod -> monotonic time of its last applied batch
        from kv_preflight.ingester.fleet_member import FleetMember

        self.fleet = FleetMember(self)
        self._aliased: set[tuple[str, str]] = set()  # (topic pod, serving address) recorded in kvpf:aliases
        self._aliases_due: set[tuple[str, str]] = set()

    # ---- lifecycle

    @classmethod
    async def create(cls, cfg: Config, index: Index | None = None) -> "Ingester":
        # --engine and discovered engines are attached by the fleet membership (ingester/fleet_member.py), in
        # the first chores round: those down are retried with backoff while the others are ingested.
        sources = [parse_source(s) for s in cfg.sources] + [parse_source(b, bind=True) for b in cfg.binds]
        # Every socket gets the frame and queue bounds; --bind ones the CURVE server keys. Refusals are
        # counted on the ingester made below (the callback runs only once its sockets exist).
        sources = secure_sources(sources, cfg, on_refused=lambda key: ing.metrics.publishers_refused.inc())
        index = index or Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format,
                                        cluster=cfg.cluster_mode())
        return (ing := cls(cfg, index, sources))

    def start(self) -> None:
        self.subscriber = Subscriber(self.sources)
        self._route(self.sources)

    def _route(self, sources: list[Source]) -> set[str]:
        """Routes for sources whose topic is known (discovered); returns their pods."""
        pods = set()
        for src in sources:
            topic = src.named_topic or topic_or_none(src.topic)  # pod=,model= given, or a kv@POD@MODEL topic
            if topic is not None:
                pod = src.pod or self.pod_name(src, topic.pod_id)  # a discovered engine named by its address keeps its topic's model
                self.routes[pod] = PodRoute(model=topic.model, replay=src.replay, source=src.endpoint, engine=src.engine)
                pods.add(pod)
                if src.rank is not None:
                    self.rank_sources[(pod, src.rank)] = src
        return pods

    def pod_name(self, src: Source, topic_pod: str) -> str:
        """The pod id written into the index: the topic's, or with ``--pod-id endpoint`` the rank's
        serving address as llm-d-router v0.10 names it (ingester/subscriber.py ``serving_address``)."""
        if self.cfg.pod_id == "endpoint" and src.serving:
            if (topic_pod, src.serving) not in self._aliased:
                self._aliases_due.add((topic_pod, src.serving))
            return src.serving
        return topic_pod

    async def _write_aliases(self) -> None:
        """Both names of each renamed pod, for pods filters that use either (once per pair and process)."""
        if not self._aliases_due:
            return
        due, self._aliases_due = self._aliases_due, set()
        try:
            await self.index.fleet.add_aliases(due)
            self._aliased |= due
        except VALKEY_ERRORS:
            self._aliases_due |= due  # again with the next message

    def stop(self) -> None:
        self._stopping.set()

    def _stalled(self) -> None:
        self.stats.inc("loop_stalls")
        self.metrics.loop_stalls.inc()

    async def run(self) -> None:
        if self.subscriber is None:
            self.start()
        me = asyncio.current_task()
        assert me is not None
        watchdog = Watchdog(self.progress, me, self._stalled).start()
        try:
            await self._run()
        finally:
            watchdog.stop()

    async def _run(self) -> None:
        if self.fleet.active:
            await self._fleet_tick()  # attaches --engine and discovered engines (and resumes their pods)
        self.progress.mark("learning feeds")
        await self.learn_feeds()
        self.progress.mark("resuming known pods")
        await self.resume_known_pods()
        self.started.set()
        assert self.subscriber is not None
        recv: asyncio.Future | None = None
        next_chores = time.monotonic() + CHORES_S
        try:
            while not self._stopping.is_set():
                self.progress.mark("waiting for frames")
                if recv is None:
                    recv = asyncio.ensure_future(self.subscriber.receive())
                stop = asyncio.ensure_future(self._stopping.wait())
                done, _ = await asyncio.wait({recv, stop}, timeout=max(0.0, next_chores - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if self._stopping.is_set():
                    recv.cancel()
                    break
                if time.monotonic() >= next_chores:
                    self.progress.mark("chores")
                    await self.chores()
                    next_chores = time.monotonic() + CHORES_S
                if recv not in done:
                    continue
                if recv.cancelled():  # a socket it polled was closed (an engine let go): poll again
                    recv = None
                    continue
                received, recv = recv.result(), None
                self.progress.mark(f"applying {len(received)} message(s)")
                run: list[tuple[Source, list[bytes]]] = []
                for src, frames in received:
                    if frames is None:  # a reconnect: handle what came before, then probe
                        await self.handle_messages(run)
                        run = []
                        await self.probe_restart(src)
                    else:
                        run.append((src, frames))
                await self.handle_messages(run)
        finally:
            self.subscriber.close()
            await self.fleet.close()

    # ---- engines, as the fleet membership (ingester/fleet_member.py) gives and takes them

    async def attach_engine(self, spec, found: list[Source]) -> set[str]:
        """Subscribe to an engine's sources (``found``: from its /kv_event_sources, or the one source it
        was registered with) and resume its pods from their persisted seqs; returns its pods (a source
        with no topic learns its pod from its first frame, or from ``spec.pod``)."""
        if spec.pod:  # named by its address (or a file's "pod"), not by its topic
            found = [dataclasses.replace(src, pod=spec.pod) for src in found]
        found = secure_sources(found, self.cfg, on_refused=lambda key: self.metrics.publishers_refused.inc())
        assert self.subscriber is not None
        self.subscriber.add(found)
        self.engine_sources[spec.key] = found
        pods = self._route(found)
        if spec.pod and spec.model and spec.pod not in self.routes:  # a registered source: its route is known
            self.routes[spec.pod] = PodRoute(model=spec.model, replay=found[0].replay, source=found[0].endpoint,
                                             engine=found[0].engine)
            pods.add(spec.pod)
        # its buffered history, from seq 0 or the pod's persisted seq, as at start
        await self.resume_known_pods(only=pods)
        return pods

    def detach_engine(self, key: str) -> None:
        found = self.engine_sources.pop(key, [])
        if self.subscriber is not None and found:
            self.subscriber.remove(found)
        endpoints = {s.endpoint for s in found}
        for pod, route in list(self.routes.items()):
            if route.source in endpoints:
                del self.routes[pod]
        for key, src in list(self.rank_sources.items()):
            if src.endpoint in endpoints:
                del self.rank_sources[key]

    async def rebuild_pod(self, pod: str) -> bool:
        """Entries of a pod that was retired (cleared) and answers again: replayed from seq 0 if the
        engine still buffers that far back; False (the pod stays flagged incomplete) otherwise."""
        route = self.routes.get(pod)
        if route is None or not route.replay:
            return False
        frames, complete = await fetch_replay(route.replay, 0, timeout_s=self.cfg.replay_timeout_s)
        seqs = sorted(f.seq for f in frames if f.seq is not None and f.batch is not None)
        if not complete or not seqs or seqs[0] != 0 or seqs != list(range(len(seqs))):
            return False
        info = await self._valkey(self.index.pod_info, pod)
        for rank, last in info.seqs.items():
            await self._valkey(self.index.reset_if_seq, pod, int(rank), last)  # clears, seq back to none
        self.state = ChainState()
        for f in frames:
            if f.batch is not None and f.seq is not None:
                await self.apply(pod, route.model, f.seq, f.batch, allow_replay=False, decode_errors=len(f.errors))
        return True

    def lag_s(self) -> dict[str, float]:
        now = time.monotonic()
        return {pod: round(now - t, 1) for pod, t in sorted(self.last_applied.items())[:256]}

    async def _fleet_tick(self) -> None:
        try:
            await self.fleet.tick()
        except VALKEY_ERRORS as exc:  # TimeoutError too: a round's reads that did not answer in time
            self.stats.inc("valkey_errors")
            log.warning("fleet membership not updated now (%s); ingesting what this ingester has",
                        exc or type(exc).__name__)

    async def chores(self) -> None:
        """Every second, traffic or not: the fleet membership round (engines taken and let go, leases,
        health, load, retirement), stop if a layout-1 writer appears beside us, and run what a writer
        killed between a batch's steps left in a pod's outbox (cluster), so a quiet engine's last
        batch is not left half applied."""
        if self.fleet.active:
            await self._fleet_tick()
        try:
            if await self.index.v1_writer_seen():
                log.error("a kv-preflight 0.1 ingester (index layout 1) is writing to this Valkey: stopping, since two "
                          "layouts cannot share an index; stop it, then run `kv-preflight index migrate`")
                self.stop()
                return
        except VALKEY_ERRORS:
            return
        if not self.index.cluster:
            return
        for pod in list(self.routes):
            try:
                if await self.index.drain_outbox(pod, stale_only=True):
                    log.warning("%s: ran effects a stopped writer left in the outbox", pod)
                    self.stats.inc("outbox_drains")
            except VALKEY_ERRORS as exc:
                log.warning("%s: outbox not drained now (%s)", pod, exc)

    async def resume_known_pods(self, only: set[str] | None = None) -> None:
        """On start (and for engines found later, ``only`` their pods), replay from each known pod's
        persisted seq: closes the restart blind spot."""
        for pod, route in list(self.routes.items()):
            if not route.replay or (only is not None and pod not in only):
                continue
            # A writer killed between a batch's steps on a cluster left its effects in the outbox.
            await self._valkey(self.index.drain_outbox, pod, stale_only=True)
            info = await self._valkey(self.index.pod_info, pod)
            ranks = {r: s.replay for (p, r), s in self.rank_sources.items() if p == pod and s.replay}
            if ranks:  # each rank from its own replay socket, from its own seq
                todo = [(info.seqs.get(str(r), -1), replay) for r, replay in sorted(ranks.items())]
            else:
                todo = [(max(info.seqs.values()) if info.seqs else -1, route.replay)]
            for last, replay in todo:
                frames, complete = await fetch_replay(replay, last + 1, timeout_s=self.cfg.replay_timeout_s)
                log.info("resume %s from seq %d: %d batch(es) in the engine's replay buffer", pod, last + 1, len(frames))
                for f in frames:
                    if f.batch is not None and f.seq is not None:
                        await self._placeholders(f)
                        await self.apply(pod, route.model, f.seq, f.batch, allow_replay=False, decode_errors=len(f.errors))

    async def _remember_feed(self, src: Source, rank: int, pod: str, model: str) -> None:
        """Persist which pod this source's replay socket serves (once per process and change)."""
        if not src.replay or self._feeds.get((src.replay, rank)) == (pod, model):
            return
        self._feeds[(src.replay, rank)] = (pod, model)
        try:
            await self.index.fleet.remember_feed(src.replay, rank, pod, model)
        except VALKEY_ERRORS:
            self._feeds.pop((src.replay, rank), None)  # written again with the next frame

    async def learn_feeds(self) -> None:
        """Routes for every pod a source of ours served before (persisted by ``_remember_feed``),
        so ``resume_known_pods`` replays them at start, not when the engine next publishes."""
        by_replay = {s.replay: s for s in self.sources if s.replay}
        for replay, rank, pod, model in await self._valkey(self.index.fleet.feeds, list(by_replay)):
            src = by_replay[replay]
            self._feeds[(replay, rank)] = (pod, model)
            route = self.routes.setdefault(pod, PodRoute(model=model, replay=replay, source=src.endpoint, engine=src.engine))
            route.replay = route.replay or replay
            self.rank_sources.setdefault((pod, rank), src)

    async def probe_restart(self, src: Source) -> None:
        """On (re)connect, ask the replay socket for the last batch we applied. An engine that
        restarted (vLLM 0.32 counts seq from 0 per process) no longer has it: its cache is
        empty, so the pod's entries go now, not when it first publishes."""
        if not src.replay:
            return
        for pod, route in list(self.routes.items()):
            here = {r for (p, r), s in self.rank_sources.items() if p == pod and s.endpoint == src.endpoint}
            if not here and route.source != src.endpoint:
                continue
            info = await self._valkey(self.index.pod_info, pod)
            for rank, last in info.seqs.items():
                if last < 0:
                    continue
                # only the ranks this source publishes: another rank's seq is not in its replay buffer
                owner = self.rank_sources.get((pod, int(rank)))
                if (owner.endpoint if owner is not None else route.source) != src.endpoint:
                    continue
                frames, complete = await fetch_replay(src.replay, last, timeout_s=self.cfg.replay_timeout_s)
                if not complete:
                    log.warning("%s: replay socket %s did not answer the restart probe", pod, src.replay)
                    continue
                if any(f.seq == last for f in frames):
                    continue
                seqs = [f.seq for f in frames if f.seq is not None]
                if seqs and min(seqs) > last:
                    # The same engine, further on: its buffer no longer reaches back to our seq.
                    # That is a gap (replayed or flagged when its next batch arrives), not a restart.
                    log.warning("%s: replay buffer starts at seq %d, past our %d: a gap, not a restart",
                                pod, min(seqs), last)
                    continue
                if await self._valkey(self.index.reset_if_seq, pod, int(rank), last):
                    self.stats.inc("engine_restarts")
                    log.warning("%s: engine no longer has seq %d after reconnecting: it restarted; entries cleared",
                                pod, last)

    # ---- per message

    async def handle_frames(self, src: Source, frames: list[bytes]) -> None:
        await self.handle_messages([(src, frames)])

    async def handle_messages(self, messages: list[tuple[Source, list[bytes]]]) -> None:
        """Messages in arrival order: decoded and planned one by one, applied in one pipelined
        round trip (at most ``PIPELINE_BATCHES`` batches per trip). The seq check still runs per
        batch inside Valkey, so order and exactly-once hold; a batch not applied at once (gap,
        restart, or one behind such a batch) goes through ``apply``, in order, which recovers."""
        accepted = []
        for src, frames in messages:
            item = await self._accept(src, frames)
            if item is not None:
                accepted.append(item)
        runs = [accepted[i:i + PIPELINE_BATCHES] for i in range(0, len(accepted), PIPELINE_BATCHES)]
        if len(runs) == 1 and len(runs[0]) == 1:
            pod, model, seq, batch, errors = runs[0][0]
            await self.apply(pod, model, seq, batch, decode_errors=errors)
            return
        # Two runs in flight: while Valkey applies one, the next is planned and written.
        inflight = None
        for run in runs:
            plans = [await self._plan(pod, model, seq, batch, errors) for pod, model, seq, batch, errors in run]
            args = [dict(pod_id=pod, rank=batch.data_parallel_rank or 0, seq=seq, ts=batch.ts, model=model,
                         engine_block_size=plan.engine_block_size, mutations=plan.mutations)
                    for (pod, model, seq, batch, _), plan in zip(run, plans)]
            sent = await self._valkey(self.index.send_batches, args)
            if inflight is not None:
                await self._finish_run(*inflight)
            inflight = (run, plans, args, sent)
        if inflight is not None:
            await self._finish_run(*inflight)

    async def _accept(self, src: Source, frames: list[bytes]) -> tuple[str, str, int, EventBatch, int] | None:
        """Decode one message and note its route: (pod, model, seq, batch, decode errors), or None."""
        if self.subscriber is not None and self.subscriber.crowded(src):
            self.stats.inc("frames_refused")  # logged by the subscriber when the second publisher came
            self.metrics.frames_refused.labels(src.endpoint).inc()
            await self._count_quietly("frames_refused", 1)
            return None
        decoded = engine(src.engine).decode_frames(frames, topic=src.named_topic)
        await self._placeholders(decoded)
        errors, count = decoded.errors, decoded.error_count
        if not errors and (decoded.topic is None or decoded.batch is None):
            # Well-formed for a replay reply (no topic, or the end marker) but not for a SUB socket:
            # dropped like any other undecodable message, and counted like one.
            errors, count = [f"a {len(frames)}-frame message with no kv@<pod>@<model> topic or no batch (a publisher "
                             "with an empty topic is named on its source: ...,pod=POD,model=MODEL)"], 1
        for err in errors:  # at most MAX_LISTED_ERRORS lines per message; the rest only counted
            log.warning("dropped from %s: %s", src.endpoint, err)
        if count:
            if decoded.more_errors:
                log.warning("dropped from %s: %d more event(s) of the same message", src.endpoint, decoded.more_errors)
            self.stats.inc("decode_errors", count)
            self.metrics.decode_errors.inc(count)
            await self._count_quietly("decode_errors", count)
        if decoded.topic is None or decoded.seq is None or decoded.batch is None:
            return None
        pod = src.pod or decoded.topic.pod_id
        if src.pods is not None and pod not in src.pods:
            # Not a pod this socket may write for (its pods= allowlist): forged or misrouted. Refused before
            # any route, state or key is touched; counted by socket, never by the (attacker-chosen) pod name.
            self.stats.inc("frames_refused")
            self.metrics.frames_refused.labels(src.endpoint).inc()
            refused = self.stats.counts["frames_refused"]
            if refused <= 10 or refused % 1000 == 0:
                log.warning("refused from %s: pod %r is not in its pods= allowlist (%d frame(s) refused so far)",
                            src.endpoint, pod[:80], refused)
            await self._count_quietly("frames_refused", 1)
            return None
        pod = self.pod_name(src, pod)
        await self._write_aliases()
        route = self.routes.setdefault(pod, PodRoute(model=decoded.topic.model, replay=src.replay, source=src.endpoint,
                                                     engine=src.engine))
        route.model = decoded.topic.model
        route.source = src.endpoint
        route.engine = src.engine
        if src.replay and not route.replay:
            route.replay = src.replay
        self.rank_sources[(pod, decoded.batch.data_parallel_rank or 0)] = src
        await self._remember_feed(src, decoded.batch.data_parallel_rank or 0, pod, route.model)
        return pod, route.model, decoded.seq, decoded.batch, count

    async def _placeholders(self, decoded: DecodedFrame) -> None:
        """Placeholder events name no block (vLLM's offloading connector, PR #51243): counted, never an
        error, never a flag."""
        if decoded.skipped:
            self.stats.inc("placeholder_events", decoded.skipped)
            self.metrics.placeholder_events.inc(decoded.skipped)
            await self._count_quietly("placeholder_events", decoded.skipped)

    async def _finish_run(self, run: list[tuple[str, str, int, EventBatch, int]], plans: list[Plan],
                          args: list[dict], sent: "asyncio.Future") -> None:
        try:
            try:
                results = await sent
            except VALKEY_ERRORS as exc:
                if not transient(exc):
                    raise
                # Lost with the connection: send the run again (what did apply answers "dup").
                results = await self._valkey(self.index.apply_batches, args)
        except ResponseError:
            # One batch of the run was refused for good: each goes alone, so only that one fails.
            for pod, model, seq, batch, errors in run:
                await self.apply(pod, model, seq, batch, decode_errors=errors)
            return
        for (pod, model, seq, batch, errors), plan, result in zip(run, plans, results):
            if result.status == "applied":
                self.metrics.batches.labels(pod, "applied").inc()
                await self._applied(pod, seq, batch, plan, "check", result)
            elif result.status == "dup":
                self.metrics.batches.labels(pod, "dup").inc()
                self.stats.inc("duplicates_skipped")
            elif result.status == "corrupt":  # refused for good: sending it again would not change that
                self.metrics.batches.labels(pod, "corrupt").inc()
                await self._corrupt(pod, seq, result.detail)
            else:  # gap or restart, or behind one: the one-batch path re-checks (and counts), recovers
                await self.apply(pod, model, seq, batch, decode_errors=errors)

    async def _plan(self, pod: str, model: str, seq: int, batch: EventBatch, decode_errors: int = 0) -> Plan:
        """The batch's mutations; what makes the pod incomplete (orphans, undecodable events) ends them
        as a MarkIncomplete, so the flag is written by the very script that applies the batch."""
        plan = await self._plan_events(pod, model, seq, batch)
        reasons = []
        if plan.orphans:
            reasons.append(f"{plan.orphans} stored block(s) had an unknown parent")
        if decode_errors:  # a dropped BlockRemoved would leave blocks the engine no longer has
            reasons.append(f"{decode_errors} event(s) at seq {seq} could not be decoded")
        if reasons:
            plan.mutations.append(MarkIncomplete("; ".join(reasons)))
        return plan

    async def _plan_events(self, pod: str, model: str, seq: int, batch: EventBatch) -> Plan:
        missing = unresolved_parents(batch, model, self.state, self.cfg.lora_names)
        if missing:
            resolved = await self._valkey(self.index.resolve_engine_keys, [ek for _, ek in missing], pod)
            seed_state(self.state, {(m, ek): resolved[ek] for m, ek in missing if ek in resolved})
        route = self.routes.get(pod)
        try:
            return plan_batch(
                batch, pod_id=pod, topic_model=model, state=self.state, hash_seed=self.cfg.hash_seed,
                block_size=self.cfg.block_size, entry_field=self.index.entry_field, lora_names=self.cfg.lora_names,
                hash_algo=self.cfg.hash_algo, extra_keys=engine(route.engine if route else DEFAULT).extra_keys,
            )
        except Exception as exc:  # a batch no rule anticipated: keep the seq moving, flag the pod
            log.error("%s seq %d: batch could not be planned (%s); applying it empty", pod, seq, exc)
            self.stats.inc("plan_errors")
            return Plan(mutations=[MarkIncomplete(f"batch at seq {seq} could not be applied: {exc}")])

    async def _applied(self, pod: str, seq: int, batch: EventBatch, plan: Plan, mode: str,
                       result: ApplyResult | None = None) -> None:
        # The incomplete flag is the script's (MarkIncomplete set, AllBlocksCleared and reset cleared).
        if result is not None and result.foreign_writes:
            self.stats.inc("foreign_writes", result.foreign_writes)
            self.metrics.foreign_writes.inc(result.foreign_writes)
            await self._count_quietly("foreign_keys", result.foreign_writes)
            log.error("%s seq %d: %d write(s) skipped, a key of a foreign type is in the way (%s); pod flagged incomplete",
                      pod, seq, result.foreign_writes, result.detail)
        self.metrics.applied(pod, batch)
        self.last_applied[pod] = time.monotonic()
        self.stats.inc("batches_applied")
        self.stats.inc("blocks_stored", plan.stored_blocks)
        self.stats.inc("blocks_removed", plan.removed_blocks)
        if plan.orphans:
            self.stats.inc("orphan_blocks", plan.orphans)
            log.warning("%s seq %d: %d BlockStored event(s) with an unknown parent were not indexed", pod, seq, plan.orphans)
            await self._valkey(self.index.count, "orphans", plan.orphans, pod_id=pod)

    async def apply(self, pod: str, model: str, seq: int, batch: EventBatch, *, allow_replay: bool = True,
                    mode: str = "check", decode_errors: int = 0) -> str:
        """Apply one batch; returns the final status. Retries transient Valkey errors until it is
        back; the recovery rules (ingester/recovery.py) decide each next step, at most MAX_STEPS."""
        rank = batch.data_parallel_rank or 0
        can_replay = allow_replay
        for _ in range(MAX_STEPS):
            plan = await self._plan(pod, model, seq, batch, decode_errors)
            try:
                result = await self._valkey(
                    self.index.apply_batch, pod_id=pod, rank=rank, seq=seq, ts=batch.ts, model=model,
                    engine_block_size=plan.engine_block_size, mutations=plan.mutations, mode=mode,
                )
            except ResponseError as exc:  # not transient: the batch cannot be applied; others go on
                await self._failed(pod, seq, f"Valkey refused the batch: {exc}")
                return "error"
            self.metrics.batches.labels(pod, result.status).inc()
            if result.status == "applied":
                await self._applied(pod, seq, batch, plan, mode, result)
            elif result.status == "dup":
                self.stats.inc("duplicates_skipped")
            elif result.status == "corrupt":
                await self._corrupt(pod, seq, result.detail)
            replay = self._replay_endpoint(pod, rank)
            step = next_step(result.status, mode=mode, seq=seq, last_seq=result.last_seq,
                             can_replay=can_replay and replay is not None, has_replay=replay is not None)
            if isinstance(step, Done):
                return step.status
            if isinstance(step, Reset):
                log.warning("%s: seq went back from %d to 0 with a newer timestamp: engine restarted, clearing its "
                            "entries", pod, result.last_seq)
                self.stats.inc("engine_restarts")
                self.state = ChainState()  # engine keys of the old process mean nothing now
                mode = "reset"
            elif isinstance(step, ResetIfThenCheck):
                log.warning("%s: seq went back from %d to %d with a newer timestamp: engine restarted, clearing its "
                            "entries", pod, result.last_seq, seq)
                self.stats.inc("engine_restarts")
                self.state = ChainState()
                await self._valkey(self.index.reset_if_seq, pod, rank, step.last_seq)
                mode = "check"
            elif isinstance(step, Replay):
                can_replay = False
                if await self._replay_gap(pod, model, seq, rank, step.start, replay):
                    mode = "check"
                    continue
                reason = f"events {step.start}..{seq - 1} were missed and the engine's replay buffer no longer holds them"
                await self._force(pod, reason)
                mode = "force"
            elif isinstance(step, Force):
                self.stats.inc("gaps")
                self.metrics.gaps.labels(pod).inc()
                await self._force(pod, step.reason)
                mode = "force"
        await self._failed(pod, seq, f"no recovery rule settled the batch in {MAX_STEPS} steps")
        return "error"

    def _replay_endpoint(self, pod: str, rank: int) -> str | None:
        owner = self.rank_sources.get((pod, rank))
        if owner is not None and owner.replay:
            return owner.replay
        route = self.routes.get(pod)
        return route.replay if route else None

    async def _replay_gap(self, pod: str, model: str, seq: int, rank: int, start: int, replay: str) -> bool:
        """Apply seqs ``start`` .. seq-1 from the replay socket; False if it does not hold them all."""
        self.stats.inc("gaps")
        self.metrics.gaps.labels(pod).inc()
        log.info("%s: gap, have seq %d, got %d; replaying from %d", pod, start - 1, seq, start)
        frames, _ = await fetch_replay(replay, start, timeout_s=self.cfg.replay_timeout_s)
        self.stats.inc("replays")
        self.metrics.replays.labels(pod).inc()
        await self._count_quietly("replays", 1, pod_id=pod)
        by_seq = {f.seq: f for f in frames if f.batch is not None and f.seq is not None and start <= f.seq < seq
                  and (f.batch.data_parallel_rank or 0) == rank}
        if sorted(by_seq) != list(range(start, seq)):
            return False
        for s in range(start, seq):
            f = by_seq[s]
            await self._placeholders(f)
            await self.apply(pod, model, s, f.batch, allow_replay=False, decode_errors=len(f.errors))
        return True

    async def _force(self, pod: str, reason: str) -> None:
        log.warning("%s: %s; marking the pod incomplete", pod, reason)
        self.stats.inc("gaps_unrecovered")
        self.metrics.gaps_unrecovered.labels(pod).inc()
        await self._valkey(self.index.mark_incomplete, pod, reason)

    async def _corrupt(self, pod: str, seq: int, detail: str) -> None:
        """A batch the script refused as corrupt (forged seq, foreign-typed pod key): counted, the pod
        flagged, nothing else changed, so the next real batch applies as usual."""
        log.error("%s seq %d: not applied: %s", pod, seq, detail)
        self.stats.inc("corrupt_batches")
        self.metrics.corrupt_batches.inc()
        await self._count_quietly("corrupt_batches", 1)
        try:
            await self._valkey(self.index.mark_incomplete, pod, f"batch at seq {seq} refused: {detail}"[:300])
        except ResponseError:
            pass  # the pod's own key is unusable: the log line and the counter are what is left

    async def _failed(self, pod: str, seq: int, why: str) -> None:
        log.error("%s seq %d: %s", pod, seq, why[:300])
        self.stats.inc("apply_errors")
        self.metrics.apply_errors.inc()
        await self._count_quietly("apply_errors", 1)

    # ---- Valkey with retries

    async def _valkey(self, fn, *args, **kwargs):
        """Retry until Valkey answers: ZMQ keeps buffering meanwhile, and replay covers overflow.
        An error reply that retrying cannot change (see ``transient``) is raised to the caller,
        which gives up on that one batch, so a poisoned batch never stalls the other pods."""
        attempt = 0
        while True:
            try:
                return await fn(*args, **kwargs)
            except VALKEY_ERRORS as exc:
                if not transient(exc):
                    raise
                self.stats.inc("valkey_errors")
                self.metrics.valkey_errors.inc()
                if attempt == 0 or attempt % 20 == 0:
                    log.error("valkey unavailable (%s); retrying with backoff", exc)
                attempt += 1
                if self._stopping.is_set():
                    raise
                await sleep_backoff(attempt)

    async def _count_quietly(self, name: str, n: int, pod_id: str | None = None) -> None:
        try:
            await self.index.count(name, n, pod_id=pod_id)
        except VALKEY_ERRORS:
            self.stats.inc("valkey_errors")


async def sleep_backoff(attempt: int, cap_s: float = 5.0) -> None:
    await asyncio.sleep(min(cap_s, 0.05 * (2 ** min(attempt, 10))))


# Error replies that a later retry can succeed past: the server is loading, busy with a script,
# out of memory for now, failing over, or the key moved to another shard.
_TRANSIENT_REPLIES = ("LOADING", "BUSY", "OOM", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "NOREPLICAS",
                      "MOVED", "ASK", "NOSCRIPT")


def transient(exc: BaseException) -> bool:
    """Worth retrying: connection trouble and timeouts, and the error replies above."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError, ClusterDownError, AskError, TryAgainError, NoScriptError)):
        return True  # redis-py strips the code from these messages
    if isinstance(exc, ResponseError):
        return str(exc).split(" ", 1)[0].upper() in _TRANSIENT_REPLIES
    return True


class SettingsError(RuntimeError):
    """This process's index-wide settings differ from those the index was written with."""


async def check_settings(ing: Ingester) -> None:
    """Claim the index-wide settings (first writer wins) and refuse to write under others: request keys
    hashed with another seed or block size would never be found by anyone reading this index."""
    from kv_preflight.fleet.records import IndexSettings

    ours = IndexSettings(hash_seed=ing.cfg.hash_seed, block_size=ing.cfg.block_size, hash_algo=ing.cfg.hash_algo,
                         entry_format=ing.cfg.entry_format)
    found = await ing._valkey(ing.index.fleet.claim_settings, ours)
    wrong = ours.disagreements(found)
    if wrong:
        raise SettingsError("this index was written with other settings (ours != the index's): " + "; ".join(wrong)
                            + ". Give the index's values (--hash-seed, --block-size, --entry-format), or use "
                            "another Valkey")


async def run_ingester(cfg: Config) -> None:
    ing = await Ingester.create(cfg)
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, ing.stop)
        except NotImplementedError:  # pragma: no cover
            pass
    ing.start()
    await ing._valkey(ing.index.check_layout)  # waits for Valkey; a LayoutError ends the process, clearly
    await check_settings(ing)
    log.info("ingesting from %d source(s) into %s%s", len(ing.sources), cfg.valkey_url.split("@")[-1],
             " (Valkey Cluster)" if ing.index.cluster else "")
    metrics_server = None
    if cfg.metrics_port:
        metrics_server = ing.metrics.serve(cfg.metrics_port, cfg.metrics_host)
        log.info("metrics on http://%s:%d/metrics", cfg.metrics_host, cfg.metrics_port)
    try:
        await ing.run()
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
        await ing.index.close()
        log.info("stopped: %s", dict(ing.stats.counts))


__all__ = ["DecodedFrame", "Ingester", "run_ingester", "time"]
