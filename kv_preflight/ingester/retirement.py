"""How a pod leaves the index under the fleet, and comes back: the retirements the ingester that is a pod's
rendezvous owner carries out (its engine left discovery, stayed unreachable, or no live lease lists the pod for
--retire-after), the end of a retired pod's retention, and a retired pod answering again. The work runs in
tasks of its own (``leaving``), since each waits for every lease to say the pod was let go
(kv_preflight/index/lifecycle.py); ingester/fleet_member.py decides when, this module does it."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

import msgspec

from kv_preflight.config import Config
from kv_preflight.index.lifecycle import flag_retired, forget_pods, readable, retire_pods
from kv_preflight.fleet.records import MAX_LEASE_SOURCES, PodRecord
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.membership_rules import expired_retired, rendezvous_owners, retired, unlisted

log = logging.getLogger("kvpf.ingester")

RETIRE_TRIES = 5  # a retirement whose Valkey calls fail is tried again this many times, a second apart


class Retirements:
    def __init__(self, index: Index, cfg: Config, counters: Counters, schedule_rebuild: Callable[[str], None],
                 not_reset: Callable[[str, str, PodLogError], Awaitable[None]]):
        self.index = index
        self.cfg = cfg
        self.counters = counters
        self.schedule_rebuild = schedule_rebuild
        # a pod leaving the index whose state log does not read: its entries cannot be found to clear, so they stay,
        # the pod flagged with the reason, logged and counted (the ingester's Applier.not_reset); nothing is let go,
        # its metadata and number stay (freed, the number would name another pod in those entries)
        self.not_reset = not_reset
        # pod -> its retirement or drop under way: it waits for every lease (this one's too, renewed beside the
        # rounds) to say the pod was let go, so it never runs inside a round
        self.leaving: dict[str, asyncio.Task] = {}
        self.unlisted: dict[str, int] = {}  # recorded pod no live lease lists -> Valkey ms first seen so (unlisted)
        self.kept: set[str] = set()  # retired pods not dropped at their retention's end: their state log does not read

    async def retire(self, pod: str, record: PodRecord) -> None:
        """Entries cleared in O(the pod's blocks) once every ingester let the pod go (a copy's batch in
        flight would write them back otherwise); flagged at once, in the round, so a retired pod is not seen
        unflagged while the rest waits in its task."""
        await flag_retired(self.index, pod, record.reason)
        self._leave([pod], self._retired(pod, record.reason))

    async def _retired(self, pod: str, reason: str) -> None:
        """The retirement's task. Its record already says retired, so no later round would try again: it
        tries again itself while Valkey fails."""
        for attempt in range(1, RETIRE_TRIES + 1):
            try:
                cleared = (await retire_pods(self.index, {pod: reason}))[pod]
                break
            except PodLogError as exc:
                await self.not_reset(pod, f"retired ({reason})", exc)
                return
            except VALKEY_ERRORS as exc:
                if attempt == RETIRE_TRIES:
                    raise
                log.warning("pod %s: retiring it failed (%s); trying again", pod, exc)
                await asyncio.sleep(1.0)
        await self.counters.count("pods_retired")
        log.warning("pod %s retired (%s): %d entries cleared", pod, reason, cleared)

    async def _dropped(self, pods: list[str]) -> None:
        """The end of a retention: its records stay until this is done, so a round after a failure tries again
        (not after a state log that does not read: ``kept``)."""
        unread: dict[str, PodLogError] = {}
        for pod in pods:
            try:
                await readable(self.index, [pod])
            except PodLogError as exc:
                unread[pod] = exc
        dropped = [p for p in pods if p not in unread]
        try:
            if dropped:
                await forget_pods(self.index, dropped, keep_refusing=False)
        except PodLogError as exc:  # (one of their data-parallel ranks' pods)
            unread.update((pod, exc) for pod in dropped)
            dropped = []
        for pod, exc in unread.items():
            self.kept.add(pod)
            await self.not_reset(pod, "retention over", exc)
        if dropped:
            log.info("retired pod(s) %s dropped from the registry after %.0f s", dropped, self.cfg.retired_retention_s)

    def _leave(self, pods: list[str], work) -> None:
        task = asyncio.ensure_future(work)
        for pod in pods:
            self.leaving[pod] = task
        task.add_done_callback(functools.partial(self._left, pods))

    def _left(self, pods: list[str], task: asyncio.Task) -> None:
        for pod in pods:
            if self.leaving.get(pod) is task:
                del self.leaving[pod]
        if not task.cancelled() and task.exception() is not None:
            log.error("pod(s) %s: leaving the index failed (%s: %s)", pods, type(task.exception()).__name__,
                      task.exception())

    async def sweep(self, view, fleet_urls: set[str], now_ms: int, me: str, live: list[str],
                    attached: set[str]) -> None:
        """The round's retirements of the pods this ingester is the rendezvous owner of (``me`` among ``live``):
        a pod whose engine left discovery, one no live lease lists for --retire-after, and the end of a retired
        pod's retention. ``attached``: the pods this ingester's engines publish."""
        for pod, rec in sorted(view.pods.items()):
            if rendezvous_owners(pod, live, 1)[0] != me:
                continue
            if pod in self.leaving:
                continue
            if rec.state != "retired" and rec.engine_url and rec.engine_url not in fleet_urls \
                    and pod not in attached:
                record = retired(rec, now_ms, f"engine {rec.engine_url} left discovery")
                # only if nobody changed the record meanwhile (a new engine taking over the pod id)
                if await self.index.fleet.replace_pod_record(pod, rec, record):
                    await self.retire(pod, record)
        # A recorded pod no live lease lists (private ones included: they vouch for their pods) has no ingester:
        # retired after --retire-after, as an engine unreachable that long is. Only when every lease lists all
        # its pods (none truncated, none from an ingester that predates the list).
        leases = view.live_ingesters().values()
        if all(lease.state and len(lease.pods) < MAX_LEASE_SOURCES for lease in leases):
            listed = {p for lease in leases for p in (*lease.pods, *lease.batch_ts)}
            listed |= attached | set(self.leaving)
            mine = {p: r for p, r in view.pods.items() if rendezvous_owners(p, live, 1)[0] == me}
            self.unlisted, due = unlisted(mine, listed, self.unlisted, now_ms, int(self.cfg.retire_after_s * 1000))
            for pod in due:
                rec = view.pods[pod]
                why = f"no ingester has ingested it for {(now_ms - self.unlisted.pop(pod)) / 1000:.0f} s"
                # without its engine URL, whose engine may live on under another pod (the ghost of a one-off run
                # naming pods its own way): the record is dropped after --retired-retention like any other
                engine = rec.engine_url or "not known"
                record = msgspec.structs.replace(retired(rec, now_ms, f"{why} (engine {engine})"), engine_url="")
                if await self.index.fleet.replace_pod_record(pod, rec, record):
                    await self.retire(pod, record)
        # a retired pod whose engine is still known (unreachable, not gone) may still be attached somewhere: its
        # record stays until the engine leaves, so its metadata is never forgotten under an ingester that owns it
        gone = expired_retired(
            {p: r for p, r in view.pods.items() if rendezvous_owners(p, live, 1)[0] == me
             and not (r.engine_url and r.engine_url in fleet_urls) and p not in self.leaving and p not in self.kept},
            now_ms, int(self.cfg.retired_retention_s * 1000))
        if gone:  # its metadata and registry row too: names of departed pods do not pile up
            self._leave(list(gone), self._dropped(list(gone)))

    def returned(self, pod: str, record: PodRecord, now_ms: int) -> PodRecord:
        """A retired pod answers again: rebuilt by replay if the engine still buffers its whole history,
        else it stays flagged incomplete until its next cache reset (an engine restart resets it too). The
        replay is fetched in the background and applied by the loop (ingester/resume.py), never in this round."""
        self.kept.discard(pod)
        self.schedule_rebuild(pod)
        log.warning("pod %s is back after retirement: rebuilding it from its engine's replay buffer in the background",
                    pod)
        return msgspec.structs.replace(record, state="live", since_ms=now_ms, reason="", unreachable_since_ms=0)


__all__ = ["Retirements"]
