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


def test_one_slot_map_read_from_two_nodes_compares_equal():
    """The write path compares slot maps by content (a kept outbox entry runs again only when the map moved):
    the same map listed in another order (another node answered CLUSTER SLOTS) is the same map, and a slot
    served by another primary, or left unserved, is not."""
    from kv_preflight.index.slots import canonical_table

    owners = {s: ("10.0.0.2:6379" if s < 5000 else "10.0.0.1:6379" if s < 11000 else "10.0.0.3:6379")
              for s in range(SLOTS)}
    a = slot_table(owners)
    b = slot_table(dict(reversed(list(owners.items()))))  # the primaries met in another order
    assert a[1] != b[1] and a[0] != b[0]
    assert canonical_table(*a) == canonical_table(*b)
    assert canonical_table(*a)[1] == ("10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.3:6379")
    moved = slot_table({**owners, 42: "10.0.0.3:6379"})
    assert canonical_table(*moved) != canonical_table(*a)
    unserved = slot_table({s: n for s, n in owners.items() if s != 42})
    assert canonical_table(*unserved)[0][42] == UNSERVED and canonical_table(*unserved) != canonical_table(*a)
