"""The simulator's hybrid engine (``simulator/hybrid_cache.py``): vLLM 0.32's hybrid KV cache manager with a
sliding-window group beside a full-attention one, one rule per test.

Block size 4 and window 8 tokens make the window group's hit need ``ceil(7 / 4) = 2`` contiguous blocks, as
block size 32 and window 64 do for the launcher's tiny-hybrid-model. The scenario marked "observed" is what a
real vLLM 0.32 (CPU, that model, 40 blocks) published; tests/e2e/test_simulator_parity.py checks the rest live.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec, longest_hit
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_preflight.simulator import tokenizer
from kv_preflight.simulator.config import SimulatorConfig
from kv_preflight.simulator.engine import Generation, run_request
from kv_preflight.simulator.hybrid_cache import FULL_ATTENTION, SLIDING_WINDOW, HybridPrefixCache, KVCacheGroup
from tests.unit.test_sim_cache import flat, hashes_of, tokens

BS = 4
WINDOW = 8
SW, FA = 0, 1  # vLLM 0.32 numbers tiny-hybrid-model's sliding-window group 0
GROUPS = (KVCacheGroup(SLIDING_WINDOW, WINDOW), KVCacheGroup(FULL_ATTENTION))


def cache(num_blocks: int = 64, block_size: int = BS, window: int = WINDOW) -> HybridPrefixCache:
    return HybridPrefixCache(num_blocks, block_size, (KVCacheGroup(SLIDING_WINDOW, window), KVCacheGroup()))


def serve(c: HybridPrefixCache, prompt: list[int], max_tokens: int = 1) -> tuple[int, list[list]]:
    gen = Generation(prompt_ids=prompt, max_tokens=max_tokens)
    batches = [s.events for s in run_request(c, gen, tokenizer.OUTPUT_ALPHABET) if s.events]
    return gen.cached_tokens, batches


def cached_hashes(c: HybridPrefixCache, group: int) -> set[int]:
    return {h for g, h in c._cached if g == group}


def free_queue_keys(c: HybridPrefixCache) -> list[tuple[int, int] | None]:
    """Eviction order, head first: each free block's (group, hash), or None if it holds none."""
    return [c._key_of.get(b.block_id) for b in c._free.values()]


def stored_in(batches: list[list], group: int) -> list[int]:
    return [h for e in flat(batches) if isinstance(e, BlockStored) and e.group_idx == group for h in e.block_hashes]


# ---------------------------------------------------------------- configuration


def test_groups_are_one_full_attention_and_one_sliding_window():
    with pytest.raises(ValueError):
        HybridPrefixCache(16, BS, (KVCacheGroup(), KVCacheGroup()))
    with pytest.raises(ValueError):
        KVCacheGroup(SLIDING_WINDOW)  # no window
    with pytest.raises(ValueError):
        KVCacheGroup(FULL_ATTENTION, 8)
    cfg = SimulatorConfig(pod="p", model="m", sliding_window=64)
    assert cfg.kv_cache_groups == (KVCacheGroup(SLIDING_WINDOW, 64), KVCacheGroup(FULL_ATTENTION))
    assert SimulatorConfig(pod="p", model="m").kv_cache_groups is None


# ---------------------------------------------------------------- what each group caches


def test_window_group_caches_only_the_blocks_ending_at_the_replay_boundary():
    """reachable_block_mask with retention interval 0: ceil((window - 1) / block) blocks ending at
    num_prompt - 1 rounded down to a block; full attention caches every full block."""
    c = cache()
    prompt = tokens(1, 6 * BS + 1)
    _, batches = serve(c, prompt)
    h = hashes_of(prompt)
    assert stored_in(batches, FA) == h
    assert stored_in(batches, SW) == h[4:6]
    assert cached_hashes(c, SW) == set(h[4:6]) and cached_hashes(c, FA) == set(h)


def test_block_stored_fields_per_group_match_vllm():
    """take_events stamps kind and window; each group's event spans every new full block's tokens even when
    only some are cached (extra_keys None when none is)."""
    c = cache()
    prompt = tokens(1, 3 * BS + 1)
    _, batches = serve(c, prompt, max_tokens=2 * BS)
    events = [e for e in flat(batches) if isinstance(e, BlockStored)]
    sw, fa = events[0], events[1]
    assert (sw.group_idx, sw.kv_cache_spec_kind, sw.kv_cache_spec_sliding_window) == (SW, SLIDING, WINDOW)
    assert (fa.group_idx, fa.kv_cache_spec_kind, fa.kv_cache_spec_sliding_window) == (FA, FULL, None)
    assert len(sw.token_ids) == len(fa.token_ids) == 3 * BS and sw.parent_block_hash is None
    assert sw.extra_keys == [None, None] and fa.extra_keys == [None] * 3
    decode_sw = [e for e in events[2:] if e.group_idx == SW]
    assert decode_sw and all(e.block_hashes == [] and e.extra_keys is None for e in decode_sw)


# ---------------------------------------------------------------- the hit


def test_resend_hits_through_the_window_tail():
    c = cache()
    prompt = tokens(1, 6 * BS + 1)
    serve(c, prompt)
    assert serve(c, prompt)[0] == 6 * BS


def test_short_run_from_block_zero_counts():
    """No run of two cached blocks: the run from block 0 is still a hit."""
    c = cache()
    serve(c, tokens(1, BS + 1))
    assert cached_hashes(c, SW) == {hashes_of(tokens(1, BS))[0]}
    assert serve(c, tokens(1, BS + 1))[0] == BS


def test_full_attention_hit_cut_by_the_window_then_the_junction_is_cached():
    """A prompt sharing 3 blocks with an earlier one whose window blocks end elsewhere: full attention holds
    the 3 blocks, the window group not blocks 1-2, so the hit is 0; the shared prefix's end becomes a boundary
    (shared_prefix_boundary) and the window group caches the two blocks ending there, so the next sibling hits."""
    c = cache()
    base = tokens(1, 6 * BS)
    serve(c, base + [7])
    sibling = base[: 3 * BS] + tokens(2, 2 * BS)
    hit, batches = serve(c, sibling + [8])
    assert hit == 0
    h = hashes_of(sibling)
    assert stored_in(batches, SW) == [h[1], h[2], h[3], h[4]]  # the junction's tail, then the replay tail
    assert serve(c, base[: 3 * BS] + tokens(3, 2 * BS) + [9])[0] == 3 * BS


def test_observed_hybrid_vllm_events():
    """vLLM 0.32 serving tiny-hybrid-model (block 32, window 64, 40 blocks), hashes renamed by first
    appearance: a 150-token prompt with 40 outputs, its resend, a sibling cut after 100 tokens, a fresh
    300-token prompt, the first again."""
    c = cache(40, 32, 64)
    rng = random.Random(1)
    p1 = [rng.randrange(10, 8000) for _ in range(150)]
    calls = [(p1, 40), (p1, 1), (p1[:100] + [5] * 30, 2), ([rng.randrange(10, 8000) for _ in range(300)], 3),
             (p1, 1)]
    hits, batches = [], []
    for prompt, max_tokens in calls:
        hit, b = serve(c, prompt, max_tokens)
        hits.append(hit)
        batches += b
    names: dict[int, int] = {}

    def name(h):
        return None if h is None else names.setdefault(h, len(names))

    seen = [[(e.group_idx, [name(h) for h in e.block_hashes], name(e.parent_block_hash), len(e.token_ids))
             for e in b] for b in batches]
    assert hits == [0, 128, 0, 0, 128]
    assert seen == [
        [(0, [0, 1], None, 128), (1, [2, 3, 0, 1], None, 128)],
        [(0, [], 1, 32), (1, [4], 1, 32)],
        [(0, [3, 0, 5], None, 128), (1, [2, 3, 0, 5], None, 128)],
        [(0, [6, 7], None, 288), (1, [8, 9, 10, 11, 12, 13, 14, 6, 7], None, 288)],
    ]


# ---------------------------------------------------------------- the pool


def test_window_blocks_leave_the_request_during_decode():
    """From the step after the prefill, blocks wholly before the window go back to the pool (unhashed ones at
    the head, reused first); the full-attention group keeps all its blocks."""
    c = cache()
    gen = Generation(prompt_ids=tokens(1, 8 * BS + 1), max_tokens=3)
    steps = run_request(c, gen, tokenizer.OUTPUT_ALPHABET)
    next(steps)  # prefill: both groups hold a slot for every token (9 blocks each)
    assert c.num_free_blocks == 63 - 18
    next(steps)  # first decode: the window group keeps the last 3 blocks only
    assert c.num_free_blocks == 63 - 9 - 3
    assert free_queue_keys(c)[:6] == [None] * 6
    list(steps)
    assert c.num_free_blocks == 63


def test_eviction_announces_each_groups_entry_with_its_group():
    c = cache(num_blocks=2 * 4 + 1)  # room for one 4-block request in both groups
    first = tokens(1, 3 * BS + 1)
    serve(c, first)
    _, batches = serve(c, tokens(2, 3 * BS + 1))
    removed = [(e.group_idx, e.block_hashes[0]) for e in flat(batches) if isinstance(e, BlockRemoved)]
    h = hashes_of(first)
    assert sorted(removed) == sorted([(SW, h[1]), (SW, h[2])] + [(FA, x) for x in h])


def test_reset_clears_both_groups():
    c = cache()
    serve(c, tokens(1, 3 * BS + 1))
    assert c.reset()
    assert cached_hashes(c, SW) == cached_hashes(c, FA) == set()
    assert c.take_events() == [AllBlocksCleared()]
    assert serve(c, tokens(1, 3 * BS + 1))[0] == 0


# ---------------------------------------------------------------- against the predictor's rule


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(1, 30), st.integers(1, 12)),
                min_size=1, max_size=30))
def test_cached_tokens_equal_vllms_rule_over_what_the_events_say(ops):
    """Replaying the events into per-group sets, vLLM's hit rule as the predictor applies it
    (engines/hit_rules.longest_hit) gives the simulator's cached_tokens for every request, through evictions:
    the events say exactly what each group holds."""
    c = cache(num_blocks=24)
    held: dict[int, Counter[int]] = {SW: Counter(), FA: Counter()}  # a hash may be held by two blocks
    specs = {SW: GroupSpec(kind=SLIDING, sliding_window=WINDOW), FA: GroupSpec(kind=FULL)}
    prefixes = [tokens(k + 1, 5 * BS) for k in range(4)]
    for prefix, cut, extra, max_tokens in ops:
        prompt = prefixes[prefix][: cut * BS] + tokens(50 + extra, extra)
        if c.peak_blocks(len(prompt) + max_tokens - 1) > c.num_blocks - 1:
            continue
        h = hashes_of(prompt)
        expected = longest_hit(specs, lambda g, i: i < len(h) and held[g][h[i]] > 0, len(prompt), BS)
        hit, batches = serve(c, prompt, max_tokens)
        assert hit == expected
        for e in flat(batches):
            if isinstance(e, BlockStored):
                held[e.group_idx].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held[e.group_idx].subtract(e.block_hashes)
        assert {g: {x for x, n in held[g].items() if n > 0} for g in held} == \
            {SW: cached_hashes(c, SW), FA: cached_hashes(c, FA)}
