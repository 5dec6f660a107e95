"""Cluster slots of request keys (kv_preflight/index/slots.py): the C grouping equals the Python reference, and both
equal Valkey's own CRC16 slot (CLUSTER KEYSLOT values from Valkey's documentation)."""
from __future__ import annotations

import random

import pytest

from kv_preflight.index import slots
from kv_preflight.index.slots import SLOTS, UNSERVED, key_slot, slot_groups, slot_groups_reference, slot_table


def test_key_slot_matches_valkeys_documented_values():
    assert key_slot("foo") == 12182
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers") == key_slot("user1000") == 3443
    assert key_slot("foo{}{bar}") == key_slot("foo{}{bar}".encode())  # an empty tag: the whole name
    assert key_slot("foo{{bar}}zap") == key_slot("{bar")  # the first {...}


def test_slot_table_names_each_slot_s_primary_and_leaves_the_rest_unserved():
    owner = {s: ("a" if s < 5000 else "b") for s in range(0, 12000)}
    table, shards = slot_table(owner)
    assert shards == ["a", "b"] and len(table) == SLOTS
    assert table[0] == 0 and table[11999] == 1 and table[12000] == UNSERVED


@pytest.mark.parametrize("prefix", ["", "engine:"])
@pytest.mark.parametrize("shards", [1, 3, 7])
def test_groups_equal_the_reference_and_keep_chain_order(shards, prefix):
    rng = random.Random(shards)
    owner = {s: f"n{rng.randrange(shards)}" for s in range(SLOTS) if rng.random() > 0.05}  # some unserved
    table, names = slot_table(owner)
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 1, 2**64 - 1]
    got = slot_groups(keys, table, len(names), prefix)
    assert got == slot_groups_reference(keys, table, len(names), prefix)
    assert sorted(i for g in got for i in g) == list(range(len(keys)))
    for i, g in enumerate(got):
        assert g == sorted(g)
        for pos in g:
            owner_name = owner.get(key_slot(f"{prefix}{keys[pos]}"))
            assert (names[i] if i < len(names) else None) == owner_name


def test_a_prefix_with_a_hash_tag_is_refused():
    table, names = slot_table({s: "a" for s in range(SLOTS)})
    with pytest.raises(ValueError):
        slot_groups([1], table, len(names), "kvpf:{")


def test_the_c_routine_refuses_bad_arguments():
    if slots._speedups is None:
        pytest.skip("the C extension is not built")
    with pytest.raises(ValueError):
        slots._speedups.slot_groups([1], b"\0" * 10, 2)
    with pytest.raises(OverflowError):
        slots._speedups.slot_groups([-1], b"\0" * SLOTS, 2)
