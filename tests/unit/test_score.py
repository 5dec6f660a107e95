"""Pure scoring: engine-block rounding, the last-token rule, ranking, filtering."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.predictor.scoring.score import PodAffinity, engine_cached_tokens, score
from kv_preflight.predictor.scoring.ttft import PrefillModel
from kv_preflight.index.index import PodMatch
from kv_preflight.index.pod_meta import ScoringInfo

C = 16


@pytest.mark.parametrize(
    ("blocks", "engine_block", "prompt_len", "expected"),
    [
        (4, 16, 100, 64),  # whole match counts
        (4, 16, 64, 48),  # prompt fully cached: the last block is recomputed for the last token
        (4, 16, 65, 64),  # one token past the match: nothing lost
        (3, 32, 100, 32),  # 48 canonical tokens = 1 whole 32-token engine block
        (4, 32, 100, 64),
        (4, 32, 64, 32),  # 63 tokens at most -> 1 engine block of 32
        (4, 32, 65, 64),
        (1, 32, 100, 0),  # half an engine block is nothing
        (5, None, 100, 80),  # unknown engine block size -> canonical
        (5, 0, 100, 80),
        (0, 16, 100, 0),
        (4, 16, 1, 0),  # a one-token prompt never hits
        (4, 16, 0, 0),
        (6, 48, 200, 96),  # engine block not a power of two
    ],
)
def test_engine_cached_tokens(blocks, engine_block, prompt_len, expected):
    assert engine_cached_tokens(blocks, C, engine_block, prompt_len) == expected


@given(
    blocks=st.integers(0, 5000),
    canonical=st.sampled_from([1, 8, 16, 32, 64]),
    engine=st.one_of(st.none(), st.integers(1, 1024)),
    prompt_len=st.integers(0, 100_000),
)
def test_cached_tokens_never_exceeds_what_the_engine_can_reuse(blocks, canonical, engine, prompt_len):
    tokens = engine_cached_tokens(blocks, canonical, engine, prompt_len)
    e = engine or canonical
    assert tokens >= 0
    assert tokens % e == 0
    assert tokens <= blocks * canonical
    assert tokens <= max(prompt_len - 1, 0)
    # and it is the largest such multiple
    assert tokens + e > min(blocks * canonical, max(prompt_len - 1, 0))


def test_best_pod_first_and_zero_pods_omitted():
    matches = [PodMatch("pod-b", 2, "gpu"), PodMatch("pod-a", 5, "gpu"), PodMatch("pod-c", 1, "cpu")]
    p = score(matches, prompt_len=100, canonical_block=C, engine_blocks={"pod-c": 32})
    assert p.best_pod == "pod-a"
    assert p.predicted_cached_tokens == 80
    assert p.total_prompt_tokens == 100
    assert p.blocks_total == 6
    assert p.blocks_cached == 5
    assert p.cache_hit_ratio == pytest.approx(0.8)
    # pod-c matched 1 canonical block but its engine needs 32 tokens: it reuses nothing and is left out
    assert [a.pod_id for a in p.pod_affinities] == ["pod-a", "pod-b"]
    assert p.pod_affinities[1] == PodAffinity("pod-b", 2, 32, "gpu")


def test_engine_block_size_changes_the_ranking():
    # same canonical match, but pod-32 can only reuse one 32-token block of the 48 tokens
    matches = [PodMatch("pod-32", 3, "gpu"), PodMatch("pod-16", 3, "gpu")]
    p = score(matches, prompt_len=200, canonical_block=C, engine_blocks={"pod-32": 32, "pod-16": 16})
    assert [(a.pod_id, a.cached_blocks, a.cached_tokens) for a in p.pod_affinities] == [
        ("pod-16", 3, 48), ("pod-32", 3, 32),
    ]


def test_ties_go_to_pod_id_order_whatever_the_input_order():
    for order in (["z", "m", "a"], ["a", "z", "m"], ["m", "a", "z"]):
        p = score([PodMatch(pod, 4, "gpu") for pod in order], prompt_len=100, canonical_block=C)
        assert [a.pod_id for a in p.pod_affinities] == ["a", "m", "z"]
        assert p.best_pod == "a"
    # equal tokens from different block counts also tie (pod "b" matched more canonical blocks)
    p = score([PodMatch("b", 3, "gpu"), PodMatch("a", 2, "gpu")], prompt_len=100, canonical_block=C,
              engine_blocks={"b": 32, "a": 16})
    assert [(a.pod_id, a.cached_tokens) for a in p.pod_affinities] == [("a", 32), ("b", 32)]


def test_last_token_rule_caps_a_fully_cached_prompt():
    p = score([PodMatch("pod", 4, "gpu")], prompt_len=64, canonical_block=C)
    assert p.predicted_cached_tokens == 48
    assert p.blocks_cached == 4
    assert p.blocks_total == 4
    assert p.cache_hit_ratio == pytest.approx(0.75)


def test_pods_filter_keeps_only_candidates():
    matches = [PodMatch("pod-a", 5, "gpu"), PodMatch("pod-b", 2, "gpu")]
    p = score(matches, prompt_len=100, canonical_block=C, pods=["pod-b", "pod-x"])
    assert p.best_pod == "pod-b"
    assert [a.pod_id for a in p.pod_affinities] == ["pod-b"]
    empty = score(matches, prompt_len=100, canonical_block=C, pods=[])
    assert empty.best_pod is None and empty.pod_affinities == []


def test_nothing_matches():
    p = score([], prompt_len=40, canonical_block=C)
    assert (p.predicted_cached_tokens, p.best_pod, p.blocks_cached, p.cache_hit_ratio) == (0, None, 0, 0.0)
    assert p.blocks_total == 2
    p = score([PodMatch("pod", 1, "gpu")], prompt_len=16, canonical_block=C)  # only match is the last block
    assert (p.predicted_cached_tokens, p.best_pod, p.pod_affinities) == (0, None, [])


def test_incomplete_flag_and_json_shape():
    matches = [PodMatch("pod-a", 2, "gpu"), PodMatch("pod-b", 2, "cpu")]
    p = score(matches, prompt_len=100, canonical_block=C, incomplete={"pod-b"})
    doc = msgspec.json.decode(msgspec.json.encode(p))
    assert doc == {
        "predicted_cached_tokens": 32,
        "total_prompt_tokens": 100,
        "blocks_total": 6,
        "blocks_cached": 2,
        "cache_hit_ratio": 0.32,
        "best_pod": "pod-a",
        "pod_affinities": [
            {"pod_id": "pod-a", "cached_blocks": 2, "cached_tokens": 32, "device_tier": "gpu"},
            {"pod_id": "pod-b", "cached_blocks": 2, "cached_tokens": 32, "device_tier": "cpu", "incomplete": True},
        ],
    }


@given(st.lists(st.tuples(st.integers(-300, 3), st.sampled_from([None, 0, 16, 32, 256]), st.booleans()),
                max_size=60),
       st.integers(0, 5000), st.booleans(), st.sampled_from([16, 32]))
@settings(max_examples=200, deadline=None)
def test_scoring_equals_its_definition_pod_by_pod(pods, prompt_len, with_ttft, canonical):
    """The scorer's inline common case (canonical blocks) and its caches give what the definition gives:
    ``engine_cached_tokens`` and ``estimate_ms`` per pod, pods reusing nothing left out, most tokens
    first, ties by pod id. Lengths run up to a few blocks past the prompt's, where the last-token rule
    cuts."""
    ttft = PrefillModel(overhead_ms=3, prefill_tokens_per_s=777, attention_ms_per_mpair=0.3) if with_ttft else None
    matches = [PodMatch(f"p{i:03d}", max(0, prompt_len // canonical + d), "cpu" if i % 3 else "gpu")
               for i, (d, _, _) in enumerate(pods)]
    engine_blocks = {f"p{i:03d}": e for i, (_, e, _) in enumerate(pods) if i % 4}  # some pods have no info
    incomplete = {f"p{i:03d}" for i, (_, _, inc) in enumerate(pods) if inc}
    got = score(matches, prompt_len=prompt_len, canonical_block=canonical, engine_blocks=engine_blocks,
                incomplete=incomplete, ttft=ttft)
    want = []
    for m in matches:
        tokens = engine_cached_tokens(m.blocks, canonical, engine_blocks.get(m.pod_id), prompt_len)
        if tokens > 0:
            want.append(PodAffinity(m.pod_id, m.blocks, tokens, m.tier,
                                    ttft.estimate_ms(prompt_len, tokens) if ttft else None, m.pod_id in incomplete))
    want.sort(key=lambda a: (-a.cached_tokens, a.pod_id))
    assert got.pod_affinities == want
    # the same from the pods' metadata (what the predictor passes), a pod without metadata as before
    infos = {pod: ScoringInfo(pod, e, pod in incomplete) for pod, e in engine_blocks.items()}
    alone = {pod for pod in incomplete if pod not in infos}
    assert score(matches, prompt_len=prompt_len, canonical_block=canonical, infos=infos, incomplete=alone,
                 ttft=ttft) == got


@given(st.lists(st.tuples(st.integers(-3, 400), st.sampled_from([None, -1, 0, 16, 32, 48, 256]), st.booleans(),
                          st.integers(0, 3)), max_size=80),
       st.integers(0, 6000), st.booleans(), st.sampled_from([1, 16, 32]), st.booleans())
@settings(max_examples=300, deadline=None)
def test_the_c_loop_equals_the_python_loop(pods, prompt_len, with_ttft, canonical, filtered):
    """``_speedups.affinities`` (what the predictor runs: metadata per pod, no other maps) gives the Python
    loop's affinities, in the same order: pods with and without metadata, a pods filter, counts past the
    prompt and below zero, engine block sizes missing, zero or negative."""
    from kv_preflight.predictor.scoring import score as scoring

    assert scoring._c_affinities is not None, "the C extension is built by scripts/setup"
    ttft = PrefillModel(overhead_ms=3, prefill_tokens_per_s=777, attention_ms_per_mpair=0.3) if with_ttft else None
    estimate = ttft.estimates_for(prompt_len) if ttft else None
    matches = [PodMatch(f"p{i:03d}", b, ("gpu", "cpu", "disk", "gpu")[t]) for i, (b, _, _, t) in enumerate(pods)]
    infos = {f"p{i:03d}": ScoringInfo(f"p{i:03d}", e, inc) for i, (_, e, inc, _) in enumerate(pods) if i % 5}
    wanted = {f"p{i:03d}" for i in range(0, len(pods), 2)} if filtered else None
    got = scoring._c_affinities(matches, prompt_len, canonical, infos or None, wanted, estimate, PodAffinity)
    want = scoring._affinities(matches, prompt_len, canonical, None, (), wanted, estimate, infos)
    assert got == want
    assert [type(a.incomplete) for a in got] == [bool] * len(got)


def test_the_c_loop_refuses_what_it_cannot_read():
    from kv_preflight.predictor.scoring import score as scoring

    with pytest.raises(AttributeError):
        scoring._c_affinities([object()], 100, 16, None, None, None, PodAffinity)
    with pytest.raises(TypeError):
        scoring._c_affinities([PodMatch("a", "2", "gpu")], 100, 16, None, None, None, PodAffinity)
    with pytest.raises(TypeError):
        scoring._c_affinities([], 100, 16, ["not", "a", "dict"], None, None, PodAffinity)
    with pytest.raises(ValueError):
        scoring._c_affinities([], 100, 0, None, None, None, PodAffinity)
    with pytest.raises(ZeroDivisionError):  # an estimate's own error comes through
        scoring._c_affinities([PodMatch("a", 2, "gpu")], 100, 16, None, None, lambda t: 1 / 0, PodAffinity)
    huge = scoring._c_affinities([PodMatch("a", 2**62, "gpu")], 100, 16, None, None, None, PodAffinity)
    assert [a.cached_tokens for a in huge] == [96]  # the whole cap, not an overflow


def test_the_c_loop_scores_any_metadata_as_the_python_loop_does():
    """A pod's meta may hold any number (scoring_info_from reads what is there): one pod's engine block size
    past 64 bits drops that pod, as in the Python loop, instead of failing the prediction; metadata of None
    reads as none."""
    from kv_preflight.predictor.scoring import score as scoring
    from kv_preflight.index.pod_meta import scoring_info_from

    matches = [PodMatch("a", 10, "gpu"), PodMatch("b", 10, "gpu"), PodMatch("c", 10, "gpu"),
               PodMatch("d", 2**70, "cpu")]
    infos = {"a": scoring_info_from("a", [b"99999999999999999999", b"0"]), "b": None,
             "c": ScoringInfo("c", -(2**70), True)}
    got = scoring._c_affinities(matches, 1000, 16, infos, None, None, PodAffinity)
    assert got == scoring._affinities(matches, 1000, 16, None, (), None, None, infos)
    assert [(a.pod_id, a.cached_tokens, a.incomplete) for a in got] == [("b", 160, False), ("c", 160, True),
                                                                        ("d", 992, False)]


def test_the_c_loop_survives_callbacks_that_change_its_inputs():
    """``make`` and the estimate run Python code: emptying the matches list or the metadata under the loop
    must not make it read freed memory (it scores the list it was given, as a snapshot)."""
    from kv_preflight.predictor.scoring import score as scoring

    matches = [PodMatch(f"p{i}", 4, "gpu") for i in range(2000)]
    infos = {f"p{i}": ScoringInfo(f"p{i}", 16, False) for i in range(2000)}

    def make(*args):
        matches.clear()
        infos.clear()
        return PodAffinity(*args)

    got = scoring._c_affinities(matches, 1000, 16, infos, None, lambda t: float(t), make)
    assert len(got) == 2000 and {a.cached_tokens for a in got} == {64}


def test_an_unreachable_pod_is_listed_marked_and_never_the_best():
    """Issue 40 item 2: a stopped engine's pod kept being named best_pod with what the index held for it."""
    matches = [PodMatch("pod-a", 5, "gpu"), PodMatch("pod-b", 2, "gpu"), PodMatch("pod-c", 5, "gpu")]
    p = score(matches, prompt_len=100, canonical_block=C, unreachable={"pod-a"})
    assert (p.best_pod, p.predicted_cached_tokens, p.blocks_cached) == ("pod-c", 80, 5)
    assert [(a.pod_id, a.unreachable) for a in p.pod_affinities] == [("pod-a", True), ("pod-c", False),
                                                                     ("pod-b", False)]
    p = score(matches[:1], prompt_len=100, canonical_block=C, unreachable={"pod-a"})
    assert (p.best_pod, p.predicted_cached_tokens, p.cache_hit_ratio) == (None, 0, 0.0)
    assert p.pod_affinities[0].unreachable and p.pod_affinities[0].cached_tokens == 80
    assert score(matches, prompt_len=100, canonical_block=C, unreachable={"x"}) == score(
        matches, prompt_len=100, canonical_block=C)


def test_a_data_parallel_rank_is_unreachable_with_its_pod():
    """Each rank of a data-parallel engine is an index pod of its own (``<pod>@dp<r>``); the fleet record, and so
    the health of the engine, is its pod's."""
    matches = [PodMatch("vllm-0@dp1", 5, "gpu"), PodMatch("vllm-1", 2, "gpu")]
    p = score(matches, prompt_len=100, canonical_block=C, unreachable={"vllm-0"})
    assert p.best_pod == "vllm-1" and p.pod_affinities[0].unreachable
