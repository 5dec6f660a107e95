"""predictor/scoring/groups.py's pure parts: the warnings an answer carries for hybrid pods it cannot count
exactly, and the sliding-window blocks /explain names when a window group cut a hit."""
from __future__ import annotations

from kv_preflight.engines.hit_rules import CHUNKED, FULL, SLIDING, GroupSpec
from kv_preflight.predictor.scoring.groups import GroupBits, group_findings, window_cut

HYBRID = {0: GroupSpec(FULL, 32), 1: GroupSpec(SLIDING, 32, 64)}


def test_plain_pods_of_a_plain_model_say_nothing():
    assert group_findings("m", ["a", "b"], {}, None) == []
    assert group_findings("m", ["a"], {}, {0: GroupSpec(FULL)}) == []  # one declared group: a plain model
    assert group_findings("m", ["a"], {"a": HYBRID}, None) == []  # every setting known


def test_incomplete_groups_and_silent_pods_are_named():
    chunked = {0: GroupSpec(FULL, 32), 1: GroupSpec(CHUNKED, 32)}
    found = group_findings("m", ["c", "h", "s", "c"], {"c": chunked, "h": HYBRID}, HYBRID)
    assert [f.kind for f in found] == ["hybrid_groups_incomplete", "hybrid_not_exact"]
    assert "'c'" in found[0].detail and "group 1" in found[0].detail and "chunk size" in found[0].detail
    assert "'s'" in found[1].detail and "'h'" not in found[1].detail
    many = group_findings("m", [f"p{i}" for i in range(8)], {}, HYBRID)
    assert "and 3 more" in many[0].detail


def test_window_cut_lists_the_evicted_window_blocks_of_the_prefix():
    # 4 blocks of 32 (8 request keys of 16); the window group holds blocks 0 and 3 (keys 1 and 7)
    bit = (1 << 2).to_bytes(1, "little")  # pod number 2
    presence = [{("pod", 1): bit} if k in (1, 7) else {} for k in range(8)]
    assert window_cut(HYBRID, 8, GroupBits(presence), 2, 16, 32, 129) == (1, 64, [1, 2])
    assert window_cut(HYBRID, 8, GroupBits([{("pod", 1): bit}] * 8), 2, 16, 32, 129) is None
    # only blocks of the prefix the prompt can reuse are named (the last token is recomputed)
    assert window_cut(HYBRID, 8, GroupBits(presence), 2, 16, 32, 97) == (1, 64, [1, 2])
    assert window_cut(HYBRID, 4, GroupBits(presence), 2, 16, 32, 129) == (1, 64, [1])


def test_complete_groups_are_checked_once_per_mapping_object():
    from types import MappingProxyType

    from kv_preflight.predictor.scoring.groups import CompleteGroups

    complete = CompleteGroups()
    read1 = MappingProxyType(dict(HYBRID))
    assert group_findings("m", ["a"], {"a": read1}, None, complete) == []
    assert complete.known("a", read1)
    # the pod's meta read again: a new mapping, checked again (its engine may have restarted with other groups)
    chunked = MappingProxyType({0: GroupSpec(FULL, 32), 1: GroupSpec(CHUNKED, 32)})
    assert not complete.known("a", chunked)
    assert [f.kind for f in group_findings("m", ["a"], {"a": chunked}, None, complete)] == ["hybrid_groups_incomplete"]
    assert not complete.known("a", chunked)


def test_one_group_of_another_kind_is_scored_by_its_rule_and_says_it_is_a_lower_bound():
    """A sliding-window-only, chunked-only or Mamba-only model has one KV cache group; vLLM runs that kind's
    manager alone (``UnitaryKVCacheCoordinator``), so its pods are scored by that rule, not as plain pods, and
    (the rule seeing only the pod's prefix) the answer says it is a lower bound. One full-attention group is
    a plain model: nothing to say."""
    from kv_preflight.index.entries import PodMatch
    from kv_preflight.index.pod_meta import groups_from
    from kv_preflight.predictor.scoring.groups import apply_groups

    window = groups_from(b'{"0":["sliding_window",16,64,null,false]}')
    assert window is not None and dict(window) == {0: GroupSpec(SLIDING, 16, 64)}
    assert groups_from(b'{"0":["mamba",16,null,null,false]}') is not None
    assert groups_from(b'{"0":["full_attention",16,null,null,false]}') is None
    assert groups_from(b'{"0":["cross_attention",16,null,null,false]}') is None  # no rule here: as before

    match = PodMatch("w", 8, "gpu")  # 8 blocks of 16 held from the start; the prompt: 129 tokens

    def hit(groups):
        (got,) = apply_groups([match], {"w": groups}, {"w": 16}, [], {"w": 0}, 16, 129)
        return got.blocks * 16

    # EAGLE: one more contiguous block needed (ceil(63 / 16) + 1 = 5), then the last one dropped
    assert hit({0: GroupSpec(SLIDING, 16, 64, eagle=True)}) == 112
    assert hit({0: GroupSpec(SLIDING, 16, 64)}) == 128
    # chunked local attention: the blocks before the chunk that holds token 128 count as computed
    assert hit({0: GroupSpec(CHUNKED, 16, attention_chunk_size=64)}) == 128
    assert apply_groups([PodMatch("w", 2, "gpu")], {"w": {0: GroupSpec(CHUNKED, 16, attention_chunk_size=64)}},
                        {"w": 16}, [], {"w": 0}, 16, 129)[0].blocks == 8

    found = group_findings("m", ["w", "v"], {"w": dict(window), "v": {0: GroupSpec(FULL, 16)}}, None)
    assert [f.kind for f in found] == ["single_group_lower_bound"]
    assert "'w'" in found[0].detail and "'v'" not in found[0].detail and "sliding_window" in found[0].detail
