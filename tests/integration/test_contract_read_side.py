"""The read side's contract (kv_preflight/index/read_side.py), on a single node and on a Valkey Cluster: what a
predictor relies on to answer, whichever implementation connect chose."""
from __future__ import annotations

import pytest

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec
from kv_preflight.index.entries import CHAIN_ROOT, StoreBlock, encode_entry, make_entry
from kv_preflight.index.presence import as_int, numbers
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


async def test_a_hybrid_pods_other_group_bits_and_numbers(index):
    """A pod with a sliding-window group beside full attention: its window group holds keys 3 and 4 of the
    chain; a plain pod beside it holds the chain in its one group. Each key's bits in the other groups, and the
    pods' numbers that read them; the lookup's own read of them, when it covers the keys, taken as it is."""
    await written(index)
    groups = {0: GroupSpec(FULL), 1: GroupSpec(SLIDING, sliding_window=32)}

    def stores(engine_keys: range, group: int) -> list[StoreBlock]:
        field = encode_entry(make_entry("pod-h", "GPU", group))
        return [StoreBlock(k, "gpu", field, (1000 + k,), group, parent=CHAIN_ROOT if k == 1 else 999 + k)
                for k in engine_keys]

    r = await index.apply_batch(pod_id="pod-h", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                                mutations=stores(range(1, 5), 0) + stores(range(3, 5), 1), groups=groups)
    assert r.status == "applied", r
    keys = request_keys(range(1, 5))
    bits, nums = await index.group_presence(keys, ["pod-h", "pod-a", "nope"])
    assert sorted(nums) == ["pod-a", "pod-h"] and nums["pod-h"] != nums["pod-a"]
    held = [{(tier, group): numbers(as_int(bitmap)) for (tier, group), bitmap in per_key.items()} for per_key in bits]
    assert held == [{}, {}, {("gpu", 1): [nums["pod-h"]]}, {("gpu", 1): [nums["pod-h"]]}]
    assert (await index.group_presence(keys[:2], ["pod-h"]))[0] == [{}, {}]
    lookups = [{("gpu", 1): b"\x80"}] * 5  # a lookup's read covering the keys: taken, not read again
    assert (await index.group_presence(keys, ["pod-h"], have=lookups))[0] == lookups[:4]
    assert (await index.group_presence(keys, ["pod-h"], have=lookups[:3]))[0] == bits  # too short: read
