"""The placement memory (predictor/scoring/placement.py) and how the route rule places new prefixes with it."""
from __future__ import annotations

from collections import Counter

import pytest

from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.placement import PrefixPlacements
from kv_preflight.predictor.scoring.route import RoutingPolicy, decide
from kv_preflight.predictor.scoring.score import Prediction
from kv_preflight.predictor.prediction import prefix_placements
from kv_preflight.predictor.scoring.ttft import PrefillModel
from kv_preflight.config import Config

PODS = ["a", "b", "c", "d"]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def remembered(m: PrefixPlacements) -> int:
    """How many prefixes the memory holds."""
    return len(m._homes)


def memory(clock: Clock, window_s: float = 60.0, pending_s: float = 5.0, **kw) -> PrefixPlacements:
    return PrefixPlacements(window_s=window_s, pending_s=pending_s, clock=clock, **kw)


def test_footprints_count_other_prefixes_and_pending_lasts_pending_s():
    clock = Clock()
    m = memory(clock)
    m.placed(1, "a", 15)
    m.placed(2, "a", 10)
    m.placed(3, "b", 12)
    h = m.hint(1, PODS)
    assert h.footprints == {"a": 10, "b": 12, "c": 0, "d": 0}  # prefix 1's own blocks are not counted against it
    assert h.pending == "a"
    assert m.hint(9, PODS).footprints == {"a": 25, "b": 12, "c": 0, "d": 0} and m.hint(9, PODS).pending is None
    clock.t += 5.0
    assert m.hint(1, PODS).pending is None  # the index should show it by now: no longer pending


def test_a_pending_prefix_keeps_its_first_placement_time():
    clock = Clock()
    m = memory(clock)
    m.placed(1, "a", 15)
    clock.t += 4.0
    m.placed(1, "a", 15)  # a second request of the still-pending prefix
    clock.t += 2.0
    assert m.hint(1, PODS).pending is None  # 6 s since it was placed, not 2


def test_seen_moves_the_home_and_takes_the_cached_length():
    clock = Clock()
    m = memory(clock)
    m.placed(1, "a", 15)
    m.seen(1, "a", 12)
    assert m.hint(9, PODS).footprints["a"] == 12
    assert m.hint(1, PODS).pending == "a"  # seen on its pod: still the same placement
    m.seen(1, "b", 12)  # the pod holding the most of it is b now
    assert m.hint(9, PODS).footprints == {"a": 0, "b": 12, "c": 0, "d": 0}
    assert m.hint(1, PODS).pending is None
    assert remembered(m) == 1


def test_prefixes_not_seen_within_the_window_stop_counting():
    clock = Clock()
    m = memory(clock, window_s=30.0)
    m.placed(1, "a", 15)
    clock.t += 20.0
    m.placed(2, "a", 10)
    clock.t += 15.0  # prefix 1 last seen 35 s ago, prefix 2 15 s ago
    assert m.hint(9, PODS).footprints["a"] == 10 and remembered(m) == 1
    m.seen(2, "a", 10)
    clock.t += 29.0
    assert m.hint(9, PODS).footprints["a"] == 10  # seeing it renewed it
    clock.t += 1.0
    assert m.hint(9, PODS).footprints["a"] == 0 and remembered(m) == 0


def test_memory_is_bounded():
    clock = Clock()
    m = memory(clock, max_prefixes=3)
    for k in range(10):
        m.placed(k, PODS[k % 4], 1)
    assert remembered(m) == 3
    assert sum(m.hint(99, PODS).footprints.values()) == 3


def place_new_prefixes(placements: PrefixPlacements | None, prefixes: list[int],
                       loads: dict[str, PodLoad | None], *, busier: bool = False) -> Counter:
    """Each prefix's request, nobody holding it yet: where the rule puts it (and the memory notes it).
    ``busier``: a scrape between requests shows each pod one request busier per request it was sent."""
    where: Counter = Counter()
    for k in prefixes:
        hint = placements.hint(k, PODS) if placements is not None else None
        d = decide(Prediction(0, 192, 12, 0, 0.0, None, []), PODS, loads, policy=RoutingPolicy(), ttft=PrefillModel(),
                   affinity_key=k, footprints=hint.footprints if hint else None, pending=hint.pending if hint else None)
        assert d.reason == "no_overlap"
        if placements is not None:
            placements.placed(k, d.pod_id, 12)
        where[d.pod_id] += 1
        if busier:
            loads[d.pod_id] = PodLoad(where[d.pod_id], 0, 0.1, at=0.0)
    return where


def test_new_prefixes_fill_the_pods_evenly_where_hashing_does_not():
    """Issue #10: 12 tenants over 4 pods that each hold about 4 tenants' prompts. Placed by load (equal here, as
    between two scrapes) then prefix hash, some pods get more prefixes than fit; placed by footprint, 3 each."""
    prefixes = [0x9E3779B97F4A7C15 * (t + 1) % 2**64 for t in range(12)]
    loads = {p: PodLoad(1, 0, 0.1, at=0.0) for p in PODS}
    by_hash = place_new_prefixes(None, prefixes, loads)
    assert max(by_hash.values()) > 3  # the old rule: this set of prefixes hashes 2 / 4 / 4 / 2
    by_room = place_new_prefixes(memory(Clock()), prefixes, loads)
    assert sorted(by_room.values()) == [3, 3, 3, 3]


def test_concurrent_first_requests_of_a_new_prefix_stay_together():
    """Before the index shows a new prefix, its next requests see no overlap too; as its first requests make
    their pod busier they would spread by load over every pod. Pending, they follow the first."""
    loads = {p: PodLoad(0, 0, 0.1, at=0.0) for p in PODS}
    assert len(place_new_prefixes(None, [42] * 4, dict(loads), busier=True)) == 4  # the old rule: sprayed
    where = place_new_prefixes(memory(Clock()), [42] * 4 + [7] * 4, dict(loads), busier=True)
    assert sorted(where.values()) == [4, 4]


def test_config_flags_env_and_off(monkeypatch):
    monkeypatch.setenv("KVPF_ROUTE_PLACEMENT_WINDOW_S", "30")
    cfg = Config.load(route_pending_s=2.0)
    assert (cfg.route_placement_window_s, cfg.route_pending_s) == (30.0, 2.0)
    m = prefix_placements(cfg)
    assert m is not None and (m.window_s, m.pending_s) == (30.0, 2.0)
    assert prefix_placements(Config.load(route_placement_window_s=0)) is None  # off: new prefixes by load only
    for bad in ({"route_placement_window_s": -1}, {"route_pending_s": -0.5}):
        with pytest.raises(ValueError):
            Config.load(**bad)
