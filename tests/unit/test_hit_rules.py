"""vLLM's cache-hit rules per KV cache group and their fixed point (kv_preflight/engines/hit_rules.py), against the
cases vLLM 0.32's own unit tests give for its managers (tests/v1/core/test_single_type_kv_cache_manager.py:
``test_sliding_window_possible_cached_prefix``, ``test_chunked_local_attention_possible_cached_prefix``), the
hybrid coordinator's behaviour, and the plain model's rule the predictor used before groups."""
from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kv_preflight.engines.hit_rules import (CHUNKED, FULL, MAMBA, SLIDING, GroupSpec, group_hit, longest_hit,
                                            prefix_group)
from kv_preflight.predictor.scoring.score import engine_cached_tokens

T, F = True, False


def held_of(cached):
    return lambda g, i: i < len(cached) and cached[i]


def test_sliding_window_cases_of_vllm():
    """Block 2, window 4: ceil(3/2) = 2 contiguous blocks end a hit; a shorter run from block 0 counts too.
    (Expected lengths in blocks, null blocks for those outside the window included, as vLLM's test counts.)"""
    spec = GroupSpec(SLIDING, 2, 4)
    cases = [([F] * 10, 0), ([T], 1), ([T, F], 1), ([T, T], 2), ([T, T, F], 2), ([T, T, T], 3), ([T, T, T, F], 3),
             ([T, T, F, T, F, F, T, T, F, T, T, T], 12), ([T, T, F, T, F, F, T, T, F, F, F], 8),
             ([T, T, F, T, F, F, T, T, F, F, F, T], 8)]
    for cached, blocks in cases:
        assert group_hit(0, spec, 2, held_of(cached), len(cached) * 2, 2) == blocks * 2, cached


def test_chunked_local_attention_cases_of_vllm():
    """Block 2, chunk 4: blocks before the chunk holding the candidate's end count as computed; from its first
    block, cached blocks up to the first miss."""
    spec = GroupSpec(CHUNKED, 2, attention_chunk_size=4)
    rng = random.Random(0)
    cases = [([T], 0, 1), ([T], 1, 1), ([T, F], 0, 2), ([T, F], 1, 2), ([T, T], 0, 2), ([T, T], 1, 2),
             ([T, T, F], 0, 2), ([T, T, F], 1, 2), ([T, T, T], 0, 3), ([T, T, T], 1, 3), ([T, T, T, F], 0, 4),
             ([T, T, T, F], 1, 4)]
    for tail in ([T], 1, 9), ([F], 1, 8), ([T, T], 1, 10), ([T, F], 0, 10), ([T, F], 1, 10), ([F, T], 0, 10), \
            ([F, T], 1, 10), ([F, F], 0, 10), ([F, F], 1, 10):
        cases.append(([rng.choice([T, F])] * 8 + tail[0], tail[1], tail[2]))
    for cached, tail_token, blocks in cases:
        assert group_hit(0, spec, 2, held_of(cached), len(cached) * 2 + tail_token, 2) == blocks * 2, (cached, tail_token)


def test_mamba_takes_the_last_cached_block_at_an_aligned_position():
    spec = GroupSpec(MAMBA, 4)
    assert group_hit(0, spec, 4, held_of([T, F, T, F]), 16, 4) == 12
    assert group_hit(0, spec, 4, held_of([T, F, T, F]), 16, 8) == 0  # position 3 blocks = 12 tokens: not aligned to 8
    assert group_hit(0, spec, 4, held_of([T, T, F, T]), 16, 8) == 16


def test_hybrid_full_and_sliding_window_is_one_pass():
    """Full attention first (its prefix bounds the candidate), then the window's run ending within it."""
    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)}
    held = {0: {1, 2, 6, 7}, 1: set(range(8))}
    h = lambda g, i: i in held[g]  # noqa: E731
    assert longest_hit(groups, h, 8 * 32 + 1, 32) == 8 * 32  # the window's run 6-7 ends at the FA prefix
    assert longest_hit(groups, h, 7 * 32 + 1, 32) == 3 * 32  # capped at 7 blocks: 6 alone, then 1-2 (ends at 3)
    held[1] = set(range(5))  # the full-attention group lost its tail: the candidate is 5 blocks
    assert longest_hit(groups, h, 8 * 32 + 1, 32) == 3 * 32
    held[0] = {0, 4}  # no two contiguous window blocks, no run from 0 longer than 1
    assert longest_hit(groups, h, 8 * 32 + 1, 32) == 32
    assert prefix_group(groups) == 1


def test_the_fixed_point_runs_again_when_a_later_group_lowers_the_candidate():
    """Two window groups and full attention: the second window cuts the candidate below the first window's
    run, so the first is asked again (vLLM's loop; not one pass)."""
    groups = {0: GroupSpec(FULL, 2), 1: GroupSpec(SLIDING, 2, 4), 2: GroupSpec(SLIDING, 2, 4)}
    held = {0: set(range(10)), 1: {8, 9, 4, 5}, 2: {5, 6, 0}}
    h = lambda g, i: i in held[g]  # noqa: E731
    # pass 1: FA 10 blocks; group 1: run 8-9 -> 10; group 2: runs 5-6 -> 7; pass 2: group 1 within 7: run 4-5 -> 6;
    # group 2 within 6: block 5 alone, then 0 (a run of 1 from block 0) -> 1; pass 3: group 1 within 1: 0 -> 0
    assert longest_hit(groups, h, 10 * 2 + 1, 2) == 0
    held[2] = {4, 5, 6}
    assert longest_hit(groups, h, 10 * 2 + 1, 2) == 12


def test_eagle_drops_the_last_matched_block():
    full = {0: GroupSpec(FULL, 32, eagle=True)}
    h = held_of([T] * 5)
    # one group (vLLM's unitary coordinator): the hit, then one block dropped
    assert longest_hit(full, h, 4 * 32 + 1, 32) == 3 * 32
    assert longest_hit(full, h, 5 * 32, 32) == 3 * 32
    # hybrid: full attention matches one block past the candidate, not past the prompt's full blocks, then drops
    hybrid = {0: GroupSpec(FULL, 32, eagle=True), 1: GroupSpec(SLIDING, 32, 64)}
    hh = lambda g, i: i < 5  # noqa: E731
    assert longest_hit(hybrid, hh, 4 * 32 + 1, 32) == 3 * 32  # 4 full blocks in the prompt: 4 matched, 1 dropped
    assert longest_hit(hybrid, hh, 5 * 32, 32) == 4 * 32  # the margin reaches block 5 (the prompt's last full one)
    sw = {0: GroupSpec(SLIDING, 32, 64, eagle=True)}  # one more contiguous block needed, then dropped
    assert group_hit(0, sw[0], 32, held_of([F, T, T, T]), 4 * 32, 32) == 3 * 32
    assert group_hit(0, sw[0], 32, held_of([F, F, T, T]), 4 * 32, 32) == 0


def test_a_group_without_its_settings_accepts_nothing():
    """vLLM 0.32's events carry no chunk size: without it (a flag or discovery) the answer is a lower bound."""
    groups = {0: GroupSpec(FULL, 32), 1: GroupSpec(CHUNKED, 32)}
    assert GroupSpec(CHUNKED, 32).missing()
    assert longest_hit(groups, lambda g, i: True, 8 * 32 + 1, 32) == 0
    assert GroupSpec("linear_attention").missing()


@given(blocks=st.integers(0, 40), prompt=st.integers(0, 2000), ebs=st.sampled_from([16, 32, 64]))
def test_one_full_attention_group_is_the_plain_rule(blocks, prompt, ebs):
    """A plain model: the hit is the run of cached blocks from the start, whole engine blocks, the last token
    recomputed: what the predictor's plain scoring computes from a prefix of canonical blocks."""
    canonical = 16
    keys = blocks * ebs // canonical
    held = lambda g, i: (i + 1) * ebs // canonical <= keys  # noqa: E731
    assert longest_hit({0: GroupSpec(FULL, ebs)}, held, prompt, ebs) == \
        engine_cached_tokens(keys, canonical, ebs, prompt)


def test_group_spec_flag_parses_and_fills_what_events_lack():
    import pytest

    from kv_preflight.config import Config
    from kv_preflight.engines.hit_rules import effective_groups, parse_group_spec, parse_group_specs

    assert parse_group_spec("meta-llama/Llama-4:1=chunked/chunk=8192/block=16") == (
        "meta-llama/Llama-4", 1, GroupSpec(CHUNKED, 16, None, 8192))
    assert parse_group_spec("m:2=swa/window=128/eagle") == ("m", 2, GroupSpec(SLIDING, None, 128, None, True))
    for bad in ("m=full", "m:x=full", "m:1=linear", "m:1=chunked/chunk=0", "m:1=chunked/size=4", ":1=full"):
        with pytest.raises(ValueError):
            parse_group_spec(bad)
    declared = parse_group_specs(["m:1=chunked/chunk=64", "m:0=full"])["m"]
    learned = {0: GroupSpec(FULL, 32), 1: GroupSpec(CHUNKED, 32)}
    assert learned[1].missing() is not None
    filled = effective_groups(learned, declared)
    assert filled == {0: GroupSpec(FULL, 32), 1: GroupSpec(CHUNKED, 32, None, 64)} and filled[1].missing() is None
    # what the events say wins; an unknown kind takes the declared one; no learned groups: nothing to place
    assert effective_groups({0: GroupSpec(FULL, 32), 1: GroupSpec(SLIDING, 32, 64)},
                            {1: GroupSpec(SLIDING, None, 128)})[1].sliding_window == 64
    assert effective_groups({0: GroupSpec(FULL), 1: GroupSpec("unknown", 16)}, {1: GroupSpec(MAMBA)})[1].kind == MAMBA
    assert effective_groups(None, declared) is None
    cfg = Config.load(group_specs=None, **{})
    assert cfg.group_specs == {}


def test_group_specs_from_env(monkeypatch):
    from kv_preflight.config import Config

    monkeypatch.setenv("KVPF_GROUP_SPECS", "a/b:1=chunked/chunk=8192, a/b:0=full,c:1=mamba/block=64")
    cfg = Config.load()
    assert cfg.group_specs == {"a/b": {1: GroupSpec(CHUNKED, None, None, 8192), 0: GroupSpec(FULL)},
                               "c": {1: GroupSpec(MAMBA, 64)}}


def test_kinds_vllm_runs_as_full_attention_or_sliding_window_have_those_rules():
    """``mla_attention`` and ``sink_full_attention`` (``FullAttentionSpec`` subclasses, ``FullAttentionManager``)
    and ``sliding_window_mla`` (a ``SlidingWindowSpec``, ``SlidingWindowManager``): vLLM 0.32's
    ``register_all_kvcache_specs``. Their pods are answered by those rules, not as kinds without one (a lower
    bound of 0), whether named by events, by a pod's stored meta or by ``--group-spec``."""
    from kv_preflight.engines.hit_rules import KIND_NAMES, parse_group_spec
    from kv_preflight.index.pod_meta import groups_from

    assert GroupSpec("mla_attention", 16) == GroupSpec(FULL, 16)
    assert GroupSpec("sink_full_attention", 16) == GroupSpec(FULL, 16)
    assert GroupSpec("sliding_window_mla", 16, 64) == GroupSpec(SLIDING, 16, 64)
    assert {KIND_NAMES[k] for k in ("mla_attention", "sink_full_attention")} == {FULL}
    assert KIND_NAMES["sliding_window_mla"] == SLIDING
    assert parse_group_spec("m:1=sliding_window_mla/window=64")[2] == GroupSpec(SLIDING, None, 64)
    stored = groups_from(b'{"0":["mla_attention",16,null,null,false],"1":["sliding_window_mla",16,64,null,false]}')
    assert dict(stored) == {0: GroupSpec(FULL, 16), 1: GroupSpec(SLIDING, 16, 64)}
    held = {0: {0, 1, 2, 3}, 1: {0, 3}}  # the window group lost blocks 1 and 2
    got = longest_hit(stored, lambda g, i: i in held[g], 65, 16)
    assert got == longest_hit({0: GroupSpec(FULL, 16), 1: GroupSpec(SLIDING, 16, 64)}, lambda g, i: i in held[g], 65, 16)
    assert got == 16  # ceil(63 / 16) = 4 contiguous blocks: none, so the run from block 0
