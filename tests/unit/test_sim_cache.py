"""The simulator's pure cache model and engine steps: vLLM 0.32's rules, one test each.

Scenarios marked "observed" reproduce what a real vLLM 0.32 (CPU, block size 32,
24 blocks) published; tests/e2e/test_simulator_parity.py checks the rest live.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_preflight.simulator import tokenizer
from kv_preflight.simulator.cache import PoolExhausted, PrefixCache, chain_hash, extend_block_hashes
from kv_preflight.simulator.engine import Generation, run_request

BS = 4


def tokens(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def serve(cache: PrefixCache, prompt: list[int], max_tokens: int = 1) -> tuple[int, list[list]]:
    """One request through the engine: (cached tokens, event batches as published)."""
    gen = Generation(prompt_ids=prompt, max_tokens=max_tokens)
    batches = [s.events for s in run_request(cache, gen, tokenizer.OUTPUT_ALPHABET) if s.events]
    return gen.cached_tokens, batches


def flat(batches: list[list]) -> list:
    return [e for b in batches for e in b]


def stored(batches: list[list]) -> list[int]:
    return [h for e in flat(batches) if isinstance(e, BlockStored) for h in e.block_hashes]


def removed(batches: list[list]) -> list[int]:
    return [h for e in flat(batches) if isinstance(e, BlockRemoved) for h in e.block_hashes]


def cached_hashes(cache: PrefixCache) -> set[int]:
    return set(cache._cached)


def free_queue_hashes(cache: PrefixCache) -> list[int | None]:
    """Eviction order, head first (the tests compare it with the free queue's rules)."""
    return [b.block_hash for b in cache._free.values()]


def hashes_of(prompt: list[int], block_size: int = BS) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, prompt, block_size)
    return out


# ---------------------------------------------------------------- hashing


def test_block_hashes_chain_over_the_prefix():
    a, b = hashes_of(tokens(1, 8)), hashes_of(tokens(2, 4) + tokens(1, 8)[4:])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same tokens, different parent
    assert hashes_of(tokens(1, 11)) == a  # partial blocks get no hash
    assert chain_hash(None, [1, 2]) == chain_hash(None, [1, 2]) < 2**64


# ---------------------------------------------------------------- hits


def test_only_full_blocks_hit_and_the_last_token_is_recomputed():
    cache = PrefixCache(num_blocks=16, block_size=BS)
    assert serve(cache, tokens(1, 10))[0] == 0
    assert serve(cache, tokens(1, 10))[0] == 8  # 2 full blocks; the partial third never cached
    assert serve(cache, tokens(1, 9))[0] == 8  # (9 - 1) // 4 = 2 blocks
    assert serve(cache, tokens(1, 8))[0] == 4  # all cached, but the last token must be recomputed
    assert serve(cache, tokens(1, 3))[0] == 0


def test_whole_block_prompt_restores_its_last_block_as_a_duplicate():
    """vLLM does not de-duplicate: block k is recomputed into a new block and announced again."""
    cache = PrefixCache(num_blocks=16, block_size=BS)
    prompt = tokens(1, 8)
    h = hashes_of(prompt)
    _, first = serve(cache, prompt)
    _, second = serve(cache, prompt)
    assert stored(first) == h
    [again] = flat(second)
    assert again.block_hashes == [h[1]] and again.parent_block_hash == h[0]  # observed: S[822]p546t32
    # Both copies are evicted, each with its own BlockRemoved, and the hash still hits until the second goes.
    _, evicting = serve(cache, tokens(2, 4 * 15))
    assert Counter(removed(evicting))[h[1]] == 2


def test_block_stored_fields_match_vllm():
    cache = PrefixCache(num_blocks=16, block_size=BS)
    serve(cache, tokens(1, 5))
    _, batches = serve(cache, tokens(1, 9) + [7, 7, 7])
    [event] = flat(batches)
    h = hashes_of(tokens(1, 9) + [7, 7, 7])
    assert event == BlockStored(block_hashes=h[1:3], parent_block_hash=h[0], token_ids=(tokens(1, 9) + [7, 7, 7])[4:12],
                                block_size=BS, lora_id=None, medium="GPU", lora_name=None, extra_keys=[None, None],
                                group_idx=0, kv_cache_spec_kind="full_attention")


def test_an_adapters_blocks_are_its_own_and_published_as_vllm_does():
    """vLLM 0.32 hashes the adapter into every block of its request and publishes lora_id, lora_name and the
    name, untagged, in each block's extra keys: the base model's blocks are no hit for it, and back."""
    cache = PrefixCache(num_blocks=16, block_size=BS)
    prompt = tokens(3, 9)
    serve(cache, prompt)
    gen = Generation(prompt_ids=prompt, max_tokens=1, lora=("sql", 2))
    [event] = flat([s.events for s in run_request(cache, gen, tokenizer.OUTPUT_ALPHABET) if s.events])
    assert gen.cached_tokens == 0
    assert (event.lora_id, event.lora_name, event.extra_keys) == (2, "sql", [["sql"], ["sql"]])
    assert set(event.block_hashes).isdisjoint(hashes_of(prompt))
    again = Generation(prompt_ids=prompt, max_tokens=1, lora=("sql", 2))
    list(run_request(cache, again, tokenizer.OUTPUT_ALPHABET))
    assert again.cached_tokens == 8


# ---------------------------------------------------------------- pool and eviction order


def test_pool_fits_exactly_num_blocks_minus_one():
    """Block 0 is vLLM's null block: 5 blocks hold 4 blocks of KV."""
    cache = PrefixCache(num_blocks=5, block_size=BS)
    assert serve(cache, tokens(1, 16))[0] == 0  # 4 blocks: the whole usable pool
    assert cache.usage == 0.0  # finished requests hold nothing; their blocks stay cached
    with pytest.raises(PoolExhausted):
        serve(cache, tokens(2, 17))


def test_freed_request_evicts_its_last_blocks_first():
    cache = PrefixCache(num_blocks=7, block_size=BS)  # 6 usable
    a = tokens(1, 12)  # 3 blocks
    serve(cache, a)
    _, batches = serve(cache, tokens(2, 16))  # 4 blocks: 3 unhashed free first, then evict 1
    assert removed(batches) == [hashes_of(a)[2]]
    _, batches = serve(cache, tokens(3, 8))  # 2 more: a's next-to-last, then a's first
    assert removed(batches) == [hashes_of(a)[1], hashes_of(a)[0]]


def test_hits_leave_the_free_queue_and_are_refreshed():
    cache = PrefixCache(num_blocks=7, block_size=BS)
    a, b = tokens(1, 8), tokens(2, 8)
    serve(cache, a)
    serve(cache, b)
    assert serve(cache, a + [5])[0] == 8  # a's blocks are touched, then freed to the tail again
    # Queue now: unhashed blocks, b's blocks (last first), a's blocks (last first).
    _, batches = serve(cache, tokens(3, 16))
    assert removed(batches) == [hashes_of(b)[1], hashes_of(b)[0]]
    assert serve(cache, a + [6])[0] == 8


def test_hit_blocks_in_use_are_not_evicted():
    cache = PrefixCache(num_blocks=7, block_size=BS)
    a = tokens(1, 8)
    serve(cache, a)
    req = cache.new_request(a + tokens(2, 8))
    assert cache.admit(req) == 8
    cache.allocate_slots(req, 16)  # needs 2 more of the 4 free: a's blocks are not among them
    assert removed([cache.take_events()]) == []
    cache.free(req)


def test_unhashed_blocks_are_reused_before_cached_ones():
    cache = PrefixCache(num_blocks=7, block_size=BS)
    serve(cache, tokens(1, 6))  # block 1 cached, block 2 (partial) freed to the head
    assert free_queue_hashes(cache)[0] is None
    assert free_queue_hashes(cache)[-1] == hashes_of(tokens(1, 6))[0]


def test_observed_fill_then_decode_evicts_the_first_requests_last_block():
    """Observed on vLLM 0.32 (24 blocks of 32): 11 prompts of 64 fill 22 blocks; a 40-token
    prompt with 25 outputs takes the last free block, evicts the first prompt's second block,
    and its decode fills and stores a second block without allocating a third."""
    cache = PrefixCache(num_blocks=24, block_size=32)
    firsts = [tokens(10 + i, 64) for i in range(11)]
    for p in firsts:
        serve(cache, p)
    _, batches = serve(cache, tokens(30, 40), max_tokens=25)
    assert [type(e).__name__ for e in batches[0]] == ["BlockRemoved", "BlockStored"]
    assert removed(batches) == [hashes_of(firsts[0], 32)[1]]
    assert [len(e.block_hashes) for e in flat(batches) if isinstance(e, BlockStored)] == [1, 1]
    _, batches = serve(cache, tokens(31, 64))
    assert removed(batches) == [hashes_of(firsts[0], 32)[0], hashes_of(firsts[1], 32)[1]]


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("prompt_len,max_tokens,blocks", [(40, 25, 2), (40, 24, 1), (300, 40, 10), (64, 1, 2)])
def test_decode_blocks_are_cached_once_their_kv_exists(prompt_len, max_tokens, blocks):
    """KV exists for prompt + outputs - 1 tokens (observed: 40+25 stores 2 blocks, 40+24 one)."""
    cache = PrefixCache(num_blocks=24, block_size=32)
    _, batches = serve(cache, tokens(1, prompt_len), max_tokens=max_tokens)
    assert len(stored(batches)) == blocks


def test_each_step_is_one_batch():
    """Observed (prompt 300, 40 outputs): prefill batch, a decode BlockStored alone, then the
    allocation of the next block in a later step."""
    cache = PrefixCache(num_blocks=12, block_size=32)
    serve(cache, tokens(9, 32 * 11))
    _, batches = serve(cache, tokens(1, 300), max_tokens=40)
    kinds = [[type(e).__name__ for e in b] for b in batches]
    assert kinds[0][-1] == "BlockStored" and set(kinds[0][:-1]) == {"BlockRemoved"}
    assert kinds[1:] == [["BlockStored"], ["BlockRemoved"]]


def test_same_prompt_generates_the_same_tokens():
    cache = PrefixCache(num_blocks=24, block_size=32)
    a, b = Generation(tokens(1, 10), 20), Generation(tokens(1, 10), 20)
    list(run_request(cache, a, tokenizer.OUTPUT_ALPHABET))
    list(run_request(cache, b, tokenizer.OUTPUT_ALPHABET))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 20


def test_closing_a_request_early_frees_its_blocks():
    cache = PrefixCache(num_blocks=8, block_size=BS)
    steps = run_request(cache, Generation(tokens(1, 10), 10), tokenizer.OUTPUT_ALPHABET)
    next(steps)
    assert cache.usage > 0
    steps.close()
    assert cache.usage == 0.0


# ---------------------------------------------------------------- reset


def test_reset_is_refused_while_blocks_are_held_and_clears_every_hash():
    cache = PrefixCache(num_blocks=8, block_size=BS)
    serve(cache, tokens(1, 9))
    req = cache.new_request(tokens(2, 5))
    cache.admit(req)
    cache.allocate_slots(req, 5)
    assert cache.reset() is False
    cache.free(req)
    cache.take_events()
    assert cache.reset() is True
    assert cache.take_events() == [AllBlocksCleared()]
    assert serve(cache, tokens(1, 9))[0] == 0


def test_reset_event_goes_out_with_the_next_steps_batch():
    """Observed: vLLM queues AllBlocksCleared and publishes it with the next step's events."""
    cache = PrefixCache(num_blocks=8, block_size=BS)
    serve(cache, tokens(1, 9))
    assert cache.reset()
    _, batches = serve(cache, tokens(2, 5))
    assert [type(e).__name__ for e in batches[0]] == ["AllBlocksCleared", "BlockStored"]


# ---------------------------------------------------------------- the stream rebuilds the cache


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.integers(1, 12), st.booleans()),
                min_size=1, max_size=40))
def test_event_stream_replays_to_the_cache_contents(ops):
    """Applying the events (stored adds a holder, removed drops one, cleared empties) yields
    exactly the hashes the cache would hit on: what an indexer of the stream relies on."""
    cache = PrefixCache(num_blocks=10, block_size=BS)
    holders: Counter[int] = Counter()
    for prefix, length, max_tokens, reset in ops:
        if reset:
            cache.reset()
            continue
        prompt = tokens(prefix, length)
        if -(-(length + max_tokens - 1) // BS) > 9:
            continue
        _, batches = serve(cache, prompt, max_tokens)
        for e in flat(batches):
            if isinstance(e, AllBlocksCleared):
                holders.clear()
            elif isinstance(e, BlockStored):
                holders.update(e.block_hashes)
            else:
                holders.subtract(e.block_hashes)
                assert holders[e.block_hashes[0]] >= 0
        assert cache.usage == 0.0
    pending = cache.take_events()  # a trailing reset is still queued
    if pending:
        holders.clear()
    assert {h for h, n in holders.items() if n > 0} == cached_hashes(cache)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_the_tiny_models_shape():
    assert tokenizer.encode("hi") == [0, 4 + ord("h"), 4 + ord("i")]
    assert tokenizer.decode(tokenizer.encode("héllo", add_bos=False)) == "héllo"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert ids[:2] == [tokenizer.BOS, tokenizer.IM_START] and ids.count(tokenizer.BOS) == 1
    assert tokenizer.decode(ids) == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(tokenizer.TemplateError):
        tokenizer.apply_chat_template([], add_generation_prompt=True)
