"""What the predictor reads from the fleet records (predictor/fleet_view.py), on a fixed view and a fake clock."""
from __future__ import annotations

import types

import msgspec
import pytest

from kv_preflight.predictor.fleet_view import REREAD_MIN_S, FleetWatcher
from kv_preflight.predictor.scoring.freshness import PodFreshness
from kv_preflight.fleet.records import FleetView, IngesterLease, PodLoad, PodRecord


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watcher() -> tuple[FleetWatcher, Clock]:
    clock = Clock()
    w = FleetWatcher(index=None, clock=clock)  # type: ignore[arg-type]  # never read here
    w.set_view(FleetView(now_ms=50_000, ingesters={}, pods={
        "a": PodRecord(engine_url="http://a:1/", models=["llama", "sql"]),
        "b": PodRecord(state="unreachable", engine_url="http://b:1", models=["llama"]),
        "c": PodRecord(state="retired", engine_url="http://c:1", models=["llama"]),
        "d": PodRecord(engine_url="http://d:1"),  # models not known yet
    }, load={"a": PodLoad(running=2, waiting=1, kv_usage=1.5, at_ms=48_000),
             "b": PodLoad(running=0, waiting=0, kv_usage=0.0, at_ms=10_000)}))
    return w, clock


def test_states_models_and_engines():
    w, _ = watcher()
    assert w.known() == {"a", "b", "d"} and w.retired() == {"c"} and w.unreachable() == {"b"}
    assert w.serving("llama") == {"a", "b"} and w.serving("sql") == {"a"}
    assert w.models_of("d") is None and w.models_of("a") == {"llama", "sql"}
    # tokenization goes to live pods' engines only
    assert w.engines_of("llama") == ["http://a:1"] and w.engines_of("other") == []


def test_engines_are_kept_per_view_and_each_new_view_answers_anew():
    """engines_of is asked on every request's model check: kept for the view it was computed from, not kept past it."""
    w, _ = watcher()
    assert w.engines_of("llama") == ["http://a:1"] and w.engines_of("llama") is w.engines_of("llama")
    w.set_view(FleetView(now_ms=51_000, ingesters={}, load={}, pods={
        "a": PodRecord(state="unreachable", engine_url="http://a:1/", models=["llama"]),
        "e": PodRecord(engine_url="http://e:1", models=["llama"])}))
    assert w.engines_of("llama") == ["http://e:1"]


def test_load_age_is_valkey_time_plus_local_time_since_the_read():
    w, clock = watcher()
    ld = w.load("a", stale_s=5)
    assert (ld.running, ld.waiting, ld.kv_usage) == (2, 1, 1.0)  # usage clipped to 0..1
    assert clock() - ld.at == 2.0  # 50_000 - 48_000 ms on Valkey's clock
    clock.t += 2.5
    assert w.load("a", stale_s=5) is not None
    clock.t += 1.0  # 5.5 s old now
    assert w.load("a", stale_s=5) is None
    assert w.load("b", stale_s=5) is None and w.load("zzz", stale_s=5) is None
    assert w.status(5)["pods"]["a"]["load_age_s"] == 5.5


def test_no_view_yet_knows_nothing():
    w = FleetWatcher(index=None)  # type: ignore[arg-type]
    assert w.known() == w.retired() == w.unreachable() == frozenset()
    assert w.engines_of("m") == [] and w.load("a", 5) is None and w.serving("m") == frozenset()


def test_accounts_age_by_the_local_clock_and_turn_without_a_new_read():
    """Issue 40 items 3 and 9: the view's leases are judged at its Valkey time plus the local time since it was
    read, so a lease nobody renews turns behind (two renewals missed) and then stalled (expired) in every answer,
    whether its ingester froze or this predictor can no longer read the leases; the answers say which."""
    clock = Clock()
    w = FleetWatcher(index=None, clock=clock)  # type: ignore[arg-type]
    lease = IngesterLease(expires_ms=55_000, state="current", current_ms=49_800, renewed_ms=49_800, renew_ms=1000,
                          pods=["p"])
    w.set_view(FleetView(now_ms=50_000, ingesters={"i": lease}, load={},
                         pods={"p": PodRecord(models=["m"]), "q": PodRecord(state="unreachable", models=["m"])}))

    def now(pod: str) -> PodFreshness:  # as an answer lists it
        return w.aged(w.freshness([pod])[pod])

    assert w.freshness(["p", "q", "z"]) == {"p": PodFreshness("current", 200), "q": PodFreshness("unreachable"),
                                            "z": PodFreshness("unknown")}
    assert w.problem() is None and w.health_reasons() == []
    clock.t += 2.0  # 2.2 s since the renewal: not late yet
    assert now("p") == PodFreshness("current", 2200)
    clock.t += 0.4  # 2.6 s: two renewals missed
    assert now("p") == PodFreshness("behind", 2600)
    assert w.health_reasons() == ["ingester(s) silent, 2 lease renewals missed: i"]
    # reads failing: every answer says so, with the time since the last successful one
    w.failing = "ConnectionError: the shard is down"
    assert w.problem() == ("the fleet records (ingester leases, pod records) not read for 2400 ms (ConnectionError: "
                           "the shard is down): each pod's account is as of the last successful read")
    clock.t += 3.0  # 5.6 s: the lease expired
    assert now("p") == PodFreshness("stalled", 5600)
    # no failure recorded, but no read either for longer than a read may take (one hanging): said too
    w.failing = None
    assert w.problem() is not None and "a read has not answered" in w.problem()
    w.set_view(FleetView(now_ms=56_000, ingesters={"i": msgspec.structs.replace(
        lease, renewed_ms=55_900, current_ms=55_900, expires_ms=60_900)}, load={}, pods={}))
    assert now("p") == PodFreshness("current", 100) and w.problem() is None


class _Records:
    """The fleet store's one read the watcher makes, answering the views given in turn (the last one again)."""

    def __init__(self, *views: FleetView) -> None:
        self.views, self.reads = list(views), 0

    async def fleet_view(self) -> FleetView:
        self.reads += 1
        return self.views[min(self.reads, len(self.views)) - 1]


@pytest.mark.anyio
async def test_a_holder_no_read_knows_is_read_again_at_most_every_quarter_second():
    """``catch_up``: a pod holding blocks that the last read of the records does not list (an engine just attached)
    makes the watcher read them again now, so it is judged by the lease its ingester put before its first write;
    a pod nobody vouches for costs at most one read per REREAD_MIN_S, whatever the request rate."""
    clock = Clock()
    lease = IngesterLease(state="current", current_ms=50_000, pods=["new"], expires_ms=60_000, renewed_ms=50_000)
    records = _Records(FleetView(now_ms=50_000, ingesters={}, pods={}, load={}),
                       FleetView(now_ms=50_100, ingesters={"i": lease}, pods={}, load={}))
    w = FleetWatcher(index=types.SimpleNamespace(fleet=records), clock=clock)  # type: ignore[arg-type]
    await w.read_once()
    assert w.freshness(["new"])["new"].state == "unknown"
    await w.catch_up(["new"])
    assert records.reads == 2 and w.freshness(["new"])["new"].state == "current"
    await w.catch_up(["new"])  # listed now: no read
    assert records.reads == 2
    for _ in range(5):  # a pod nobody vouches for: one read, then none for a quarter second
        await w.catch_up(["ghost"])
    assert records.reads == 2  # the last forced read was just now
    clock.t += REREAD_MIN_S
    for _ in range(5):
        await w.catch_up(["ghost"])
    assert records.reads == 3 and w.freshness(["ghost"])["ghost"].state == "unknown"
