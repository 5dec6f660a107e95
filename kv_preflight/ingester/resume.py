"""Replay from the engine where the live stream cannot say what was missed: at start and for engines
attached later (each pod from its persisted seq), on a (re)connect (is the last batch applied still in the
engine's buffer, or did it restart?, and after a stream that went down: what its pods missed meanwhile), for a
source silent past its usual gap (did the engine publish what never came? ``probe_silent``), and for a retired
pod that answers again (rebuilt from seq 0).
"""
from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple

from kv_preflight.config import Config
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.index.pod_meta import PodInfo
from kv_preflight.index.write_side import WriteSide
from kv_preflight.ingester.apply import Applier
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.replay import fetch_replay
from kv_preflight.ingester.routes import Routes
from kv_preflight.ingester.sources import Source
from kv_preflight.ingester.valkey_retry import ValkeyRetry

log = logging.getLogger("kvpf.ingester")

# A rebuild's clearing refused (another writer's batch moved the pod's seq between its read and the clearing) is
# tried again at once RESET_TRIES times; then, in the background, REBUILD_PAUSE_S later, up to REBUILD_ROUNDS times.
RESET_TRIES = 3
REBUILD_ROUNDS = 20
REBUILD_PAUSE_S = 0.25


class Restarted(NamedTuple):
    """A restart probe's finding: the pod's engine no longer holds ``seq`` of ``rank``; the pod's last event time
    as the probe read it (a batch applied since: the stream's seq check judged the restart, ``_reset_restarted``)."""

    pod: str
    rank: int
    seq: int
    last_event_time: float | None


class Resume:
    def __init__(self, cfg: Config, index: WriteSide, routes: Routes, applier: Applier, counters: Counters,
                 valkey: ValkeyRetry):
        self.cfg = cfg
        self.index = index
        self.routes = routes
        self.applier = applier
        self.counters = counters
        self.valkey = valkey
        self._fetching: dict[str, asyncio.Task] = {}  # pod -> its replay being fetched (``schedule``)
        self._rebuilding: set[str] = set()  # of those, pods flagged incomplete that a whole replay makes exact
        self._resetting: set[str] = set()  # of those, pods cleared first if the replay is whole (a retired pod back)
        self._epochs: dict[str, str] = {}  # a pod rebuilt after a loss of Valkey's data -> the epoch that loss began
        self._rounds: dict[str, int] = {}  # a pod being rebuilt -> its clearings refused so far (``_apply_fetched``)
        # source endpoint -> its restart probe (``probe_later``) and whether to catch up once it is applied
        self._probes: dict[str, tuple[asyncio.Task, bool]] = {}
        self._found: list[Restarted] = []  # what ended probes found, not applied yet

    async def known_pods(self, only: set[str] | None = None) -> None:
        """On start (``only``: just those pods), replay from each known pod's persisted seq, now: closes the
        restart blind spot. Engines attached later are resumed in the background (``schedule``)."""
        pods = [p for p, r in self.routes.pods.items() if r.replay and (only is None or p in only)]
        for pod in pods:
            await self.valkey.call(self.index.drain_outbox, pod, stale_only=True)  # (``_apply_fetched``)
            await self._apply(pod, await self._fetch(pod))

    def schedule(self, pods: set[str], *, rebuild: bool = False, reset: bool = False, epoch: str = "") -> None:
        """Resume these pods (an engine just attached) without holding up the loop: their replay sockets
        are asked in a task of their own (a dead one costs its timeout there); what they answered is
        applied by the loop (``apply_ready``), in order with the live stream. ``epoch``: a rebuild after a loss
        of Valkey's data, which began that epoch (recorded with the pod once it is rebuilt whole)."""
        for pod in sorted(pods):
            route = self.routes.pods.get(pod)
            if route is None or not route.replay:
                continue
            if pod in self._fetching:
                if rebuild and epoch and pod in self._rebuilding:  # a later loss, noticed before this rebuild
                    self._epochs[pod] = epoch  # cleared the pod (``_reset`` comes once its replay is fetched)
                if not rebuild or pod in self._rebuilding:
                    continue
                # a resume from its seq under way: a rebuild (from seq 0, the pod cleared first) replaces it
                self._fetching.pop(pod).cancel()
            if rebuild:
                self._rebuilding.add(pod)
                if epoch:
                    self._epochs[pod] = epoch
                self.applier.park(pod)  # its live batches wait until the rebuild is applied (Applier.park)
            if reset:
                self._resetting.add(pod)
            self._fetching[pod] = asyncio.ensure_future(self._fetch(pod))

    async def wait_scheduled(self) -> None:
        """At start: every replay scheduled so far fetched and applied (bounded by the replay timeout)."""
        if self._fetching:
            await asyncio.wait(list(self._fetching.values()))
            await self.apply_ready()

    @property
    def pending_pods(self) -> set[str]:
        return set(self._fetching)

    @property
    def pending(self) -> int:
        return len(self._fetching)

    async def apply_ready(self) -> None:
        """Apply the replays fetched since the last call (the loop calls it every turn)."""
        for pod, task in list(self._fetching.items()):
            if not task.done():
                continue
            del self._fetching[pod]
            again = False
            try:
                again = await self._apply_fetched(pod, task)
            finally:
                if again:  # the same replay, tried again a moment later; its live batches still parked
                    self._fetching[pod] = asyncio.ensure_future(self._later(task.result()))
                else:
                    self._forget(pod)
                    await self.applier.unpark(pod)  # what arrived meanwhile, after it

    def _forget(self, pod: str) -> None:
        self._rebuilding.discard(pod)
        self._resetting.discard(pod)
        self._epochs.pop(pod, None)
        self._rounds.pop(pod, None)

    @staticmethod
    async def _later(fetched: list[tuple[int, list, bool]]) -> list[tuple[int, list, bool]]:
        """A replay fetched already, answered again REBUILD_PAUSE_S later. Still all the pod needs: its live batches
        have been parked since before it was fetched (``schedule``), so the two meet."""
        await asyncio.sleep(REBUILD_PAUSE_S)
        return fetched

    async def _apply_fetched(self, pod: str, task: asyncio.Future) -> bool:
        """Apply a replay fetched; whether to try it again (its clearing was refused: ``_later``)."""
        if task.cancelled():
            return False
        exc = task.exception()
        if exc is not None:
            log.warning("resume %s: replay not fetched (%s: %s); its next gap replays it", pod,
                        type(exc).__name__, exc)
            return False
        if pod not in self.routes.pods:  # not ours any more (let go meanwhile)
            return False
        # A writer killed between a batch's steps on a cluster left its changes in the pod's outbox: run now, in the
        # loop. In the fetch's own task, this drain ran this writer's entries again beside the loop's next batch of
        # the pod, whose changes could then land before the older ones.
        await self.valkey.call(self.index.drain_outbox, pod, stale_only=True)
        whole = self._whole(task.result())
        if pod in self._resetting and not whole:  # a retired pod stays flagged (or an engine restart made it
            # exact already)
            log.warning("%s: its replay buffer no longer reaches its first event; flagged incomplete until its "
                        "next reset", pod)
            return False
        rebuilding = pod in self._rebuilding
        if whole and (pod in self._resetting or rebuilding):
            # A rebuild clears what is left of the pod first: the whole replay then writes every batch again.
            # Else what survived would answer "dup" to them: the seqs of a pod whose keys were on shards that
            # kept their data while others lost theirs, or of batches applied between a loss and its notice.
            try:
                was, cleared = await self._reset(pod, keep_flag=rebuilding)
            except PodLogError as exc:  # its entries cannot be found to clear: no replay makes it exact
                await self.applier.not_reset(pod, "rebuild from its engine's replay buffer", exc)
                return False
            if not cleared and self._rebuilt_by_another(pod, was):
                log.warning("%s: already rebuilt whole by another ingester of it after this loss; not again", pod)
                return False
            if not cleared:  # what the replay applies may answer "dup" where the seq moved: not proven exact by
                # this replay. The seq moved under another writer's batch: another ingester of the pod rebuilding it
                # too, or one whose live batches go on (it rebuilt the pod already, or has not noticed the loss
                # yet). Leaving the flag to "that rebuild" is wrong in the last case: when that ingester notices,
                # this one's live batches refuse its clearing in turn, and nobody clears the flag. So this rebuild
                # is tried again, its own live batches parked meanwhile (they refuse no other clearing): until it
                # clears the pod, or finds it rebuilt after this loss by the other.
                rounds = self._rounds[pod] = self._rounds.get(pod, 0) + 1
                if rounds < REBUILD_ROUNDS:
                    log.info("%s: a rank's seq moved while the pod was cleared for its rebuild (another writer's "
                             "batch); tried again in %.2f s", pod, REBUILD_PAUSE_S)
                    return True
                log.warning("%s: a rank's seq moved each time the pod was cleared for its rebuild (%d tries); its "
                            "flag is left to another ingester's rebuild of it, else to its next reset", pod,
                            rounds * RESET_TRIES)
                rebuilding = False
        # A whole replay of a pod being rebuilt stops at a gap: applied from seq 0 in order, it finds one only where
        # another writer cleared the pod under it (another ingester's rebuild, its pod_info and clearing between
        # two of this replay's batches: the seq had not moved). Forced past, this replay's next batch put the seq
        # past what that rebuild had applied, which then skipped the missed batches as "dup", and this rebuild's
        # end cleared the gap's flag: the pod read exact with blocks the engine had removed. That rebuild, whole
        # from its own clearing, makes the pod exact and clears the flag; this one leaves it to it.
        stopped = await self._apply(pod, task.result(), stop_at_gap=whole and pod in self._rebuilding)
        if stopped is not None:
            log.warning("%s: the pod was cleared under this rebuild's replay at seq %d (another ingester of it "
                        "rebuilds it); its flag is left to that rebuild", pod, stopped)
        elif rebuilding and whole:
            await self.valkey.call(self.index.meta.mark_complete, pod, rebuilt_in=self._epochs.get(pod, ""))
            log.warning("%s: rebuilt whole from its engine's replay buffer (seq 0 on); exact again", pod)
        return False

    def _rebuilt_by_another(self, pod: str, info: PodInfo) -> bool:
        """Rebuilt whole by another ingester of it after the loss this rebuild is for, and not flagged since."""
        epoch = self._epochs.get(pod, "")
        return bool(epoch) and info.rebuilt_epoch == epoch and not info.incomplete

    async def _reset(self, pod: str, *, keep_flag: bool = False) -> tuple[PodInfo, bool]:
        """Clear a pod and its seqs before a whole replay applies from seq 0 (as ``Index.reset_pod`` does); what
        the pod was before, and whether every rank was cleared (tried RESET_TRIES times; not if another ingester
        rebuilt it after the same loss). On a cluster the pod's outbox runs first (as ``Index.clear_pod`` does):
        this writer's entries all, even those kept for a replica (one held back while its master was lost: run
        again after the clearing it would write back entries and bits the pod's state no longer lists, which no
        later clear, an AllBlocksCleared or a restart, could then remove), and other writers' entries only once
        their writer is gone (older than the takeover time). A live writer's young entry is a batch whose changes
        are still on their way to the other shards: run here and deleted, the clearing went at once and those
        changes landed after it (the leftovers of test_a_clearing_waits_for_a_live_writers_batch_on_its_way_and_
        leaves_nothing); left, it makes the clearing wait for them (lua/pod_step.lua "busy"). A try again (the
        seq moved) only asks the barrier about this writer's kept entries (``stale_only``). ``keep_flag`` (a rebuild):
        a flagged pod stays flagged in the clearing's own step, since a reset says "exact" (a new engine's state)
        and the pod is not until its replay is in (flagged again after it, it read exact and empty meanwhile)."""
        for attempt in range(RESET_TRIES):
            again = attempt > 0 or pod in self._rounds
            await self.valkey.call(self.index.drain_outbox, pod, stale_only=again)
            info = await self.valkey.call(self.index.meta.pod_info, pod)
            if not info.seqs:
                return info, True
            if self._rebuilt_by_another(pod, info):
                return info, False
            flag = (info.incomplete_reason or "rebuilding") if keep_flag and info.incomplete else None
            for rank, last in sorted(info.seqs.items()):
                # One that applies clears the whole pod, every rank's seq with it. One refused: that rank's seq
                # moved meanwhile (another ingester of the pod, --copies, applied a batch); the next rank may still
                # apply, and the next try reads the seqs again.
                if await self.valkey.call(self.index.reset_if_seq, pod, int(rank), last, flag=flag):
                    return info, True
        return info, False

    def cancel(self, pods: set[str] | None = None) -> None:
        """Stop resuming these pods (None: all): let go, or the ingester stops (``Applier.let_go`` drops their
        parked batches beside this)."""
        for pod, task in list(self._fetching.items()):
            if pods is None or pod in pods:
                task.cancel()
                del self._fetching[pod]
                self._forget(pod)

    @staticmethod
    def _whole(fetched: list[tuple[int, list, bool]]) -> bool:
        """Every replay socket answered completely, from seq 0, with no seq missing."""
        for first, frames, complete in fetched:
            seqs = [f.seq for f in frames if f.seq is not None and f.batch is not None]
            if not complete or first != 0 or seqs != list(range(len(seqs))):
                return False
        return bool(fetched)

    async def _fetch(self, pod: str) -> list[tuple[int, list, bool]]:
        """(first seq asked, frames, complete) per replay socket of the pod."""
        route = self.routes.pods[pod]
        info = await self.valkey.call(self.index.meta.pod_info, pod)
        seqs = {} if pod in self._rebuilding else info.seqs  # a rebuild asks for everything from seq 0
        ranks = {r: s.replay for (p, r), s in self.routes.rank_sources.items() if p == pod and s.replay}
        if ranks:  # each rank from its own replay socket, from its own seq
            todo = [(seqs.get(str(r), -1), replay) for r, replay in sorted(ranks.items())]
        else:
            todo = [(max(seqs.values()) if seqs else -1, route.replay)]
        out = []
        for last, replay in todo:
            frames, complete = await fetch_replay(replay, last + 1, timeout_s=self.cfg.replay_timeout_s,
                                                   source=self.routes.replay_source(replay))
            log.info("resume %s from seq %d: %d batch(es) in the engine's replay buffer%s", pod, last + 1, len(frames),
                     "" if complete else " (no complete answer)")
            out.append((last + 1, frames, complete))
        return out

    async def _apply(self, pod: str, fetched: list[tuple[int, list, bool]], *, stop_at_gap: bool = False) -> int | None:
        """Apply what the replay sockets answered, in order; ``stop_at_gap``: the seq of the first batch that found a
        gap, where the rest is left unapplied (None: all of it went)."""
        route = self.routes.pods.get(pod)
        if route is None:
            return None
        for _, frames, _ in fetched:
            for f in frames:
                if f.batch is not None and f.seq is not None:
                    if f.skipped:
                        await self.counters.count("placeholder_events", f.skipped)
                    status = await self.applier.apply(pod, route.model, f.seq, f.batch, allow_replay=False,
                                                      decode_errors=len(f.errors), resumed=True,
                                                      stop_at_gap=stop_at_gap)
                    if status == "gap" and stop_at_gap:
                        return f.seq
        return None

    def probe_later(self, src: Source, *, catch_up: bool = False) -> None:
        """``probe_restart`` in a task of its own: a replay socket slow to answer costs its timeout there, not
        in the loop. What it finds (the pods whose engine restarted) the loop applies (``apply_probed``), between
        its batches: a reset sent from the probe's task went beside the loop's next batches of the pod, the
        restarted engine's, and on a cluster the clearing's changes could land after theirs. With ``catch_up``
        (the source's stream had gone down): then its pods are resumed from their persisted seqs (``schedule``;
        each counts behind until its replay is applied), so a quiet engine's batches lost meanwhile are not left
        waiting for its next batch to show the gap."""
        running = self._probes.get(src.endpoint)
        if running is not None:
            task, asked = running
            if not task.done():
                if catch_up:  # after the probe under way
                    self._probes[src.endpoint] = (task, True)
                return  # one probe per source at a time; a reconnect during it changes nothing it would find
            self._found.extend(self._findings(task))  # ended, not applied yet: kept for ``apply_probed``
            catch_up = catch_up or asked
        self._probes[src.endpoint] = (asyncio.ensure_future(self.probe_restart(src)), catch_up)

    def probing(self) -> list[asyncio.Task]:
        """The restart probes under way: the loop wakes when one ends, to apply it (``apply_probed``)."""
        return [task for task, _ in self._probes.values()]

    @staticmethod
    def _findings(task: asyncio.Task) -> list[Restarted]:
        if task.cancelled():
            return []
        if task.exception() is not None:
            log.warning("restart probe failed (%s: %s); the stream's seq check still notices a restart",
                        type(task.exception()).__name__, task.exception())
            return []
        return task.result()

    async def apply_probed(self) -> None:
        """The resets the ended probes found, then their sources' catch-up (the loop calls it every turn)."""
        catch_up = set()
        for endpoint, (task, asked) in list(self._probes.items()):
            if task.done():
                del self._probes[endpoint]
                self._found.extend(self._findings(task))
                if asked and not task.cancelled():
                    catch_up.add(endpoint)
        found, self._found = self._found, []
        for restarted in found:
            try:
                await self._reset_restarted(restarted)
            except Exception as exc:  # one pod's refusal (it is logged and counted where it applies) stops no other
                log.warning("%s: engine restart found by the probe not reset (%s: %s); the stream's seq check still "
                            "notices it", restarted.pod, type(exc).__name__, exc)
        if catch_up:
            self.schedule(self.routes.pods_on(catch_up))

    async def probe_silent(self, src: Source, received: dict[tuple[str, int], int], grace_s: float) -> bool:
        """Whether a silent source's stream is dead: its replay socket holds batches past the last seq its stream
        delivered for a pod's rank (or past the pod's persisted seq, if higher), and they still have not come
        ``grace_s`` later (a batch in flight is not a dead stream). A socket that does not answer proves
        nothing (False): the heartbeats speak for the connection then."""
        for pod, rank in self.routes.ranks_on(src.endpoint):
            replay = self.routes.replay_endpoint(pod, rank)
            if not replay:
                continue
            info = await self.valkey.call(self.index.meta.pod_info, pod)
            last = max(received.get((pod, rank), -1), info.seqs.get(str(rank), -1))
            frames, _ = await fetch_replay(replay, last + 1, timeout_s=self.cfg.replay_timeout_s,
                                           source=self.routes.replay_source(replay))
            newer = max((f.seq for f in frames if f.seq is not None and f.batch is not None
                         and (f.batch.data_parallel_rank or 0) == rank), default=-1)
            if newer <= last:
                continue
            await asyncio.sleep(grace_s)
            if received.get((pod, rank), -1) < newer:
                log.warning("%s: silent for a while, but its engine published seq %d..%d of %s rank %d, which never "
                            "came: its stream is dead", src.endpoint, last + 1, newer, pod, rank)
                return True
        return False

    def cancel_probes(self, endpoints: set[str] | None = None) -> None:
        for endpoint, (task, _) in list(self._probes.items()):
            if endpoints is None or endpoint in endpoints:
                task.cancel()
                del self._probes[endpoint]

    async def probe_restart(self, src: Source) -> list[Restarted]:
        """On (re)connect, ask the replay socket for the last batch we applied. An engine that
        restarted (vLLM 0.32 counts seq from 0 per process) no longer has it: its cache is
        empty, so the pod's entries go now, not when it first publishes. Returns them, (pod, rank, that
        seq, the pod's last event time as read), for the loop to reset (``apply_probed``)."""
        restarted: list[Restarted] = []
        if not src.replay:
            return restarted  # no replay socket of its own (a --bind source: its pods' replays are asked by seq)
        for pod, route in list(self.routes.pods.items()):
            here = {r for (p, r), s in self.routes.rank_sources.items() if p == pod and s.endpoint == src.endpoint}
            if not here and route.source != src.endpoint:
                continue
            info = await self.valkey.call(self.index.meta.pod_info, pod)
            for rank, last in info.seqs.items():
                if last < 0:
                    continue
                # only the ranks this source publishes: another rank's seq is not in its replay buffer
                owner = self.routes.rank_sources.get((pod, int(rank)))
                if (owner.endpoint if owner is not None else route.source) != src.endpoint:
                    continue
                frames, complete = await fetch_replay(src.replay, last, timeout_s=self.cfg.replay_timeout_s, source=src)
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
                restarted.append(Restarted(pod, int(rank), last, info.last_event_time))
        return restarted

    async def _reset_restarted(self, restarted: Restarted) -> None:
        """A probe's finding applied: the pod cleared unless a batch of it applied since the probe read it. The
        restarted engine's first batches may have come first (the seq rule, lua/seq.lua, then noticed the restart
        and cleared the pod itself), and their seq may be back at the one probed: cleared again on the seq alone,
        the pod lost them and read exact."""
        pod, rank, last = restarted.pod, restarted.rank, restarted.seq
        if pod not in self.routes.pods:  # let go meanwhile
            return
        if (await self.valkey.call(self.index.meta.pod_info, pod)).last_event_time != restarted.last_event_time:
            log.info("%s: a batch applied since the restart probe; its seq check judged the restart", pod)
            return
        try:
            reset = await self.valkey.call(self.index.reset_if_seq, pod, rank, last)
        except PodLogError as exc:  # (a pod this process has not loaded yet: at start, or taken over)
            await self.applier.not_reset(pod, f"engine restart (seq {last} no longer in its buffer)", exc)
            return
        if reset:
            await self.counters.count("engine_restarts")
            log.warning("%s: engine no longer has seq %d after reconnecting: it restarted; entries cleared", pod, last)
