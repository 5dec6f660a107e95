"""The read side's contract (kv_preflight/index/read_side.py), on a single node and on a Valkey Cluster: what a
predictor relies on to answer, whichever implementation connect chose."""
from __future__ import annotations

import pytest

from kv_preflight.index.read_side import AnswerMeta, ReadSide
from tests.integration.contract import apply, chain, conforms, index, request_keys  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_it_has_every_member_of_the_read_side(index):
    assert conforms(index, ReadSide) == []
    assert conforms(index.meta, AnswerMeta) == []


async def written(index) -> list[int]:
    """Three pods with prefixes 6, 3 and 1 of one chain, one of them holding a key past a gap (not a prefix)."""
    await apply(index, "pod-a", 0, chain("pod-a", range(1, 7)))
    await apply(index, "pod-b", 0, chain("pod-b", range(1, 4)) + chain("pod-b", range(5, 6)), model="n")
    await apply(index, "pod-c", 0, chain("pod-c", range(1, 2), tier="cpu"))
    return request_keys(range(1, 9))


@pytest.mark.parametrize("mode", ["script", "linear"])
async def test_the_lookup_gives_each_pods_prefix_of_the_chain(index, mode):
    keys = await written(index)
    found = sorted((m.pod_id, m.blocks, m.tier) for m in await index.lookup(keys, mode=mode))
    assert found == [("pod-a", 6, "gpu"), ("pod-b", 3, "gpu"), ("pod-c", 1, "cpu")]
    detailed = await index.lookup_detailed(keys, mode=mode)
    assert sorted((m.pod_id, m.blocks) for m in detailed.matches) == [("pod-a", 6), ("pod-b", 3), ("pod-c", 1)]
    assert not detailed.partial


async def test_the_lookup_names_only_the_pods_asked_and_misses_are_empty(index):
    keys = await written(index)
    assert [(m.pod_id, m.blocks) for m in await index.lookup(keys, ["pod-b", "nope"])] == [("pod-b", 3)]
    assert sorted((m.pod_id, m.blocks) for m in await index.lookup(keys[1:])) == [("pod-a", 5), ("pod-b", 2)]
    assert await index.lookup(request_keys(range(50, 55))) == []
    assert await index.lookup([]) == []


async def test_llm_ds_own_lookup_reads_the_entries(index):
    keys = await written(index)
    fields = await index.fields_per_key(keys)
    assert len(fields) == 6, "trimmed at the first key nobody holds"
    assert [len(f) for f in fields] == [3, 2, 2, 1, 2, 1]  # key 5: pod-a and pod-b past its gap
    assert b'"PodIdentifier":"pod-a"' in b"".join(fields[0])


async def test_the_meta_answers_carry(index):
    await written(index)
    assert await index.meta.pod_ids() == {"pod-a": "m", "pod-b": "n", "pod-c": "m"}
    infos = {i.pod_id: i for i in await index.meta.scoring_infos(["pod-a", "pod-b", "nope"])}
    assert infos["pod-a"].engine_block_size == 16 and not infos["pod-a"].incomplete
    await index.meta.mark_incomplete("pod-b", "a test")
    assert [i.incomplete for i in await index.meta.pod_infos(["pod-a", "pod-b"])] == [False, True]
    assert (await index.meta.pod_info("pod-a")).blocks == 6
    assert all(isinstance(n, int) for n in (await index.meta.counters()).values())
    assert index.gap_walks >= 0 and index.late_reads >= 0 and index.foreign_reads == 0
