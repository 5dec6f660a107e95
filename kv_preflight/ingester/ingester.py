"""The Ingester: its parts, its loop, and the engines the fleet membership gives it.

One message's way: the subscriber (ingester/subscriber.py) receives it, the acceptor decodes it with its
source's engine adapter (ingester/accept.py), the pipeline plans and sends the batches in pipelined round
trips (ingester/pipeline.py), and a batch that did not apply at once is carried through the recovery rules
by the applier (ingester/apply.py). Replays outside the stream (at start, on reconnect, for a pod that
returns) are ingester/resume.py's; the fleet membership (ingester/fleet_member.py) attaches engines.
Every event is counted once, through ingester/counters.py.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
import uuid

import zmq

from kv_preflight.config import Config
from kv_preflight.events import topic_or_none
from kv_preflight.fleet.records import SETTING_FLAGS, IndexSettings
from kv_preflight.index import hooks
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.layout_version import check_layout, v1_writer_seen
from kv_preflight.ingester.accept import FrameAcceptor
from kv_preflight.ingester.apply import Applier
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.fleet_member import FleetMember
from kv_preflight.ingester.liveness import StreamWatch
from kv_preflight.ingester.membership_rules import EngineSpec
from kv_preflight.ingester.metrics import IngesterMetrics
from kv_preflight.ingester.pipeline import Pipeline
from kv_preflight.ingester.resume import Resume
from kv_preflight.ingester.routes import PodRoute, Routes
from kv_preflight.ingester.sources import Source, parse_source, secure_sources
from kv_preflight.ingester.subscriber import Subscriber
from kv_preflight.ingester.valkey_retry import ValkeyRetry
from kv_preflight.ingester.watchdog import STALL_S, Progress, Watchdog

log = logging.getLogger("kvpf.ingester")

# How often the loop does its chores (see Ingester.chores), whether frames arrive or not.
CHORES_S = 1.0
BACKLOG_MESSAGES = 512  # a receive this full (Subscriber.receive's max) means more were queued behind it


class Ingester:
    def __init__(self, cfg: Config, index: Index, sources: list[Source]):
        self.cfg = cfg
        self.index = index
        self.sources = sources
        self.metrics = IngesterMetrics(max_pod_series=cfg.max_pod_series)
        self.progress = Progress()  # the last step the loop reached (ingester/watchdog.py reports stalls)
        self._stopping = asyncio.Event()
        # set once start-up is over (engines attached, feeds learned, known pods resumed from their replay
        # sockets): from then on a batch reaches this ingester by its SUB socket only
        self.started = asyncio.Event()
        self.valkey = ValkeyRetry(self._stopping, on_error=lambda: self.counters.tally("valkey_errors"))
        self.counters = Counters(self.metrics, index, retry=self.valkey.call)
        self.routes = Routes(cfg, index, self.valkey)
        self.applier = Applier(cfg, index, self.routes, self.counters, self.valkey)
        self.resume = Resume(cfg, index, self.routes, self.applier, self.counters, self.valkey)
        # a pod written with its data-parallel ranks merged (before each was a pod of its own): rebuilt once
        self.routes.on_merged = lambda pod: self.resume.schedule({pod}, rebuild=True)
        self.subscriber: Subscriber | None = None
        self.watch = StreamWatch(cfg.silence_probe_s)  # each stream's last frame, usual gap and seqs (liveness.py)
        self._silence_probes: dict[str, asyncio.Task] = {}  # source endpoint -> its probe (``_watch_streams``)
        self.acceptor = FrameAcceptor(self.routes, self.counters, crowded=self._crowded, watch=self.watch)
        self.pipeline = Pipeline(self.acceptor, self.applier, index, self.valkey)
        self.engine_sources: dict[str, list[Source]] = {}  # engine key -> its sources (the fleet membership owns which)
        self.fleet = FleetMember(self, cfg, index)
        self.applier.vouch, self.applier.vouched = self.fleet.vouch, self.fleet.vouched  # record first
        self.source_cap = source_cap(cfg)
        self.epoch: str | None = None  # the index's epoch as this ingester last saw it (check_epoch)
        self.backlog = False  # the last receive was full: frames were waiting behind it (ingest_state)
        self._exported: dict[str, int] = {}  # the cluster write path's counters, as far as exported (chores)

    # ---- lifecycle

    @classmethod
    async def create(cls, cfg: Config, index: Index | None = None) -> "Ingester":
        # --engine and discovered engines are attached by the fleet membership (ingester/fleet_member.py), in
        # the first chores round: those down are retried with backoff while the others are ingested.
        sources = [parse_source(s) for s in cfg.sources] + [parse_source(b, bind=True) for b in cfg.binds]
        # Every socket gets the frame and queue bounds; --bind ones the CURVE server keys. Refusals are
        # counted on the ingester made below (the callback runs only once its sockets exist).
        sources = secure_sources(sources, cfg, on_refused=lambda key: ing.counters.tally("publishers_refused"))
        index = index or Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format,
                                        cluster=cfg.cluster_mode(),
                                        reannouncements=cfg.kv_cache_report_mode == "full")
        return (ing := cls(cfg, index, sources))

    def start(self) -> None:
        self.subscriber = Subscriber(self.sources, on_drop=lambda src: self.counters.tally("stream_drops"))
        self.routes.add(self.sources)

    def stop(self) -> None:
        self._stopping.set()

    def _crowded(self, src: Source) -> bool:
        return self.subscriber is not None and self.subscriber.crowded(src)

    def _stalled(self) -> None:
        self.counters.tally("loop_stalls")

    async def run(self) -> None:
        if self.subscriber is None:
            self.start()
        me = asyncio.current_task()
        assert me is not None
        watchdog = Watchdog(self.progress, me, self._stalled,
                            on_overrun=lambda: self.counters.tally("round_overruns")).start()
        renewer = self.fleet.start_renewing() if self.fleet.active else None
        try:
            await self._run()
        finally:
            watchdog.stop()
            if renewer is not None:
                renewer.cancel()

    async def _run(self) -> None:
        if self.fleet.active:
            await self._fleet_tick()  # attaches --engine and discovered engines (and resumes their pods)
            self.progress.mark("resuming the engines attached at start")
            await self.resume.wait_scheduled()
        await self.routes.learn_feeds(self.sources)
        self.progress.mark("resuming known pods")
        await self.resume.known_pods()
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
                # a gap's replay answering wakes the loop too: its pod waits for nothing else
                done, _ = await asyncio.wait({recv, stop, *self.applier.fetches(), *self.resume.probing()},
                                             timeout=max(0.0, next_chores - time.monotonic()),
                                             return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if self._stopping.is_set():
                    recv.cancel()
                    break
                if time.monotonic() >= next_chores:
                    self.progress.mark("chores")
                    await self.chores()
                    next_chores = time.monotonic() + CHORES_S
                if self.resume.pending:
                    self.progress.mark("applying replays fetched for engines attached")
                    await self.resume.apply_ready()
                if any(task.done() for task in self.resume.probing()):
                    self.progress.mark("applying restart probes")
                    await self.resume.apply_probed()
                if self.applier.held:
                    self.progress.mark("applying gaps' replays")
                    await self.applier.apply_held()
                if recv not in done:
                    continue
                if recv.cancelled():  # a socket it polled was closed (an engine let go): poll again
                    recv = None
                    continue
                received, recv = recv.result(), None
                self.backlog = len(received) >= BACKLOG_MESSAGES  # a full receive: more were waiting
                self.progress.mark(f"applying {len(received)} message(s)")
                run: list[tuple[Source, list[bytes]]] = []
                for src, frames in received:
                    if frames is None:  # a reconnect: handle what came before, then probe (in the background)
                        await self.handle_messages(run)
                        run = []
                        self.resume.probe_later(src, catch_up=self.subscriber.take_recovered(src))
                    else:
                        run.append((src, frames))
                await self.handle_messages(run)
        finally:
            for task in self._silence_probes.values():
                task.cancel()
            self.resume.cancel()
            self.resume.cancel_probes()
            self.applier.let_go()
            self.subscriber.close()
            await self.fleet.close()

    # ---- engines, as the fleet membership (ingester/fleet_member.py) gives and takes them

    async def attach_engine(self, spec: EngineSpec, found: list[Source]) -> set[str]:
        """Subscribe to an engine's sources (``found``: from its discovery answer, or the one source it
        was registered with) and start resuming its pods from their persisted seqs; returns its pods (a
        source with no topic learns its pod from its first frame, or from ``spec.pod``).

        Raises (``zmq.ZMQError``, ``OSError``, ``ValueError``: an endpoint libzmq refuses, an address in use,
        the source cap) with nothing of the engine left subscribed; the fleet membership refuses that engine
        alone and tries it again later."""
        if spec.pod:  # named by its address, a file's "pod", or its registration, not by its topic
            # a registered engine names its model too: its frames need no kv@POD@MODEL topic (Dynamo's
            # workers publish with vLLM's default empty topic), as --source ...,pod=,model= does
            found = [dataclasses.replace(src, pod=spec.pod, model=src.model or spec.model or None) for src in found]
        else:  # named by its topic: the pod it announced is the one pod its sockets may write for (pods=), so an
            # engine announcing one pod and publishing another's topic is refused, logged and counted (accept.py)
            found = [dataclasses.replace(src, pods=frozenset({topic.pod_id}))
                     if src.pods is None and (topic := topic_or_none(src.topic)) is not None else src for src in found]
        found = secure_sources(found, self.cfg, on_refused=lambda key: self.counters.tally("publishers_refused"))
        assert self.subscriber is not None
        live = sum(1 for s in self.subscriber.sources if not s.endpoint.startswith("removed://"))
        if live + len(found) > self.source_cap:
            raise SourceCapReached(f"{live} source(s) subscribed here, the cap is {self.source_cap} "
                                   "(KVPF_MAX_SOURCES, and the process's open-file limit)")
        self.subscriber.add(found)
        self.engine_sources[spec.key] = found
        pods = self.routes.add(found)
        if spec.pod and spec.model and spec.pod not in self.routes.pods:  # a registered source: its route is known
            self.routes.pods[spec.pod] = PodRoute(model=spec.model, replay=found[0].replay, source=found[0].endpoint,
                                                  engine=found[0].engine)
            pods.add(spec.pod)
        # its buffered history, from seq 0 or the pod's persisted seq, as at start: in the background (a
        # replay socket that never answers costs its timeout there, not in the round the loop waits on)
        if pods:
            self.resume.schedule(pods)
        return pods

    def detach_engine(self, key: str) -> None:
        found = self.engine_sources.pop(key, [])
        endpoints = {s.endpoint for s in found}
        pods = {p for p, r in self.routes.pods.items() if r.source in endpoints}
        self.resume.cancel(pods)
        self.resume.cancel_probes(endpoints)
        self.watch.forget(endpoints)
        for endpoint in endpoints:
            task = self._silence_probes.pop(endpoint, None)
            if task is not None:
                task.cancel()
        self.applier.let_go(pods)
        self.index.forget_cached(pods)  # another process may forget them now: nothing cached may outlive that
        if self.subscriber is not None and found:
            self.subscriber.remove(found)
        self.routes.drop({s.endpoint for s in found})

    async def handle_messages(self, messages: list[tuple[Source, list[bytes]]]) -> None:
        """Messages in arrival order, through the pipeline (ingester/pipeline.py)."""
        await self.pipeline.handle_messages(messages)

    def schedule_rebuild(self, pod: str) -> None:
        """A retired pod that answers again: replayed from seq 0, cleared first, exact if the buffer is whole."""
        self.resume.schedule({pod}, rebuild=True, reset=True)

    async def not_reset(self, pod: str, why: str, exc: PodLogError) -> None:
        """A reset the fleet membership could not do (a pod taken over whose state log does not read)."""
        await self.applier.not_reset(pod, why, exc)

    def endpoints(self) -> dict[str, str]:
        """The ZMQ endpoints subscribed here (connecting ones) and their replay endpoints -> their pod."""
        found = self.subscriber.sources if self.subscriber is not None else self.sources
        by_source = {r.source: p for p, r in self.routes.pods.items() if r.source}
        out: dict[str, str] = {}
        for s in found:
            if s.endpoint.startswith("removed://"):
                continue
            pod = s.pod or by_source.get(s.endpoint, "")
            if not s.bind:
                out[s.endpoint] = pod
            if s.replay:
                out[s.replay] = pod
        return dict(sorted(out.items()))

    def pods(self) -> list[str]:
        return sorted(self.routes.pods)

    def ingest_state(self) -> tuple[str, list[str]]:
        """("current" | "behind" | "stalled", the pods behind): stalled when Valkey calls have been failing, or the
        loop has made no progress, for STALL_S (a call that got through in between does not end the failing:
        ``ValkeyRetry.failing``); behind on a backlog (a full receive), a Valkey failure younger than that, a pod
        whose replay is under way (an engine attached, a gap, a stream back after it went down), or a pod whose
        stream is down (its connection dropped, or found dead, and not back yet)."""
        now = time.monotonic()
        failing = self.valkey.failing_for(now)  # not ended by one call that got through (valkey_retry.py)
        if (failing is not None and failing >= STALL_S) or now - self.progress.at >= STALL_S:
            return "stalled", sorted(self.routes.pods)
        behind = sorted(self.resume.pending_pods | set(self.applier.held) | self.streams_down())
        if failing is not None or self.backlog:
            return "behind", sorted(self.routes.pods)
        return ("behind" if behind else "current"), behind

    def streams_down(self) -> set[str]:
        """The pods whose event stream is down now (ingester/subscriber.py ``down``)."""
        if self.subscriber is None:
            return set()
        return self.routes.pods_on(self.subscriber.down_endpoints())

    def _watch_streams(self) -> None:
        """Probe each source silent past its usual gap (ingester/liveness.py), in a task of its own."""
        if self.subscriber is None or not self.cfg.silence_probe_s:
            return
        now = time.monotonic()
        down = self.subscriber.down_endpoints()
        for src in self.subscriber.sources:
            endpoint = src.endpoint
            if endpoint.startswith("removed://") or endpoint in down or endpoint in self._silence_probes:
                continue
            if self.watch.due(endpoint, now):
                task = asyncio.ensure_future(self._probe_silent(src))
                task.add_done_callback(lambda t, e=endpoint: self._silence_probes.pop(e, None))
                self._silence_probes[endpoint] = task

    async def _probe_silent(self, src: Source) -> None:
        try:
            dead = await self.resume.probe_silent(src, self.watch.received, PROBE_GRACE_S)
        except (*VALKEY_ERRORS, zmq.ZMQError, OSError) as exc:
            log.warning("%s: silence probe failed (%s: %s)", src.endpoint, type(exc).__name__, exc)
            return
        if not dead or self.subscriber is None or src not in self.subscriber.sources:
            return
        self.counters.tally("streams_dead")
        self.subscriber.mark_down(src, time.monotonic())  # behind until connected again (then replayed again)
        self.resume.schedule(self.routes.pods_on({src.endpoint}))  # what it missed, now

    def batch_ts(self) -> dict[str, float]:
        return dict(sorted(self.applier.last_batch_ts.items())[:256])

    def lag_s(self) -> dict[str, float]:
        now = time.monotonic()
        return {pod: round(now - t, 1) for pod, t in sorted(self.applier.last_applied.items())[:256]}

    async def _fleet_tick(self) -> None:
        try:
            await self.fleet.tick()
        except VALKEY_ERRORS as exc:  # TimeoutError too: a round's reads that did not answer in time
            await self.counters.count("valkey_errors")
            log.warning("fleet membership not updated now (%s); ingesting what this ingester has",
                        exc or type(exc).__name__)

    async def check_epoch(self) -> None:
        """Notice that Valkey lost the index's data since the last look (a restart without persistence,
        FLUSHALL, the epoch key evicted): the epoch this ingester saw is gone or another; on a cluster also a
        shard that came back without its data, whichever it is (its slots' markers gone: kv_preflight/index/
        cluster/markers.py), which starts a new epoch so every ingester sees it. Then what this process cached
        goes (registry rows, pod numbers, pod states), the layout and settings are claimed again, and every
        pod ingested here is put back in the registry, flagged incomplete and rebuilt from its engine's
        replay buffer (exact again, the flag cleared, if the buffer reaches its seq 0; else at its next
        reset). The epoch is one HGET a second (on a cluster, and one read per primary)."""
        fleet = self.index.fleet
        seen = await fleet.epoch()
        if self.epoch is None:
            self.epoch = await fleet.claim_epoch(uuid.uuid4().hex)
            await self._mark_shards()
            return
        what = "its epoch is gone" if seen is None else "its epoch is another"
        if seen == self.epoch:
            looked = await fleet.look_at_shards(self.epoch)
            if looked.rewritten:
                await self.counters.count("markers_rewritten", len(looked.rewritten))
                log.warning("slot marker(s) of %s gone though the shard ran all along: evicted (maxmemory-policy "
                            "allkeys-*, which loses index data unseen) or deleted; written again",
                            ", ".join(looked.rewritten))
            if not looked.lost:
                return
            what = f"shard {', '.join(looked.lost)} came back without its data"
            if looked.numbering:
                log.warning("the lost shard held the pod numbering (kvpf:{nums}:*): each pod whose own record "
                            "survived gets its number back as it is numbered again, and no number given before is "
                            "given to another pod (the high-water mark's copies on the other shards)")
            epoch = await fleet.replace_epoch(self.epoch, uuid.uuid4().hex)
        else:
            epoch = await fleet.claim_epoch(uuid.uuid4().hex)
        pods = {p: r.model for p, r in self.routes.pods.items()}
        log.error("Valkey lost the index's data (%s): %d pod(s) ingested here flagged incomplete, put back in the "
                  "registry and rebuilt from their replay buffers; run Valkey with persistence and "
                  "maxmemory-policy noeviction (docs/operations.md)", what, len(pods))
        self.index.forget_cached()
        self.fleet.records.clear()  # fleet records written again at once, not RECORD_REFRESH_S later
        await check_layout(self.index.client)
        await check_settings(self)
        await self.index.register_pods(pods)
        # A pod another ingester of it rebuilt whole since this loss (it noticed first) is exact: flagged again
        # here, nobody would clear it (its seq has moved on: this rebuild's clearing is refused)
        flagged = {pod for pod in pods
                   if await self.index.meta.mark_incomplete(pod, LOST_REASON, unless_rebuilt_in=epoch)}
        if len(flagged) < len(pods):
            log.warning("%d pod(s) already rebuilt by another ingester since the loss: not flagged or rebuilt again",
                        len(pods) - len(flagged))
        self.resume.schedule(flagged, rebuild=True, epoch=epoch)
        # Taken as seen only now: a step above that failed (a shard still rejoining) leaves this ingester in the
        # old epoch, so its next look finds "another" and does all of it again, rather than never.
        self.epoch = epoch
        await self.counters.count("data_losses")
        await self._mark_shards()

    async def _mark_shards(self) -> None:
        """(cluster) The slots marked in this epoch; a shard down now does not hold up the rest (the start, a
        rebuild): the next look marks them."""
        try:
            await self.index.fleet.mark_shards(self.epoch)
        except VALKEY_ERRORS as exc:
            log.warning("slot markers not written now (%s); written at a later look", exc or type(exc).__name__)

    async def chores(self) -> None:
        """Every second, traffic or not: the fleet membership round (engines taken and let go, leases,
        health, load, retirement), stop if a layout-1 writer appears beside us, and run what a writer
        killed between a batch's steps left in a pod's outbox (cluster), so a quiet engine's last
        batch is not left half applied."""
        if self.fleet.active:
            await self._fleet_tick()
        self._watch_streams()
        try:
            await self.check_epoch()
        except VALKEY_ERRORS as exc:
            log.warning("index epoch not checked now (%s)", exc or type(exc).__name__)
        try:
            if await v1_writer_seen(self.index.client):
                log.error("a kv-preflight 0.1 ingester (index layout 1) is writing to this Valkey: stopping, since two "
                          "layouts cannot share an index; stop it, then run `kv-preflight index migrate`")
                self.stop()
                return
        except VALKEY_ERRORS:
            return
        for pod, ran in (await self.index.drain_outboxes(list(self.routes.pods), at_once=DRAINS_AT_ONCE)).items():
            if isinstance(ran, Exception):
                log.warning("%s: outbox not drained now (%s)", pod, ran)
            elif ran:
                log.warning("%s: ran %d outbox entries again (a stopped writer's, or ours after the slot map "
                            "moved before a replica confirmed them)", pod, ran)
                await self.counters.count("outbox_drains")
        metrics = self.counters.metrics
        counts = self.index.write_counts()
        for name, metric in (("unreplicated", metrics.unreplicated_runs),
                             ("confirmed_late", metrics.outbox_confirmed_late), ("late_runs", metrics.late_runs)):
            seen = counts[name]
            if seen > self._exported.get(name, 0):
                metric.inc(seen - self._exported.get(name, 0))
                self._exported[name] = seen


LOST_REASON = "Valkey lost the index's data; rebuilding from the engine's replay buffer"
PROBE_GRACE_S = 1.0  # a batch a silent source's replay holds may be in flight: it is dead only if still not here then
DRAINS_AT_ONCE = 32  # pods whose outboxes the chores drain side by side


class SourceCapReached(ValueError):
    """Subscribing an engine's sources would pass this ingester's cap on sockets (``max_sources``)."""


def source_cap(cfg: Config) -> int:
    """Sources this process may subscribe: ``max_sources``, and no more than its open-file limit allows
    (each source holds about three ZMQ sockets and their descriptors; libzmq has 1,023 sockets per context)."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        soft = -1
    by_files = (soft - 64) // 5 if soft > 0 else cfg.max_sources
    return max(1, min(cfg.max_sources, by_files, 300))


class SettingsError(RuntimeError):
    """This process's index-wide settings differ from those the index was written with."""


async def check_settings(ing: Ingester) -> None:
    """Claim the index-wide settings (first writer wins) and refuse to write under others: request keys
    hashed with another seed or block size would never be found by anyone reading this index."""
    cfg = ing.cfg
    ours = IndexSettings(hash_seed=cfg.hash_seed, block_size=cfg.block_size, hash_algo=cfg.hash_algo,
                         entry_format=cfg.entry_format, pod_id=cfg.pod_id,
                         kv_cache_report_mode=cfg.kv_cache_report_mode)
    found = await ing.valkey.call(ing.index.fleet.claim_settings, ours)
    wrong = ours.disagreements(found)
    if wrong:
        flags = ", ".join(f for n, f in SETTING_FLAGS.items() if getattr(ours, n) != getattr(found, n))
        raise SettingsError("this index was written with other settings (ours != the index's): " + "; ".join(wrong)
                            + f". Give the index's values ({flags}), or use another Valkey")


def start_line(cfg: Config, sockets: int, topology: str = "") -> str:
    """What this ingester is about to do, and with whom: a one-off `ingest --engine X` against a fleet's
    Valkey used to take a share of the fleet's engines while its log said "ingesting from 0 source(s)"."""
    where = cfg.valkey_url.split("@")[-1] + (f" ({topology})" if topology else "")
    given = [*(f"--engine {u}" for u in cfg.engines), *(f"--engines-from {s}" for s in cfg.engines_from)]
    own = ", ".join(given) or "no engine"
    socks = f"; {sockets} --source/--bind socket(s), ingested here alone" if sockets else ""
    if cfg.private:
        return (f"private ingester into {where}: ingests {own}{socks}, outside the fleet (its lease says only how "
                "fresh its pods are; no pod records, health or retirement; other ingesters neither give it engines nor "
                "take its)")
    registered = " and the engines registered through the remote-indexer API" if cfg.registered_engines else ""
    return (f"joining the fleet of ingesters sharing {where}: given {own}{registered}{socks}; every live "
            f"ingester's engines are shared among them (--copies {cfg.copies} each), so this one may ingest "
            "engines others were given and they may take its (`share:` lines say which); --private ingests only "
            "its own, outside the fleet (docs/fleet.md)")


async def run_ingester(cfg: Config) -> None:
    hooks.load_plugin()  # a fault-injection test's hooks (kv_preflight/index/hooks.py); none in production
    ing = await Ingester.create(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, ing.stop)
        except NotImplementedError:  # pragma: no cover
            pass
    ing.start()
    await ing.valkey.call(check_layout, ing.index.client)  # waits for Valkey; a LayoutError ends the process, clearly
    await check_settings(ing)
    await ing.valkey.call(ing.check_epoch)
    policy = await ing.index.fleet.maxmemory_policy()
    if policy is not None and policy.startswith("allkeys-"):
        log.warning("Valkey's maxmemory-policy is %s: at maxmemory it evicts index keys (an entry, a pod's state, "
                    "a presence bitmap) and predictions go wrong silently; run noeviction (docs/operations.md)",
                    policy)
    log.info("%s", start_line(cfg, len(ing.sources), ing.index.label))
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
        counts = {k: v for k, v in ing.counters.counts.items() if v}
        log.info("stopped: %s", ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing was applied")
