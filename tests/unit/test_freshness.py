"""predictor/scoring/freshness.py: each pod's ingestion state from the ingesters' leases, and an answer's."""
from __future__ import annotations

from kv_preflight.fleet.records import FleetView, IngesterLease
from kv_preflight.predictor.scoring.freshness import (MAX_LISTED, PodFreshness, answer_freshness, fleet_health,
                                                       pod_freshness, stale_for_route)

NOW = 1_000_000


def view(**leases: IngesterLease) -> FleetView:
    return FleetView(now_ms=NOW, pods={}, load={}, ingesters=dict(leases))


def lease(state: str, pods: list[str], *, live: bool = True, current_ms: int = NOW - 400, behind=(),
          batch_ts=None) -> IngesterLease:
    return IngesterLease(expires_ms=NOW + (3000 if live else -1), state=state, current_ms=current_ms, pods=pods,
                         behind=list(behind), batch_ts=batch_ts or {})


def test_each_pod_gets_the_best_account_among_the_leases_listing_it():
    v = view(a=lease("current", ["p1", "p2"], batch_ts={"p1": 990.0}),
             b=lease("behind", ["p2", "p3"], behind=["p3"]),
             c=lease("current", ["p4"], live=False, current_ms=NOW - 40_000))
    got = pod_freshness(v, ["p1", "p2", "p3", "p4", "p5"], NOW, 1000.0)
    assert got["p1"] == PodFreshness("current", 400, 10_000)
    assert got["p2"].state == "current"  # one current copy is enough
    assert got["p3"].state == "behind"
    assert got["p4"] == PodFreshness("stalled", 40_000)  # its only lease expired
    assert got["p5"] == PodFreshness("unknown")


def test_an_answer_is_degraded_by_stalled_behind_or_incomplete_pods_not_unknown_ones():
    assert answer_freshness({"a": PodFreshness("current", 10), "b": PodFreshness("unknown")}).state == "exact"
    got = answer_freshness({"a": PodFreshness("stalled", 9000)}, incomplete=["c"])
    assert got.state == "degraded" and got.reasons == ["ingestion stalled for a", "index incomplete for c"]
    assert answer_freshness({}, partial=True).state == "partial"


def test_a_large_answer_lists_the_pods_that_need_reading_first():
    pods = {f"p{i:04d}": PodFreshness("current", 5) for i in range(1000)} | {"z": PodFreshness("stalled", 9000)}
    got = answer_freshness(pods)
    assert len(got.pods) == MAX_LISTED and got.pods_truncated and "z" in got.pods and got.state == "degraded"


def test_route_staleness_and_health():
    pods = {"a": PodFreshness("current", 300), "b": PodFreshness("current", 3000), "c": PodFreshness("unknown")}
    assert stale_for_route(pods, 1000) == ["b", "c"]
    assert fleet_health(view(a=lease("stalled", ["p"]))) == ["every ingester stalled (1)"]
    assert fleet_health(view(a=lease("current", ["p"], live=False)))[0].startswith("no live ingester")
    assert fleet_health(view(a=lease("current", ["p"]))) == []


def test_an_answer_naming_an_approximate_pod_is_never_exact():
    from kv_preflight.predictor.scoring.freshness import APPROXIMATE_POD, PodFreshness, answer_freshness

    f = answer_freshness({"a": PodFreshness("current", 3, 10), "g": APPROXIMATE_POD})
    assert f.state == "degraded" and f.pods["g"].state == "approximate"
    assert f.reasons == ["index approximate for g (no KV events: what the gateways sent there)"]
    assert answer_freshness({"a": PodFreshness("current", 3, 10)}).state == "exact"
