"""predictor/scoring/freshness.py: each pod's ingestion state from the ingesters' leases, and an answer's."""
from __future__ import annotations

import msgspec

from kv_preflight.fleet.records import FleetView, IngesterLease, PodRecord
from kv_preflight.predictor.scoring.freshness import (MAX_LISTED, PodFreshness, answer_freshness, fleet_health,
                                                       next_turn_ms, pod_freshness, stale_for_route, untrusted)

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


def test_an_answer_is_degraded_by_stalled_behind_or_incomplete_pods_and_by_holders_nobody_vouches_for():
    # an unknown pod the answer names without cached tokens (a pods filter, a pod serving the model) misleads nobody
    assert answer_freshness({"a": PodFreshness("current", 10), "b": PodFreshness("unknown")},
                            holders=["a"]).state == "exact"
    got = answer_freshness({"a": PodFreshness("stalled", 9000)}, incomplete=["c"])
    assert got.state == "degraded" and got.reasons == ["ingestion stalled for a", "index incomplete for c"]
    assert answer_freshness({}, partial=True).state == "partial"
    # issue 40: a holder no lease covers (a ghost pod left by a one-off ingester), or whose engine is down
    got = answer_freshness({"a": PodFreshness("current", 10), "g": PodFreshness("unknown"),
                            "d": PodFreshness("unreachable", 300)}, holders=["a", "g", "d"])
    assert got.state == "degraded" and got.reasons == [
        "engine unreachable for d (its health checks fail: what the index holds for it may be gone)",
        "ingestion unknown for g (no ingester's lease covers it)"]
    assert answer_freshness({"d": PodFreshness("unreachable", 300)}, holders=[]).state == "exact"
    # the fleet's records not readable: every answer says so, whatever its pods say
    got = answer_freshness({"a": PodFreshness("current", 10)}, holders=["a"], fleet_problem="records not read")
    assert got.state == "degraded" and got.reasons == ["records not read"]


def test_a_lease_that_missed_two_renewals_is_behind_then_stalled_once_expired():
    """Issue 40 item 9: a SIGSTOPped ingester renews nothing and says nothing; its last account ("current")
    was taken as current for the whole lease TTL. Judged at a later Valkey time, its pods read behind once two
    renewals are missed (2.5 intervals: half of one for the renewal under way), stalled once it expired."""
    renewed = NOW - 400
    frozen = IngesterLease(expires_ms=renewed + 5000, state="current", current_ms=renewed, renewed_ms=renewed,
                           renew_ms=1000, pods=["p"])
    v = view(a=frozen)
    assert pod_freshness(v, ["p"], renewed + 2500, 0.0)["p"] == PodFreshness("current", 2500)
    assert pod_freshness(v, ["p"], renewed + 2501, 0.0)["p"] == PodFreshness("behind", 2501)
    assert pod_freshness(v, ["p"], renewed + 5000, 0.0)["p"] == PodFreshness("stalled", 5000)
    assert next_turn_ms(v, NOW) == renewed + 2501 and next_turn_ms(v, renewed + 2501) == renewed + 5000
    assert next_turn_ms(v, renewed + 5000) is None
    # an ingester that says it renews every 3 s is late later; one that predates renew_ms: every second
    slow = msgspec.structs.replace(frozen, renew_ms=3000, expires_ms=renewed + 15_000)
    assert pod_freshness(view(a=slow), ["p"], renewed + 7000, 0.0)["p"].state == "current"
    old = msgspec.structs.replace(frozen, renew_ms=0)
    assert pod_freshness(view(a=old), ["p"], renewed + 2501, 0.0)["p"].state == "behind"
    # with another ingester current on time, the pod is current
    fine = lease("current", ["p"])
    fine = msgspec.structs.replace(fine, renewed_ms=renewed + 2000, current_ms=renewed + 2000,
                                   expires_ms=renewed + 7000)
    assert pod_freshness(view(a=frozen, b=fine), ["p"], renewed + 3000, 0.0)["p"] == PodFreshness("current", 1000)
    assert fleet_health(v, renewed + 2501) == ["ingester(s) silent, 2 lease renewals missed: a"]


def test_an_unreachable_or_retired_pod_is_never_current():
    """Issue 40 item 2: the pod's record (its engine's health checks) outranks its ingester's account."""
    v = FleetView(now_ms=NOW, load={}, ingesters={"a": lease("current", ["p", "q", "r"])},
                  pods={"p": PodRecord(state="unreachable", models=["m"]), "q": PodRecord(state="retired"),
                        "r": PodRecord(models=["m"]), "s": PodRecord(state="unreachable", models=["n"])})
    got = pod_freshness(v, ["p", "q", "r", "s"], NOW, 0.0)
    assert got == {"p": PodFreshness("unreachable", 400), "q": PodFreshness("retired", 400),
                   "r": PodFreshness("current", 400), "s": PodFreshness("unreachable")}
    assert untrusted(got) == {"p", "q", "s"}
    # a data-parallel rank's index pod (<pod>@dp<r>) has its pod's record
    ranked = msgspec.structs.replace(v, ingesters={"a": lease("current", ["p@dp1"])})
    assert pod_freshness(ranked, ["p@dp1"], NOW, 0.0)["p@dp1"] == PodFreshness("unreachable", 400)
    assert untrusted({"u": PodFreshness("unknown"), "b": PodFreshness("behind", 10)}) == {"u"}
    # /health: model n has no live pod; m has r
    assert fleet_health(v) == ["no live pod for model(s) n: every pod serving them is unreachable"]


def test_a_large_answer_lists_the_pods_that_need_reading_first():
    pods = {f"p{i:04d}": PodFreshness("current", 5) for i in range(1000)} | {"z": PodFreshness("stalled", 9000)}
    got = answer_freshness(pods)
    assert len(got.pods) == MAX_LISTED and got.pods_truncated and "z" in got.pods and got.state == "degraded"
    pods |= {"u": PodFreshness("unreachable", 9), "g": PodFreshness("unknown")}
    got = answer_freshness(pods, holders=["g"])
    assert {"z", "u", "g"} <= set(got.pods) and len(got.pods) == MAX_LISTED


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


def test_one_pod_behind_does_not_age_the_others_and_the_newest_batch_of_any_copy_is_the_lag():
    """Walkthrough of 2026-12-07: an engine killed, its pod's stream down, and the ingester's other pod read
    ``current`` with a staleness rising by the second (49 s), as its lease's ``current_ms`` stood still while any
    pod was behind. Now ``current_ms`` is the last renewal at which every pod not listed behind was current, and
    a pod behind has its own (``behind_since_ms``); a lease that predates it keeps the old meaning. The index lag
    is from the newest batch any ingester of the pod applied: a copy whose duplicate was not applied again has an
    older one."""
    now_lease = IngesterLease(expires_ms=NOW + 3000, state="behind", current_ms=NOW - 300, pods=["ok", "dead"],
                              behind=["dead"], behind_since_ms={"dead": NOW - 49_000}, batch_ts={"ok": 990.0})
    copy = IngesterLease(expires_ms=NOW + 3000, state="current", current_ms=NOW - 900, pods=["ok"],
                         batch_ts={"ok": 999.5})
    got = pod_freshness(view(a=now_lease, b=copy), ["ok", "dead"], NOW, 1000.0)
    assert got["ok"] == PodFreshness("current", 300, 500)  # a's account (the least stale), b's newer batch
    assert got["dead"] == PodFreshness("behind", 49_000)
    never = msgspec.structs.replace(now_lease, behind_since_ms={"dead": 0})  # behind since this ingester took it
    assert pod_freshness(view(a=never), ["dead"], NOW, 1000.0)["dead"] == PodFreshness("behind")
    old = msgspec.structs.replace(now_lease, current_ms=NOW - 49_000, behind_since_ms=None)  # predates the field
    assert pod_freshness(view(a=old), ["ok"], NOW, 1000.0)["ok"].staleness_ms == 49_000


def test_health_does_not_count_an_unreachable_pod_as_behind():
    behind = IngesterLease(expires_ms=NOW + 3000, state="behind", current_ms=NOW - 300, pods=["ok", "dead"],
                           behind=["dead"])
    v = FleetView(now_ms=NOW, load={}, ingesters={"a": behind},
                  pods={"ok": PodRecord(models=["m"]), "dead": PodRecord(state="unreachable", models=["m"])})
    assert fleet_health(v) == []
    v = msgspec.structs.replace(v, pods={"ok": PodRecord(models=["m"]), "dead": PodRecord(models=["m"])})
    assert fleet_health(v) == ["1 pod(s) behind"]
