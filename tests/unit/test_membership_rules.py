"""Fleet membership rules (ingester/membership_rules.py, ingester/engines_from.py): pure, no I/O."""
from __future__ import annotations

import collections

import pytest

from kv_preflight.ingester.engines_from import parse_engine_list, parse_engines_from
from kv_preflight.ingester.membership_rules import (Debounced, EngineSpec, Health, address_pod_id, after_check,
                                                    balanced_owners, expired_retired, rendezvous_owners, unlisted)
from kv_preflight.fleet.records import PodRecord

ENGINES = [f"http://10.0.0.{i}:8000" for i in range(200)]


def test_rendezvous_spreads_and_is_the_same_for_everyone():
    members = ["a", "b", "c"]
    owners = {e: rendezvous_owners(e, members, 1)[0] for e in ENGINES}
    counts = collections.Counter(owners.values())
    assert set(counts) == set(members) and min(counts.values()) > 40  # ~67 each
    assert owners == {e: rendezvous_owners(e, list(reversed(members)), 1)[0] for e in ENGINES}  # order-free


def test_adding_an_ingester_moves_only_its_share():
    before = {e: rendezvous_owners(e, ["a", "b", "c"], 1)[0] for e in ENGINES}
    after = {e: rendezvous_owners(e, ["a", "b", "c", "d"], 1)[0] for e in ENGINES}
    moved = [e for e in ENGINES if before[e] != after[e]]
    assert all(after[e] == "d" for e in moved) and 25 < len(moved) < 80  # ~1/4, all to the newcomer


def test_removing_an_ingester_moves_only_its_engines():
    before = {e: rendezvous_owners(e, ["a", "b", "c"], 2) for e in ENGINES}
    after = {e: rendezvous_owners(e, ["a", "c"], 2) for e in ENGINES}
    for e in ENGINES:
        kept = [m for m in before[e] if m != "b"]
        assert after[e][:len(kept)] == kept or set(kept) <= set(after[e])
        if "b" not in before[e]:
            assert after[e] == before[e]


def test_copies_never_exceed_the_members():
    assert rendezvous_owners("x", ["a"], 2) == ["a"]
    assert len(rendezvous_owners("x", ["a", "b", "c"], 2)) == 2


def _loads(owners: dict[str, list[str]]) -> collections.Counter:
    return collections.Counter(m for o in owners.values() for m in o)


def test_plain_rendezvous_can_leave_an_ingester_idle_balanced_never_does():
    """Issue 10's "stalled" ingester: 8 engines on random ports, 3 ingesters, --copies 1. Plain rendezvous
    hashing gave one ingester no engine in ~11% of fleets; the bounded split gives each 2 or 3."""
    members = ["ing-a", "ing-b", "ing-c"]
    fleets = [[f"http://127.0.0.1:{30000 + (7919 * f + 104729 * i) % 30000}" for i in range(8)] for f in range(300)]
    idle = [urls for urls in fleets if len({rendezvous_owners(u, members, 1)[0] for u in urls}) < 3]
    assert len(idle) > 10  # the old split: about 1 fleet in 9
    for urls in fleets:
        assert sorted(_loads(balanced_owners(urls, members, 1)).values()) == [2, 3, 3]


@pytest.mark.parametrize("copies", [1, 2, 3])
@pytest.mark.parametrize("n_engines,n_members", [(0, 2), (1, 3), (2, 3), (4, 3), (8, 3), (13, 5), (200, 4)])
def test_balanced_split_is_floor_or_ceil_and_the_same_for_everyone(n_engines, n_members, copies):
    engines = ENGINES[:n_engines]
    members = [f"ing-{i}" for i in range(n_members)]
    owners = balanced_owners(engines, members, copies)
    want = min(copies, n_members)
    assert sorted(owners) == sorted(engines)
    assert all(len(o) == want == len(set(o)) for o in owners.values())
    loads = [_loads(owners)[m] for m in members]
    assert max(loads) - min(loads) <= 1 and sum(loads) == n_engines * want
    assert owners == balanced_owners(list(reversed(engines)), list(reversed(members)), copies)  # order-free
    for e, o in owners.items():  # best first: the primary is the best-ranked of its owners
        ranking = rendezvous_owners(e, members, n_members)
        assert o == sorted(o, key=ranking.index)


def test_balanced_split_moves_about_a_share_when_an_ingester_joins_or_leaves():
    before = balanced_owners(ENGINES, ["a", "b", "c"], 1)
    after = balanced_owners(ENGINES, ["a", "b", "c", "d"], 1)
    moved = [e for e in ENGINES if before[e] != after[e]]
    assert sum(o == ["d"] for o in after.values()) == 50
    assert 50 <= len(moved) <= 70  # the newcomer's 50, and a few whose first choice filled up
    gone = balanced_owners(ENGINES, ["a", "c"], 1)
    held_by_b = [e for e in ENGINES if before[e] == ["b"]]
    changed = [e for e in ENGINES if before[e] != gone[e]]
    assert set(held_by_b) <= set(changed) and len(changed) <= len(held_by_b) + 10


def test_a_change_counts_only_once_it_held():
    d = Debounced(hold_s=3.0)
    assert d.observe({"a", "b"}, 0.0) == {"a", "b"}  # the first answer at once
    assert d.observe({"a"}, 1.0) == {"a", "b"}  # b missing once: not yet
    assert d.observe({"a", "b"}, 2.0) == {"a", "b"}  # back: the clock restarts
    assert d.observe({"a"}, 3.0) == {"a", "b"}
    assert d.observe({"a"}, 5.9) == {"a", "b"}
    assert d.observe({"a"}, 6.0) == {"a"}  # held 3 s: b left
    assert d.observe({"a", "c"}, 7.0) == {"a"} and d.pending() == {"c"}
    assert d.observe({"a", "c"}, 10.0) == {"a", "c"}


def test_address_pod_ids():
    assert address_pod_id("http://10.1.2.3:8000") == "10.1.2.3:8000"
    assert address_pod_id("http://[fd00::1]:8000") == "[fd00::1]:8000"
    assert address_pod_id("https://engine.local") == "engine.local:443"


def test_engines_from_specs():
    assert parse_engines_from("dns://vllm.ns.svc.cluster.local:8000").name == "vllm.ns.svc.cluster.local"
    assert parse_engines_from("file:///etc/engines.json").path == "/etc/engines.json"
    assert parse_engines_from("file://engines.txt").path == "engines.txt"
    for bad in ("dns://name", "dns://:80", "http://x", "file://"):
        with pytest.raises(ValueError):
            parse_engines_from(bad)


def test_engine_files_json_and_lines():
    js = '["http://a:1", {"url": "http://b:2/", "pod": "pod-b"}]'
    assert parse_engine_list(js, "f") == [EngineSpec("http://a:1", "a:1", "f"), EngineSpec("http://b:2", "pod-b", "f")]
    lines = "# engines\nhttp://a:1\n\n  http://c:3  # third\n"
    assert [s.url for s in parse_engine_list(lines, "f")] == ["http://a:1", "http://c:3"]
    for bad in ('["a"]', '[{"pod": "x"}]', "ftp://x", '[{"url": "http://a:1", "pod": 3}]', "[1, "):
        with pytest.raises(ValueError):
            parse_engine_list(bad, "f")


def test_health_live_unreachable_retired_and_back():
    rec, h = PodRecord(since_ms=0), Health()
    rec, h = after_check(rec, h, False, 1000, failures_needed=3, retire_after_ms=60_000)
    rec, h = after_check(rec, h, False, 2000, failures_needed=3, retire_after_ms=60_000)
    assert rec.state == "live" and rec.unreachable_since_ms == 1000
    rec, h = after_check(rec, h, False, 3000, failures_needed=3, retire_after_ms=60_000, detail="refused")
    assert rec.state == "unreachable" and "3 times" in rec.reason and "refused" in rec.reason
    back, h2 = after_check(rec, h, True, 4000, failures_needed=3, retire_after_ms=60_000)
    assert back.state == "live" and back.unreachable_since_ms == 0 and h2.failures == 0
    rec, h = after_check(rec, h, False, 61_000, failures_needed=3, retire_after_ms=60_000)
    assert rec.state == "retired" and "unreachable for 60 s" in rec.reason and rec.since_ms == 61_000
    assert after_check(rec, h, True, 62_000, failures_needed=3, retire_after_ms=60_000)[0].state == "retired"


def test_one_failure_between_successes_is_not_unreachable():
    rec, h = PodRecord(), Health()
    for t, ok in enumerate([False, False, True, False, False, True]):
        rec, h = after_check(rec, h, ok, t * 1000, failures_needed=3, retire_after_ms=10)
    assert rec.state == "live"


def test_retired_rows_are_dropped_after_retention():
    recs = {"old": PodRecord(state="retired", since_ms=0), "new": PodRecord(state="retired", since_ms=9000),
            "live": PodRecord(state="live", since_ms=0)}
    assert expired_retired(recs, 10_000, 5000) == ["old"]


def test_a_recorded_pod_no_lease_lists_is_retired_after_the_retirement_time():
    """Issue 40 item 7: a one-off ``ingest --pod-id endpoint`` run left its pods in the index, listed by no lease
    (its ingester gone), for good. Each is retired once unlisted for ``retire_after_ms``; listed again, it starts
    over; retired ones and listed ones are not counted."""
    records = {"ghost": PodRecord(), "live": PodRecord(), "old": PodRecord(state="retired")}
    since, due = unlisted(records, {"live"}, {}, 1_000, 60_000)
    assert (since, due) == ({"ghost": 1_000}, [])
    since, due = unlisted(records, {"live"}, since, 60_999, 60_000)
    assert due == []
    since, due = unlisted(records, {"live"}, since, 61_000, 60_000)
    assert due == ["ghost"]
    assert unlisted(records, {"live", "ghost"}, since, 70_000, 60_000) == ({}, [])
