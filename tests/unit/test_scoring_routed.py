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


def test_a_new_home_counts_in_its_pods_footprint_here_until_it_is_written():
    """Through one gateway, two new prefixes a moment apart: the second must see the first's home before Valkey
    has it (else both go to the same emptiest pod: 4 tenants on one pod, 2 on another, in the bench's single-gateway
    runs). A store whose write is held open stands for Valkey that has not answered yet."""
    import asyncio

    from kv_preflight.predictor.routed import RoutedState

    class HeldStore:
        def __init__(self):
            self.go = asyncio.Event()

        async def home(self, pod, prefix, blocks, window_ms):
            await self.go.wait()
            return blocks

    async def run():
        store = HeldStore()
        state = RoutedState(store=store, window_ms=60_000)
        state.home(111, "a", 12)
        await asyncio.sleep(0)
        got = state.with_unwritten({"a": PodRouted(footprint=3), "b": PodRouted()}, prefix=222)
        assert (got["a"].footprint, got["b"].footprint) == (15, 0)
        assert state.with_unwritten({"a": PodRouted(footprint=3)}, prefix=111)["a"].footprint == 3  # its own: aside
        state.home(111, "a", 12)  # homed again before written: counted once
        assert state.with_unwritten({"a": PodRouted()}, prefix=222)["a"].footprint == 12
        store.go.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert state.with_unwritten({"a": PodRouted(footprint=15)}, prefix=222)["a"].footprint == 15  # Valkey's now

    asyncio.run(run())
