"""What was routed merged into the index's matches (predictor/scoring/routed.py): pure."""
from __future__ import annotations

from kv_preflight.index.entries import PodMatch
from kv_preflight.index.routed import PodRouted
from kv_preflight.predictor.scoring.routed import mark_speculative, with_routed
from kv_preflight.predictor.scoring.score import score


def test_the_longest_prefix_wins_and_speculative_blocks_are_those_past_the_index():
    matches = [PodMatch("a", 3, "gpu"), PodMatch("b", 5, "cpu"), PodMatch("h", 2, "gpu")]
    routed = {"a": PodRouted(speculative=6), "b": PodRouted(speculative=4), "c": PodRouted(speculative=2),
              "d": PodRouted(approximate=7), "e": PodRouted(approximate=3), "h": PodRouted(speculative=9),
              "z": PodRouted()}
    merged, speculative = with_routed(matches, routed, approximate={"e"}, skip={"h"})
    assert merged == [PodMatch("a", 6, "gpu"), PodMatch("b", 5, "cpu"), PodMatch("h", 2, "gpu"),
                      PodMatch("c", 2, "gpu"), PodMatch("e", 3, "gpu")]
    # d is not an approximate pod (its events flow): what was guessed for it does not count
    assert speculative == {"a": 3, "c": 2}


def test_answers_mark_the_speculative_blocks():
    merged, speculative = with_routed([PodMatch("a", 2, "gpu")], {"a": PodRouted(speculative=4)})
    prediction = mark_speculative(score(merged, prompt_len=64, canonical_block=16), speculative)
    (a,) = prediction.pod_affinities
    assert (a.cached_blocks, a.cached_tokens, a.speculative_blocks) == (4, 48, 2)
    plain = score([PodMatch("a", 2, "gpu")], prompt_len=64, canonical_block=16)
    import msgspec

    assert mark_speculative(plain, {}) is plain
    assert b"speculative_blocks" not in msgspec.json.encode(plain)  # omitted when 0: answers unchanged
