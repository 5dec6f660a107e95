"""Routines of kv_preflight/_speedups.c held equal to their Python twins by property tests, for those that had
only examples or seeded cases: ``request_keys_json`` (the prediction's fast path) against the ordinary decode and
``request_keys_reference``, ``slot_groups`` against ``slot_groups_reference``, ``pack_u64s`` against ``struct``,
``prefix_matches`` against presence.py's Python walk (``prefix_from_bits`` given ``wanted``).
The other routines' property tests live beside their modules' tests: ``request_keys`` and ``pack_keys``
(test_keys_fast.py), ``pack_command`` (test_keys_fast.py), ``delta_columns`` and ``snapshot_columns``
(test_pod_state.py), ``affinities`` (test_score.py)."""
from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.index.entries import PodMatch
from kv_preflight.index.presence import prefix_from_bits
from kv_preflight.index.slots import SLOTS, UNSERVED, slot_groups_reference
from kv_preflight.keys import chain

_speedups = pytest.importorskip("kv_preflight._speedups")

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(U32, min_size=1, max_size=70), block_size=st.integers(1, 17), seed=st.sampled_from(["", "42"]),
       space=SPACE)
def test_request_keys_json_equals_the_reference_on_any_spacing(tokens, block_size, seed, space):
    raw = ("[" + space + ("," + space).join(map(str, tokens)) + space + "]").encode()
    want = chain.request_keys_reference(tokens, model="m", hash_seed=seed, block_size=block_size)
    assert _speedups.request_keys_json(chain.root_key("m", seed), raw, block_size) == (want, len(tokens))


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.lists(st.integers(-(2**40), 2**40)), st.lists(st.floats(allow_nan=False), min_size=1),
                       st.text(max_size=8), st.dictionaries(st.text(max_size=3), U32, max_size=2)))
def test_request_keys_json_refuses_what_the_ordinary_decode_would_judge(value):
    """Anything but an array of integers in [0, 2**32) is refused, so the caller decodes it the ordinary way."""
    raw = json.dumps(value).encode()
    ok = isinstance(value, list) and all(isinstance(v, int) and 0 <= v < 2**32 for v in value)
    if ok:
        want = chain.request_keys_reference(value, model="m", block_size=16)
        assert _speedups.request_keys_json(chain.root_key("m", ""), raw, 16) == (want, len(value))
    else:
        with pytest.raises((ValueError, TypeError, OverflowError)):
            _speedups.request_keys_json(chain.root_key("m", ""), raw, 16)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(U64, max_size=200), shards=st.integers(1, 7), prefix=st.sampled_from(["", "engine:"]),
       seed=st.integers(0, 2**32 - 1), unserved=st.sampled_from([0.0, 0.05, 1.0]))
def test_slot_groups_equals_the_reference(keys, shards, prefix, seed, unserved):
    import random

    rng = random.Random(seed)
    table = bytes(UNSERVED if rng.random() < unserved else rng.randrange(shards) for _ in range(SLOTS))
    assert _speedups.slot_groups(keys, table, shards + 1, prefix.encode()) == \
        slot_groups_reference(keys, table, shards, prefix)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(U64, st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1])), max_size=100))
def test_pack_u64s_equals_struct(values):
    assert _speedups.pack_u64s(values) == struct.pack(f"<{len(values)}Q", *values)


@pytest.mark.parametrize("bad", [[-1], [2**64], [1, -(2**70)], [2**64 + 5, 0]])
def test_pack_u64s_refuses_what_struct_refuses(bad):
    """pod_log._u64s falls back to struct on these, which names the value."""
    with pytest.raises((OverflowError, TypeError)):
        _speedups.pack_u64s(bad)
    with pytest.raises(struct.error):
        struct.pack(f"<{len(bad)}Q", *bad)


def _bitmap(nums: set[int]) -> bytes:
    out = bytearray((max(nums) // 8 + 1) if nums else 0)
    for n in nums:
        out[n // 8] |= 1 << n % 8
    return bytes(out)


@st.composite
def one_tier_chains(draw):
    """A chain whose keys have one tier each: pods (numbers, some unnamed) each holding a prefix with gaps after
    it, keys nobody holds (b"" or None), bitmaps of any width."""
    n_keys = draw(st.integers(1, 30))
    nums = draw(st.lists(st.integers(0, 200), min_size=1, max_size=20, unique=True))
    held = {n: draw(st.integers(0, n_keys)) for n in nums}
    extra = {n: draw(st.sets(st.integers(0, n_keys - 1), max_size=3)) for n in nums}  # bits past a pod's prefix
    tiers = [draw(st.sampled_from(["gpu", "cpu"])) for _ in range(n_keys)]
    maps: list = []
    for i in range(n_keys):
        at = {n for n in nums if i < held[n] or i in extra[n]}
        maps.append(_bitmap(at) if at else draw(st.sampled_from([b"", None])))
    names = {n: f"pod-{n}" for n in nums if draw(st.booleans()) or n == nums[0]}
    end = draw(st.integers(0, n_keys))
    return maps, tiers, names, end


def _python_walk(maps, tiers, names, end):
    per_key = [{tiers[i]: b} if b else None for i, b in enumerate(maps)]
    return prefix_from_bits(per_key, names, wanted=dict(names), cut=end)


@settings(max_examples=300, deadline=None)
@given(one_tier_chains())
def test_prefix_matches_equals_the_python_walk(chain):
    maps, tiers, names, end = chain
    got = _speedups.prefix_matches(maps, end, names, tiers[:end], PodMatch)
    assert sorted((m.pod_id, m.blocks, m.tier) for m in got) == \
        sorted((m.pod_id, m.blocks, m.tier) for m in _python_walk(maps, tiers, names, end))
