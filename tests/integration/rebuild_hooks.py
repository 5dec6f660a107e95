"""A hooks plugin (kv_preflight/index/hooks.py) for the two-ingester rebuild tests (tests/integration/test_cluster.py):
a process started with ``KVPF_TEST_HOOKS=tests.integration.rebuild_hooks`` lets a test drive the interleaving that,
under load, happens only now and then.

* ``KVPF_TEST_RESET_AFTER_MOVE=N``: this process's first N clearings conditional on a seq (``Index.reset_if_seq``,
  which a rebuild's ``Resume._reset`` calls with the seq it just read) wait until another writer's batch has moved
  that seq, then go, and are refused: as when that batch lands between the rebuild's read and its clearing.
* ``KVPF_TEST_EPOCH_GATE=<path>``: once this process has claimed the index's epoch, it looks at the epoch again
  only once ``<path>`` exists: its chores come after another ingester has noticed a loss and acted on it.
* ``KVPF_TEST_PAUSE_AFTER_STEP=N:<path>``: right after the pod step that holds this process's N-th outbox entry (a
  Valkey Cluster's batch: its seq moved, its changes not yet run on their shards), the whole process stops (as a
  writer the scheduler left waiting) until ``<path>`` exists, having written ``<path>.paused`` to say so: another
  writer then acts while this batch is on its way.
* ``KVPF_TEST_TAKEOVER_MS=N``: this process's cluster writes take N ms for the takeover time (2000): its window on
  its own entries (three quarters of it) is as much longer, so a test can pause it well inside that window.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from kv_preflight.index import hooks
from kv_preflight.index.index import Index
from kv_preflight.ingester.ingester import Ingester

log = logging.getLogger("kvpf.ingester")

late_resets = int(os.environ.get("KVPF_TEST_RESET_AFTER_MOVE") or 0)
gate = os.environ.get("KVPF_TEST_EPOCH_GATE", "")
MOVE_WAIT_S = 30.0
pause_at, _, pause_gate = os.environ.get("KVPF_TEST_PAUSE_AFTER_STEP", "").partition(":")
entries_left = int(pause_at or 0)
PAUSE_MAX_S = 60.0
takeover_ms = int(os.environ.get("KVPF_TEST_TAKEOVER_MS") or 0)

if takeover_ms:
    from kv_preflight.index.cluster.writes import ClusterWrites

    writes_init = ClusterWrites.__init__

    def init_with_takeover(self, *args, **kwargs) -> None:
        writes_init(self, *args, **{**kwargs, "takeover_ms": takeover_ms})

    ClusterWrites.__init__ = init_with_takeover  # type: ignore[method-assign]

if late_resets:
    reset_if_seq = Index.reset_if_seq

    async def reset_after_a_move(self: Index, pod_id: str, rank: int, expected_last: int, **kw) -> bool:
        global late_resets
        if late_resets > 0:
            late_resets -= 1
            deadline = time.monotonic() + MOVE_WAIT_S
            while (await self.meta.pod_info(pod_id)).seqs.get(str(rank), -1) == expected_last:
                if time.monotonic() > deadline:
                    log.error("KVPF_TEST_RESET_AFTER_MOVE: %s's seq stayed at %d", pod_id, expected_last)
                    break
                await asyncio.sleep(0.01)
            log.warning("KVPF_TEST_RESET_AFTER_MOVE: %s cleared if its seq is still %d", pod_id, expected_last)
        return await reset_if_seq(self, pod_id, rank, expected_last, **kw)

    Index.reset_if_seq = reset_after_a_move  # type: ignore[method-assign]

if gate:
    check_epoch = Ingester.check_epoch

    async def gated_check_epoch(self: Ingester) -> None:
        if self.epoch is not None and not os.path.exists(gate):
            return
        await check_epoch(self)

    Ingester.check_epoch = gated_check_epoch  # type: ignore[method-assign]

if entries_left:
    after_step = hooks.after_step

    def pause_after_step(point: str, batches: int) -> None:
        global entries_left
        if point == "pod_step" and batches and entries_left > 0:
            entries_left -= batches
            if entries_left <= 0:
                log.warning("KVPF_TEST_PAUSE_AFTER_STEP: paused after a pod step until %s exists", pause_gate)
                with open(pause_gate + ".paused", "w"):
                    pass
                deadline = time.monotonic() + PAUSE_MAX_S
                while not os.path.exists(pause_gate) and time.monotonic() < deadline:
                    time.sleep(0.01)  # the whole process stalls: no other task of it runs meanwhile
                log.warning("KVPF_TEST_PAUSE_AFTER_STEP: resumed")
        after_step(point, batches)

    hooks.after_step = pause_after_step
