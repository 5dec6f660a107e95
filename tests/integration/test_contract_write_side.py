"""The write side's contract (kv_preflight/index/write_side.py), on a single node and on a Valkey Cluster: what the
ingester relies on of whichever implementation connect chose. A third backend passes these or is not one."""
from __future__ import annotations

import time

import pytest

from kv_preflight.index.entries import RemoveBlock
from kv_preflight.index.write_side import PodFlags, WriteSide
from tests.integration.contract import apply, chain, conforms, index, request_keys  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_it_has_every_member_of_the_write_side(index):
    assert conforms(index, WriteSide) == []
    assert conforms(index.meta, PodFlags) == []


async def test_an_applied_batch_is_found_by_the_lookup(index):
    assert (await apply(index, "pod-a", 0, chain("pod-a", range(1, 6)))).status == "applied"
    assert (await apply(index, "pod-b", 0, chain("pod-b", range(1, 3)))).status == "applied"
    found = sorted((m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 6))))
    assert found == [("pod-a", 5), ("pod-b", 2)]
    assert (await index.meta.pod_info("pod-a")).seqs == {"0": 0}


async def test_the_seq_check_says_dup_gap_and_restart(index):
    assert (await apply(index, "pod-a", 0, chain("pod-a", range(1, 3)))).status == "applied"
    assert (await apply(index, "pod-a", 0, chain("pod-a", range(1, 3)))).status == "dup"
    assert (await apply(index, "pod-a", 5, [])).status == "gap"
    restarted = await index.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=2.0, model="m", engine_block_size=16,
                                        mutations=chain("pod-a", range(1, 2)))
    assert restarted.status == "restart"
    assert (await index.meta.pod_info("pod-a")).seqs == {"0": 0}
    found = [(m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 3)))]
    assert found == [("pod-a", 2)], "a batch that was not applied changed nothing"


async def test_removals_and_batches_in_one_round_trip(index):
    results = await index.apply_batches([
        dict(pod_id="pod-a", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16, mutations=chain("pod-a", range(1, 5))),
        dict(pod_id="pod-a", rank=0, seq=1, ts=1.0, model="m", engine_block_size=16,
             mutations=[RemoveBlock(4, "gpu"), RemoveBlock(3, "gpu")]),
    ])
    assert [r.status for r in results] == ["applied", "applied"]
    sent = await index.send_batches([dict(pod_id="pod-b", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                                          mutations=chain("pod-b", range(1, 4)))])
    assert [r.status for r in await sent] == ["applied"]
    found = sorted((m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 5))))
    assert found == [("pod-a", 2), ("pod-b", 3)]


async def test_the_pod_state_names_the_keys_of_each_block_the_pod_holds(index):
    """What the ingester chains a child from: loaded from the pod's log by a process that has not planned it."""
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 4)))
    index.forget_cached(["pod-a"])
    state = await index.pod_state("pod-a")
    assert state.block_keys(2) == ((1002,), 1001) and state.block_keys(9) is None


async def test_clear_empties_a_pod_and_keeps_it_listed(index):
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 5)))
    await apply(index, "pod-b", 0, chain("pod-b", range(1, 3)))
    assert await index.clear_pod("pod-a") == 4
    assert [(m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 5)))] == [("pod-b", 2)]
    assert "pod-a" in await index.meta.pod_ids()
    assert (await apply(index, "pod-a", 1, chain("pod-a", range(1, 2)))).status == "applied", "its seq is kept"


async def test_forget_drops_the_pod_and_a_new_engine_starts_it_again(index):
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 4)))
    assert await index.clear_pod("pod-a", forget=True) == 3
    index.forget_cached(["pod-a"])
    assert "pod-a" not in await index.meta.pod_ids()
    assert await index.lookup(request_keys(range(1, 4))) == []
    assert (await apply(index, "pod-a", 0, chain("pod-a", range(1, 3)))).status == "applied"
    assert [(m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 4)))] == [("pod-a", 2)]


async def test_reset_if_seq_and_reset_pod(index):
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 4)))
    await apply(index, "pod-a", 1, [])
    assert not await index.reset_if_seq("pod-a", 0, 0), "its seq moved on: not reset"
    assert [(m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 4)))] == [("pod-a", 3)]
    assert await index.reset_if_seq("pod-a", 0, 1)
    assert await index.lookup(request_keys(range(1, 4))) == []
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 3)))
    await index.meta.mark_incomplete("pod-a", "a test")
    assert (await index.meta.pod_info("pod-a")).incomplete
    assert await index.reset_pod("pod-a") == 2
    info = await index.meta.pod_info("pod-a")
    assert not info.incomplete and info.seqs == {}


async def test_reset_if_seq_can_leave_the_pod_flagged_in_its_own_step(index):
    """A rebuild's clearing: the pod stays flagged through it (the reset alone says exact, and flagged again after
    it, the pod read exact and empty for that moment), the flag's reason the one given."""
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 4)))
    await index.meta.mark_incomplete("pod-a", "a shard lost its data")
    assert await index.reset_if_seq("pod-a", 0, 0, flag="a shard lost its data")
    info = await index.meta.pod_info("pod-a")
    assert (info.incomplete, info.incomplete_reason, info.seqs) == (True, "a shard lost its data", {})
    assert await index.lookup(request_keys(range(1, 4))) == []
    assert (await apply(index, "pod-a", 0, chain("pod-a", range(1, 2)))).status == "applied"
    assert (await index.meta.pod_info("pod-a")).incomplete, "a batch after it leaves the flag"


async def test_nothing_is_left_to_drain_after_batches_applied(index):
    """Whatever a batch leaves to finish (a cluster's outbox) is finished by a drain; running it again changes
    nothing the lookup sees."""
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 4)))
    assert await index.drain_outbox("pod-a") >= 0
    drained = await index.drain_outboxes(["pod-a"], at_once=4)
    assert set(drained) <= {"pod-a"} and all(isinstance(n, int) and n >= 0 for n in drained.values())
    deadline = time.monotonic() + 20
    while (await index.meta.pod_info("pod-a")).pending_effects and time.monotonic() < deadline:
        await index.drain_outbox("pod-a")  # (an entry waits for a replica's WAIT: under load it may time out)
    assert (await index.meta.pod_info("pod-a")).pending_effects == 0
    assert [(m.pod_id, m.blocks) for m in await index.lookup(request_keys(range(1, 4)))] == [("pod-a", 3)]
    counts = index.write_counts()
    assert set(counts) == {"unreplicated", "confirmed_late", "late_runs"} and min(counts.values()) >= 0
