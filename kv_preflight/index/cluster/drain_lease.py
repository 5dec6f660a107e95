"""One drain of a pod's outbox at a time (Valkey Cluster; kv_preflight/index/cluster/writes.py ``ClusterWrites.drain``).

A drain runs entries whose writer is gone or quiet, then may delete them; a clearing of the pod may follow. Two
drains of one entry at once (two clearings; a pod step's "pending" beside another ingester's chores) let the slower
one's run land after the faster one's delete and clearing: entries and bits the pod's state no longer lists, which no
later clear removes. And a writer quiet for longer than the takeover time is taken for gone: its next batch, applied
while a drain re-runs its older entries, could be overtaken by them. So a drain first takes the pod's lease
(``kvpf:{<pod>}:drain``, lua/drain_lease.lua): while one holds it, another drain runs nothing and every pod step of
the pod answers "busy" (lua/pod_step.lua).

The lease lasts the takeover time and is renewed every quarter of it while the drain waits on Valkey (a heartbeat),
and before a round whose check finds its end gone by (the process busy meanwhile: decoding a large entry): a run of
any length keeps it, as long as its renewals reach the pod's shard. A renewal that finds the lease gone (it lapsed:
the process stalled past it, a failover lost it) stops the drain before its next round (``window.in_time``, as a
writer's window does); its entries stay, for the next drain. A holder killed leaves the lease to lapse: the pod's
steps wait that long.
"""
from __future__ import annotations

import asyncio
import logging
import os

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.cluster.window import window_end
from kv_preflight.index.layout import pod_drain_key, pod_outbox_key

log = logging.getLogger("kvpf.index")

BEATS = 4  # renewals per lease


HELD, BUSY, EMPTY = 1, 0, -1  # what taking it found: held now; another drain holds it; the outbox is empty (not taken)


class DrainLease:
    """A pod's lease, held by one drain: ``async with DrainLease(...) as took``, ``took`` one of HELD, BUSY (another
    drain holds it: run nothing) and EMPTY (nothing to run: not taken)."""

    def __init__(self, script, pod: str, writer: str, ms: int) -> None:
        self.script, self.key, self.ms = script, pod_drain_key(pod), ms
        self.keys = [self.key, pod_outbox_key(pod)]
        self.holder = f"{writer}#{os.urandom(6).hex()}"  # whose it is, for whoever reads the key
        self._end = float("-inf")
        self._beat: asyncio.Task | None = None

    def end(self) -> float:
        """The monotonic time after which this drain sends no more of its run (``window.in_time``)."""
        return self._end

    async def __aenter__(self) -> int:
        until = window_end(self.ms)
        took = await self._call("take")
        if took == HELD:
            self._end = until
            self._beat = asyncio.create_task(self._renew())
        return took

    async def __aexit__(self, *exc) -> None:
        if self._beat is None:
            return
        self._beat.cancel()
        await asyncio.gather(self._beat, return_exceptions=True)
        self._beat = None
        self._end = float("-inf")
        try:
            await self._call("release")
        except VALKEY_ERRORS as e:  # it lapses within the lease: the pod's other writers wait that long
            log.warning("%s: a drain's lease was not released (%s: %s); it lapses in %d ms", self.key,
                        type(e).__name__, e, self.ms)

    async def renewed(self) -> bool:
        """Renew now (``window.in_time``, its end gone by while the process was busy): whether it was still held, and
        so held by nobody else since (a lease is taken only where none stands)."""
        if self._end == float("-inf"):
            return False
        until = window_end(self.ms)
        try:
            async with asyncio.timeout(self.ms / BEATS / 1000):
                held = await self._call("renew") == HELD
        except (TimeoutError, *VALKEY_ERRORS) as e:
            log.warning("%s: a drain's lease was not renewed (%s: %s)", self.key, type(e).__name__, e)
            return False  # ``end`` stays: past it, the drain stops
        if not held:  # lapsed (the drain's process stalled, a failover lost it): another drain may run now
            log.warning("%s: a drain's lease lapsed while it ran; it stops before its next round", self.key)
            self._end = float("-inf")
            return False
        self._end = until
        return True

    async def _renew(self) -> None:
        while self._end != float("-inf"):
            await asyncio.sleep(self.ms / BEATS / 1000)
            await self.renewed()

    async def _call(self, op: str) -> int:
        return int(await self.script(keys=self.keys, args=[op, self.holder, self.ms]))


__all__ = ["BEATS", "BUSY", "EMPTY", "HELD", "DrainLease"]
