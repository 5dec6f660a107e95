"""keys/multimodal.py: a prompt's items -> each canonical block's identifiers, per engine block size; and
keys/chain.py keying such a chain (plain runs by the C routine, the rest by the reference hash)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.keys.chain import prompt_request_keys, request_keys, request_keys_reference
from kv_preflight.keys.multimodal import MultimodalItem, canonical_extras, checked_items, engine_block_ids

A, B = MultimodalItem("a", 5, 40), MultimodalItem("b", 64, 32)


def test_engine_blocks_list_the_items_they_overlap_in_order():
    assert engine_block_ids([A, B], 32, 4) == [("a",), ("a",), ("b",), ()]
    assert engine_block_ids([MultimodalItem("x", 30, 4), MultimodalItem("y", 34, 2)], 32, 2) == [("x",), ("x", "y")]


def test_canonical_blocks_carry_every_overlapping_engine_blocks_ids():
    # E a multiple of C: each canonical block its engine block's ids (llm-d's realignExtraFeatures, 1:many)
    assert canonical_extras([A, B], 128, 16, 32) == [["a"], ["a"], ["a"], ["a"], ["b"], ["b"], None, None]
    # E = C: its own overlap
    assert canonical_extras([A, B], 128, 16, 16) == [["a"], ["a"], ["a"], None, ["b"], ["b"], None, None]
    # E dividing C: the engine blocks' ids one after the other (llm-d, many:1)
    assert canonical_extras([A], 48, 16, 8) == [["a", "a"], ["a", "a"], ["a", "a"]]
    # neither: a canonical block straddling two engine blocks has both's
    assert canonical_extras([MultimodalItem("c", 30, 4)], 64, 16, 24) == [None, ["c"], ["c"], None]
    assert canonical_extras([], 64, 16, 32) is None
    assert canonical_extras([MultimodalItem("late", 60, 4)], 40, 16, 32) is None  # past the last full block


def test_items_are_sorted_and_checked():
    assert checked_items([B, A], 128) == [A, B]
    with pytest.raises(ValueError, match="overlaps"):
        checked_items([A, MultimodalItem("z", 10, 2)], 128)
    with pytest.raises(ValueError, match="runs past"):
        checked_items([MultimodalItem("z", 120, 10)], 128)


def test_the_salt_follows_the_first_blocks_ids():
    tokens = list(range(64))
    keys = prompt_request_keys(tokens, model="m", cache_salt="s", extra_per_block=[["a"], None, ["b"], None])
    assert keys == request_keys_reference(tokens, model="m", extra_per_block=[["a", "s"], None, ["b"], None])
    assert prompt_request_keys(tokens, model="m", cache_salt="s") == \
        request_keys_reference(tokens, model="m", extra_per_block=[["s"]])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=120),
       st.lists(st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3)), max_size=9),
       st.sampled_from([4, 16]))
def test_chains_with_extras_equal_the_reference(tokens, extras, block):
    assert request_keys(tokens, model="m", block_size=block, extra_per_block=extras) == \
        request_keys_reference(tokens, model="m", block_size=block, extra_per_block=extras)
