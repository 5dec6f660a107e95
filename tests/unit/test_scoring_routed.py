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


def test_a_scraped_load_less_the_gateways_requests_that_ended_since():
    from kv_preflight.predictor.load import PodLoad
    from kv_preflight.predictor.scoring.routed import load_now

    burst = PodLoad(running=1, waiting=6, kv_usage=0.3, at=10.0)  # 7 in flight when scraped, all booked then
    assert load_now(burst, 7, 1) == PodLoad(running=1, waiting=0, kv_usage=0.3, at=10.0)  # 6 ended since
    assert load_now(burst, 7, 0) == PodLoad(running=0, waiting=0, kv_usage=0.3, at=10.0)
    # 3 of the 7 were other clients' (not booked): they are taken to be there still
    assert load_now(burst, 4, 0) == PodLoad(running=1, waiting=2, kv_usage=0.3, at=10.0)
    # more booked now than then: the scrape stands (route.py counts the bookings as a floor)
    assert load_now(burst, 7, 9) is burst and load_now(burst, 0, 0) is burst


def test_a_drained_burst_the_scrape_still_counts_moves_no_request_off_its_prefix():
    """The scrape (1 running, 6 waiting: load 13 against a fleet mean of 2) was taken while 7 requests were booked
    there; 1 is left: the pod holding the prompt is not overloaded. The candidates show the engine's figures."""
    from kv_preflight.predictor.load import PodLoad
    from kv_preflight.predictor.scoring.route import RoutingPolicy, decide
    from kv_preflight.predictor.scoring.score import PodAffinity, Prediction
    from kv_preflight.predictor.scoring.ttft import PrefillModel
    from kv_preflight.index.routed import Booked

    aff = [PodAffinity(pod_id="a", cached_blocks=12, cached_tokens=192, device_tier="gpu")]
    p = Prediction(192, 245, 15, 12, 0.78, "a", aff)
    pods = ["a", "b", "c", "d"]
    loads = {"a": PodLoad(1, 6, 0.3, at=0.0), **{q: PodLoad(0, 0, 0.1, at=0.0) for q in "bcd"}}
    booked = {"a": Booked(1, 100), "b": Booked(0, 0), "c": Booked(0, 0), "d": Booked(0, 0)}
    kw = dict(policy=RoutingPolicy(), ttft=PrefillModel(), booked=booked)
    assert decide(p, pods, loads, **kw).reason == "least_loaded"  # the scrape alone: a burst that has ended
    d = decide(p, pods, loads, booked_at_scrape={"a": 7, "b": 0}, **kw)
    assert (d.pod_id, d.reason) == ("a", "best_overlap")
    a = next(c for c in d.candidates if c.pod_id == "a")
    assert (a.running, a.waiting, a.load, a.booked_requests) == (1, 6, 1.0, 1)
    # the 7 were still booked: a real queue, the guard moves the request
    assert decide(p, pods, loads, booked_at_scrape={"a": 7}, **{**kw, "booked": {**booked, "a": Booked(7, 700)}}
                  ).reason == "least_loaded"


def test_the_bookings_when_a_pod_was_scraped_as_this_process_read_them():
    from kv_preflight.index.routed import Booked
    from kv_preflight.predictor.load import PodLoad
    from kv_preflight.predictor.routed import SCRAPE_MATCH_S, RoutedState

    t = [100.0]
    state = RoutedState(clock=lambda: t[0])
    state.saw_booked({"a": PodRouted(booked=Booked(7, 700)), "b": PodRouted(booked=Booked(2, 20))})
    t[0] = 100.4
    state.saw_booked({"a": PodRouted(booked=Booked(7, 700)), "b": PodRouted(booked=Booked(2, 20))})  # the same
    t[0] = 101.0
    state.saw_booked({"a": PodRouted(booked=Booked(1, 100)), "b": PodRouted(booked=Booked(2, 20))})
    assert state.booked_at("a", 100.5) == 7 and state.booked_at("a", 101.0) == 1 and state.booked_at("a", 99) is None
    assert state.booked_at("a", 101.0 + SCRAPE_MATCH_S + 0.1) is None  # not read about then: unknown
    scraped = {"a": PodLoad(1, 6, 0.0, at=100.5), "b": PodLoad(1, 6, 0.0, at=99.0), "c": None}
    assert state.booked_at_scrape(scraped) == {"a": 7}  # b's bookings were not read at its scrape's time
    t[0] = 101.01  # a busy pod's bookings change every few ms: one value per step kept, the last read in it
    state.saw_booked({"a": PodRouted(booked=Booked(3, 300))})
    assert state.booked_at("a", 101.0) == 3 and len(state._booked_seen["a"]) == 2


def test_a_new_home_counts_in_its_pods_footprint_here_until_every_read_sees_it():
    """Through one gateway, two new prefixes a moment apart: the second must see the first's home before Valkey
    has it, and when its read of Valkey started before the write landed (else both go to the same emptiest pod: 4
    tenants on one pod, 2 on another, in the bench's single-gateway runs). A store whose write is held open stands
    for Valkey that has not answered yet."""
    import asyncio

    from kv_preflight.predictor.routed import RoutedState

    class HeldStore:
        def __init__(self):
            self.go = asyncio.Event()

        async def home(self, pod, prefix, blocks, window_ms):
            await self.go.wait()
            return blocks

    t = [10.0]

    async def run():
        store = HeldStore()
        state = RoutedState(store=store, window_ms=60_000, clock=lambda: t[0])
        state.home(111, "a", 12)
        await asyncio.sleep(0)
        got = state.with_unwritten({"a": PodRouted(footprint=3), "b": PodRouted()}, prefix=222)
        assert (got["a"].footprint, got["b"].footprint) == (15, 0)
        assert state.with_unwritten({"a": PodRouted(footprint=3)}, prefix=111)["a"].footprint == 3  # its own: aside
        state.home(111, "a", 12)  # homed again before written: counted once
        assert state.with_unwritten({"a": PodRouted()}, prefix=222)["a"].footprint == 12
        t[0] = 10.5
        store.go.set()
        for _ in range(3):
            await asyncio.sleep(0)
        # written at 10.5: a read that started before may have missed it, one that started after has it
        assert state.with_unwritten({"a": PodRouted(footprint=3)}, prefix=222, read_at=10.4)["a"].footprint == 15
        assert state.with_unwritten({"a": PodRouted(footprint=15)}, prefix=222, read_at=10.6)["a"].footprint == 15
        t[0] = 13.0
        state.home(333, "b", 4)  # a later write, once done, forgets what every read has seen by now
        for _ in range(3):
            await asyncio.sleep(0)
        assert list(state._homing) == ["b"]

    asyncio.run(run())
