"""Routing decisions (pure) and the engine-metrics parser, on a real vLLM 0.32 /metrics capture."""
from __future__ import annotations

import pytest

from kv_preflight.engines.load_metrics import parse_load, parse_rank_loads
from kv_preflight.engines.vllm import LOAD_METRICS as VLLM_LOAD
from kv_preflight.predictor.load import PodLoad, make_target
from kv_preflight.predictor.scoring.route import RoutingPolicy, decide, rendezvous
from kv_preflight.predictor.scoring.score import PodAffinity, Prediction
from kv_preflight.predictor.scoring.ttft import PrefillModel
from tests.conftest import fixture_path

POLICY = RoutingPolicy()
TTFT = PrefillModel()


def prediction(n: int, *cached: tuple[str, int, str]) -> Prediction:
    aff = [PodAffinity(pod_id=p, cached_blocks=c // 16, cached_tokens=c, device_tier=t) for p, c, t in cached]
    aff.sort(key=lambda a: (-a.cached_tokens, a.pod_id))
    best = aff[0] if aff else None
    return Prediction(best.cached_tokens if best else 0, n, n // 16, best.cached_blocks if best else 0, 0.0,
                      best.pod_id if best else None, aff)


def load(running: float = 0, waiting: float = 0, kv: float = 0.1) -> PodLoad:
    return PodLoad(running, waiting, kv, at=0.0)


def test_best_overlap_when_not_overloaded():
    p = prediction(512, ("a", 320, "gpu"), ("b", 128, "gpu"))
    d = decide(p, ["a", "b", "c"], {"a": load(3), "b": load(1), "c": load(0)}, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason, d.cached_tokens) == ("a", "best_overlap", 320)
    assert d.estimated_ttft_ms == TTFT.estimate_ms(512, 320)
    assert [c.pod_id for c in d.candidates] == ["a", "b", "c"]
    assert d.best_overlap_pod == "a"


def test_overloaded_best_goes_to_least_loaded_good_match():
    p = prediction(512, ("a", 320, "gpu"), ("b", 256, "gpu"), ("c", 64, "gpu"))
    loads = {"a": load(8, 4), "b": load(2), "c": load(0)}  # a: 16 vs least 0 -> overloaded
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("b", "least_loaded_good_match")
    assert "a has the best overlap but is overloaded" in d.detail
    assert next(c for c in d.candidates if c.pod_id == "a").overloaded


def test_no_good_match_falls_to_least_loaded():
    p = prediction(512, ("a", 320, "gpu"), ("c", 64, "gpu"))
    d = decide(p, ["a", "b", "c"], {"a": load(10), "b": load(0), "c": load(1)}, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("b", "least_loaded")


def test_small_absolute_differences_never_overload():
    # 3 vs 0 is "infinitely" more loaded but below the absolute threshold (SGLang-style double condition)
    p = prediction(512, ("a", 320, "gpu"))
    d = decide(p, ["a", "b"], {"a": load(3), "b": load(0)}, policy=POLICY, ttft=TTFT)
    assert d.pod_id == "a"
    # 20 vs 17 exceeds the absolute threshold but not the relative one
    d = decide(p, ["a", "b"], {"a": load(20), "b": load(17)}, policy=RoutingPolicy(overload_abs=2), ttft=TTFT)
    assert d.pod_id == "a"


def test_kv_usage_alone_overloads():
    p = prediction(512, ("a", 320, "gpu"), ("b", 200, "gpu"))
    d = decide(p, ["a", "b"], {"a": load(1, kv=0.97), "b": load(1)}, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("b", "least_loaded_good_match")
    assert "KV usage" in d.detail


def test_tier_weights_prefer_gpu_over_a_slightly_longer_cpu_hit():
    p = prediction(512, ("cpu-pod", 320, "cpu"), ("gpu-pod", 288, "gpu"))
    d = decide(p, ["cpu-pod", "gpu-pod"], {}, policy=POLICY, ttft=TTFT)
    assert d.pod_id == "gpu-pod"  # 288 x 1.0 > 320 x 0.8
    even = RoutingPolicy(tier_weights={"gpu": 1.0, "cpu": 1.0})
    assert decide(p, ["cpu-pod", "gpu-pod"], {}, policy=even, ttft=TTFT).pod_id == "cpu-pod"


def test_no_overlap_least_loaded_else_stable_rendezvous():
    p = prediction(100)
    d = decide(p, ["a", "b", "c"], {"a": load(2), "b": load(1), "c": load(3)}, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("b", "no_overlap")
    # no load data: a prefix goes to the same pod every time, and different prefixes spread out
    chosen = {decide(p, ["a", "b", "c"], {}, policy=POLICY, ttft=TTFT, affinity_key=k).pod_id for k in range(60)}
    assert chosen == {"a", "b", "c"}
    again = decide(p, ["a", "b", "c"], {}, policy=POLICY, ttft=TTFT, affinity_key=7).pod_id
    assert again == decide(p, ["c", "b", "a"], {}, policy=POLICY, ttft=TTFT, affinity_key=7).pod_id
    assert max(["a", "b", "c"], key=lambda pod: rendezvous(7, pod)) == again


def test_all_overloaded_and_no_candidates():
    p = prediction(512, ("a", 320, "gpu"), ("b", 64, "gpu"))
    d = decide(p, ["a", "b"], {"a": load(1, kv=0.99), "b": load(1, kv=0.99)}, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("a", "all_overloaded")
    none = decide(prediction(10), [], {}, policy=POLICY, ttft=TTFT)
    assert (none.pod_id, none.reason, none.candidates) == (None, "no_candidates", [])


def test_unknown_load_is_not_overloaded_but_known_load_is_preferred():
    p = prediction(512, ("a", 320, "gpu"), ("b", 300, "gpu"), ("c", 300, "gpu"))
    d = decide(p, ["a", "b", "c"], {"a": load(12), "b": None, "c": load(0)}, policy=POLICY, ttft=TTFT)
    assert d.pod_id == "c"


def test_a_lone_pod_with_known_load_can_be_overloaded():
    """Issue #10: with only one pod scraped, the old rule never called it overloaded (it had no peer with
    known load) and sent everything there. Its peers' load is unknown, so it is judged against the thresholds."""
    p = prediction(512, ("a", 320, "gpu"))
    loads = {"a": load(10), "b": None, "c": None, "d": None}
    d = decide(p, ["a", "b", "c", "d"], loads, policy=POLICY, ttft=TTFT, affinity_key=3)
    assert next(c for c in d.candidates if c.pod_id == "a").overloaded
    assert d.pod_id in {"b", "c", "d"} and d.reason == "least_loaded"
    assert "vs the fleet's mean 2.5" in d.detail  # (10 + 0 + 0 + 0) / 4
    # below the thresholds it keeps its cache hits
    assert decide(p, ["a", "b", "c", "d"], {"a": load(3)}, policy=POLICY, ttft=TTFT).pod_id == "a"


def test_unknown_load_does_not_sort_last():
    """Pods with unknown load are assumed as loaded as the known ones' mean, so prompts with no overlap
    spread over every pod rather than all going to the one pod that is scraped."""
    p = prediction(100)
    chosen = [decide(p, ["a", "b", "c", "d"], {"a": load(0)}, policy=POLICY, ttft=TTFT, affinity_key=k).pod_id
              for k in range(80)]
    assert set(chosen) == {"a", "b", "c", "d"}
    assert max(chosen.count(x) for x in "abcd") < 40
    d = decide(p, ["a", "b"], {"a": load(4)}, policy=POLICY, ttft=TTFT)
    assert next(c for c in d.candidates if c.pod_id == "b").assumed_load == 4
    # known lower than the mean still wins
    d = decide(p, ["a", "b", "c"], {"a": load(1), "b": load(5)}, policy=POLICY, ttft=TTFT)
    assert d.pod_id == "a"


def test_overload_is_judged_against_the_mean_not_the_idlest_pod():
    """One idle pod must not make every busy pod overloaded (that herds onto the idle one until the next scrape)."""
    p = prediction(512, ("a", 320, "gpu"), ("b", 64, "gpu"))
    loads = {"a": load(6), "b": load(6), "c": load(6), "d": load(0)}
    d = decide(p, ["a", "b", "c", "d"], loads, policy=POLICY, ttft=TTFT)
    assert (d.pod_id, d.reason) == ("a", "best_overlap")  # 6 vs mean 4.5: not overloaded
    loads["a"] = load(14)  # 14 vs mean 6.5
    assert decide(p, ["a", "b", "c", "d"], loads, policy=POLICY, ttft=TTFT).reason == "least_loaded"


def test_a_new_prefix_goes_where_other_prefixes_take_the_least_room():
    """Where a prefix nobody holds lands, it stays: it is placed by the blocks of other recent prefixes homed
    on each pod (predictor/scoring/placement.py), before this second's load; an overloaded pod is never chosen."""
    p = prediction(192)
    loads = {"a": load(0), "b": load(3), "c": load(0)}
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT, footprints={"a": 36, "b": 24, "c": 36})
    assert (d.pod_id, d.reason) == ("b", "no_overlap")
    assert "fewest blocks of other recent prefixes (24)" in d.detail
    assert {c.pod_id: c.recent_prefix_blocks for c in d.candidates} == {"a": 36, "b": 24, "c": 36}
    # equal room: the least loaded, then the prefix's rendezvous order (as without footprints)
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT, footprints={"a": 24, "b": 24, "c": 36})
    assert d.pod_id == "a"
    # the roomiest pod is overloaded (15 vs the mean 5): the next roomiest
    loads = {"a": load(0), "b": load(15), "c": load(0)}
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT, footprints={"a": 36, "b": 0, "c": 24})
    assert d.pod_id == "c"
    # footprints only place new prefixes: a held prefix follows its cache
    held = prediction(192, ("a", 176, "gpu"))
    d = decide(held, ["a", "b", "c"], {}, policy=POLICY, ttft=TTFT, footprints={"a": 99, "b": 0, "c": 0})
    assert (d.pod_id, d.reason) == ("a", "best_overlap")


def test_a_pending_prefix_follows_its_first_request_unless_that_pod_is_overloaded():
    p = prediction(192)
    loads = {"a": load(0), "b": load(0), "c": load(0)}
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT, footprints={"a": 40, "b": 0, "c": 0},
               pending="a")
    assert (d.pod_id, d.reason) == ("a", "no_overlap") and "pending" in d.detail
    loads["a"] = load(15)
    d = decide(p, ["a", "b", "c"], loads, policy=POLICY, ttft=TTFT, footprints={"a": 40, "b": 0, "c": 0},
               pending="a")
    assert d.pod_id in {"b", "c"} and "pending" not in d.detail
    # a pending pod that is not a candidate (filtered out, retired) is ignored
    d = decide(p, ["b", "c"], {}, policy=POLICY, ttft=TTFT, footprints={"b": 12, "c": 0}, pending="a")
    assert d.pod_id == "c"


# ---------------------------------------------------------------- metrics parsing


def test_parse_real_vllm_metrics_under_load():
    running, waiting, kv = parse_load(fixture_path("vllm-0.32-metrics.txt").read_text(), VLLM_LOAD)
    assert (running, waiting) == (8.0, 8.0)  # max-num-seqs 8, the rest queued; *_by_reason is not added in
    assert 0 < kv < 1


def test_parse_sums_dp_ranks_and_accepts_the_old_name():
    text = "\n".join([
        "# HELP vllm:num_requests_running x", "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5',
        'vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.7',
        "vllm:num_requests_waiting_by_reason{reason=\"capacity\"} 99",
    ])
    assert parse_load(text, VLLM_LOAD) == pytest.approx((5.0, 1.0, 0.6))
    assert parse_load("process_cpu_seconds_total 1.0\n", VLLM_LOAD) is None
    # each rank's own, for its index pod (a rank is a candidate of its own: kv_preflight/index/rank_pods.py)
    ranks = parse_rank_loads(text, VLLM_LOAD)
    assert ranks == {0: pytest.approx((2.0, 1.0, 0.5)), 1: pytest.approx((3.0, 0.0, 0.7))}
    assert parse_rank_loads("vllm:num_requests_running 2.0\n", VLLM_LOAD) == {}


def test_make_target():
    t = make_target("p", "http://h:8000/metrics")
    assert (t.base_url, t.metrics_url) == ("http://h:8000", "http://h:8000/metrics")
    assert make_target(None, "http://h:8000/").metrics_url == "http://h:8000/metrics"


def test_booked_requests_count_as_load_before_the_next_scrape():
    """Gateways' bookings (kv_preflight/index/routed.py): a pod is at least as loaded as the requests booked there,
    so a burst another gateway sent since the last scrape overloads the best pod here too."""
    from kv_preflight.index.routed import Booked

    p = prediction(512, ("a", 320, "gpu"), ("b", 256, "gpu"))
    scraped = {"a": load(0), "b": load(0)}  # the last scrape: both idle
    assert decide(p, ["a", "b"], scraped, policy=POLICY, ttft=TTFT).pod_id == "a"
    d = decide(p, ["a", "b"], scraped, policy=POLICY, ttft=TTFT, booked={"a": Booked(16, 9000), "b": Booked(0, 0)})
    assert (d.pod_id, d.reason) == ("b", "least_loaded_good_match")
    a = next(c for c in d.candidates if c.pod_id == "a")
    assert a.overloaded and (a.load, a.booked_requests, a.booked_tokens) == (16.0, 16, 9000)
    # the scrape already counts them: the larger of the two, not their sum
    d = decide(p, ["a", "b"], {"a": load(20), "b": load(0)}, policy=POLICY, ttft=TTFT, booked={"a": Booked(16, 9000)})
    assert next(c for c in d.candidates if c.pod_id == "a").load == 20.0


def test_booked_pods_without_metrics_are_known_and_ties_go_to_fewer_booked_tokens():
    from kv_preflight.index.routed import Booked

    fresh = prediction(512)
    d = decide(fresh, ["a", "b", "c"], {}, policy=POLICY, ttft=TTFT,
               booked={"a": Booked(2, 100), "b": Booked(1, 5000), "c": Booked(1, 50)})
    assert d.pod_id == "c" and all(c.assumed_load is None for c in d.candidates)
    overlap = prediction(512, ("a", 320, "gpu"))
    d = decide(overlap, ["a", "b"], {}, policy=RoutingPolicy(overload_abs=2), ttft=TTFT,
               booked={"a": Booked(6, 0), "b": Booked(0, 0)})  # no metrics anywhere, yet a is overloaded
    assert (d.pod_id, d.reason) == ("b", "least_loaded")


def test_load_references_equal_the_fleet_mean_with_unknown_pods_filled_per_pod():
    """Each known pod's reference, from one sum, equals the definition: the mean over every candidate, each unknown
    one counted as the mean of the known ones other than this pod (idle when there are none)."""
    import random

    from kv_preflight.predictor.scoring.route import load_references

    def naive(scores, pods):
        out = {}
        for pod in scores:
            known = [scores[p] for p in pods if p in scores and p != pod]
            fill = sum(known) / len(known) if known else 0.0
            out[pod] = sum(scores.get(p, fill) for p in pods) / len(pods)
        return out

    rng = random.Random(5)
    for _ in range(500):
        pods = [f"p{i}" for i in range(rng.randint(2, 30))]
        scores = {p: float(rng.choice([0, 1, 2, 7, rng.uniform(0, 50)])) for p in pods if rng.random() < 0.7}
        got, want = load_references(scores, len(pods)), naive(scores, pods)
        assert got.keys() == want.keys()
        assert all(abs(got[p] - want[p]) < 1e-9 for p in got), (scores, len(pods))
    assert load_references({"a": 4.0}, 3) == {"a": 4.0 / 3}  # the others unknown, counted idle


def test_a_new_prefix_lists_the_pods_it_may_go_to_in_rule_5s_order_with_their_footprints():
    """What a gateway claims a new prefix's pod from (kv_preflight/index/routed.py ``claim``): the pods not
    overloaded, in the order rule 5 ranks them (the chosen one first), each with its footprint, which the claim
    weighs with what other gateways placed a moment ago."""
    from kv_preflight.index.routed import Booked
    from kv_preflight.predictor.scoring.route import placed_on, placement_order

    p = prediction(512)
    pods = ["d", "c", "b", "a", "e"]
    loads = {"a": load(0), "b": load(0), "c": load(0), "d": load(0), "e": load(20)}  # e: overloaded, never placed on
    booked = {"a": Booked(0, 0), "b": Booked(0, 0), "c": Booked(1, 300), "d": Booked(0, 0), "e": Booked(0, 0)}
    d = decide(p, pods, loads, policy=POLICY, ttft=TTFT, affinity_key=7, footprints={"a": 0, "b": 0, "c": 0, "d": 12},
               booked=booked)
    order = placement_order(d, 7)
    assert d.reason == "no_overlap" and order[0][0] == d.pod_id
    # a and b as empty and idle (by the prefix's hash), then c (as empty, but a booking), then d (another prefix)
    assert sorted(order[:2]) == [("a", 0), ("b", 0)] and order[2:] == [("c", 0), ("d", 12)]
    other = "b" if d.pod_id == "a" else "a"
    moved = placed_on(d, other)
    assert (moved.pod_id, moved.reason, moved.cached_tokens) == (other, "no_overlap", 0)
    assert moved.estimated_ttft_ms == d.estimated_ttft_ms and "placed a moment ago" in moved.detail
    # nothing known of anyone: every pod, by the prefix's hash
    d = decide(p, pods, {}, policy=POLICY, ttft=TTFT, affinity_key=7)
    assert [q for q, _ in placement_order(d, 7)] == sorted(pods, key=lambda q: -rendezvous(7, q))
    # a prompt some pod holds is not placed: nothing to claim
    assert placement_order(decide(prediction(512, ("a", 320, "gpu")), pods, {}, policy=POLICY, ttft=TTFT), 7) == []
