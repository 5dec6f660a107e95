"""A hooks plugin (kv_preflight/index/hooks.py) for the two-ingester rebuild tests (tests/integration/test_cluster.py):
a process started with ``KVPF_TEST_HOOKS=tests.integration.rebuild_hooks`` lets a test drive the interleaving that,
under load, happens only now and then.

* ``KVPF_TEST_RESET_AFTER_MOVE=N``: this process's first N clearings conditional on a seq (``Index.reset_if_seq``,
  which a rebuild's ``Resume._reset`` calls with the seq it just read) wait until another writer's batch has moved
  that seq, then go, and are refused: as when that batch lands between the rebuild's read and its clearing.
* ``KVPF_TEST_EPOCH_GATE=<path>``: once this process has claimed the index's epoch, it looks at the epoch again
  only once ``<path>`` exists: its chores come after another ingester has noticed a loss and acted on it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from kv_preflight.index.index import Index
from kv_preflight.ingester.ingester import Ingester

log = logging.getLogger("kvpf.ingester")

late_resets = int(os.environ.get("KVPF_TEST_RESET_AFTER_MOVE") or 0)
gate = os.environ.get("KVPF_TEST_EPOCH_GATE", "")
MOVE_WAIT_S = 30.0

if late_resets:
    reset_if_seq = Index.reset_if_seq

    async def reset_after_a_move(self: Index, pod_id: str, rank: int, expected_last: int) -> bool:
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
        return await reset_if_seq(self, pod_id, rank, expected_last)

    Index.reset_if_seq = reset_after_a_move  # type: ignore[method-assign]

if gate:
    check_epoch = Ingester.check_epoch

    async def gated_check_epoch(self: Ingester) -> None:
        if self.epoch is not None and not os.path.exists(gate):
            return
        await check_epoch(self)

    Ingester.check_epoch = gated_check_epoch  # type: ignore[method-assign]
