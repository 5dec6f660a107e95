"""The cluster's slot markers (kv_preflight/index/cluster/markers.py): one per hash slot, each in its slot; and the
numbering high-water mark's copies, spread over the slots."""
from __future__ import annotations

from types import SimpleNamespace

from redis.crc import key_slot

from kv_preflight.index.cluster.markers import SLOTS, first_slots, numbering_copies, slot_markers
from kv_preflight.index.layout import NUMS_COPIES, is_presence_key


def test_every_slot_has_a_marker_in_it():
    names = slot_markers()
    assert len(names) == SLOTS == len(set(names))
    assert [key_slot(n.encode()) for n in names] == list(range(SLOTS))  # as redis-py (and Valkey) place them
    assert not any(is_presence_key(n) for n in names)  # never taken for a request key's presence hash


def test_first_slot_of_each_primary():
    a, b, c = (SimpleNamespace(name=n) for n in ("10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"))
    replica = SimpleNamespace(name="10.0.0.9:7000")
    cache = {5: [b, replica], 9: [a], 0: [a], 7000: [c], 100: [b], 6: []}  # slot 6: served by none
    assert first_slots(cache) == {"10.0.0.1:7000": 0, "10.0.0.2:7000": 5, "10.0.0.3:7000": 7000}
    assert first_slots({}) == {}


def test_the_numbering_copies_are_spread_one_in_every_1024th_slot_tagged_as_its_marker():
    """So every primary of an evenly split cluster of up to 16 holds one, whichever holds the numbering."""
    copies = numbering_copies()
    slots = [key_slot(k.encode()) for k in copies]
    assert len(copies) == NUMS_COPIES == 16 and slots == list(range(0, SLOTS, SLOTS // NUMS_COPIES))
    markers = slot_markers()
    assert [k.removesuffix(":nums") for k in copies] == [markers[s].removesuffix(":slot") for s in slots]
    assert not any(is_presence_key(k) for k in copies)
