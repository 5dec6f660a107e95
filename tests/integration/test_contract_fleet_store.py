"""The fleet store's contract (kv_preflight/index/fleet_store.py), on a single node and on a Valkey Cluster: what
ingesters write and predictors read of the fleet, on Valkey's clock, whichever backend connect chose."""
from __future__ import annotations

import pytest

from kv_preflight.fleet.records import IndexSettings, IngesterLease, PodLoad, PodRecord, RegisteredEngine
from kv_preflight.index.fleet_store import FleetStore
from tests.integration.contract import conforms, index  # noqa: F401 (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_it_has_every_member_of_the_fleet_store(index):
    assert conforms(index.fleet, FleetStore) == []


async def test_leases_records_and_load_come_back_in_one_view_on_valkeys_clock(index):
    store = index.fleet
    now = await store.now_ms()
    await store.put_lease("ing-1", IngesterLease(expires_ms=now + 10_000, engines=["http://e:8000"]))
    await store.put_lease("ing-2", IngesterLease(expires_ms=now - 1))
    await store.put_pod_records({"pod-a": PodRecord(engine_url="http://e:8000", models=["m"], block_size=16),
                                 "pod-b": PodRecord(state="retired", reason="left")})
    await store.put_load({"pod-a": PodLoad(running=2, waiting=1, kv_usage=0.5, at_ms=now)})
    view = await store.fleet_view()
    assert now <= view.now_ms < now + 60_000
    assert set(view.ingesters) == {"ing-1", "ing-2"} and set(view.live_ingesters()) == {"ing-1"}
    assert view.ingesters["ing-1"].engines == ["http://e:8000"]
    assert view.pods["pod-a"].models == ["m"] and view.pods["pod-b"].state == "retired"
    assert view.load["pod-a"].running == 2 and view.offered() == {"pod-a"}
    await store.drop_leases(["ing-2"])
    await store.drop_pod_records(["pod-b"])
    view = await store.fleet_view()
    assert set(view.ingesters) == {"ing-1"} and set(view.pods) == {"pod-a"}


async def test_a_record_is_replaced_only_if_it_is_still_what_the_writer_read(index):
    store = index.fleet
    first, second = PodRecord(reason="one"), PodRecord(reason="two")
    assert await store.replace_pod_record("pod-a", None, first)
    assert not await store.replace_pod_record("pod-a", None, second), "someone wrote it meanwhile"
    assert await store.replace_pod_record("pod-a", first, second)
    assert (await store.fleet_view()).pods["pod-a"].reason == "two"


async def test_settings_and_the_epoch_go_to_the_first_writer(index):
    store = index.fleet
    assert await store.settings() is None
    ours = IndexSettings(hash_seed="1", block_size=16)
    assert await store.claim_settings(ours) == ours
    assert await store.claim_settings(IndexSettings(hash_seed="2", block_size=32)) == ours
    assert await store.epoch() is None
    assert await store.claim_epoch("e1") == "e1"
    assert await store.claim_epoch("e2") == "e1"
    assert await store.replace_epoch("e0", "e3") == "e1", "only from the epoch the writer saw"
    assert await store.replace_epoch("e1", "e3") == "e3"
    await store.mark_shards("e3")
    looked = await store.look_at_shards("e3")
    assert looked.lost == [] and looked.rewritten == [] and not looked.numbering


async def test_forgets_aliases_feeds_engines_and_the_diagnosis(index):
    store = index.fleet
    asked = await store.forget_pods(["pod-a", "pod-b"])
    assert await store.forgotten() == {"pod-a": asked, "pod-b": asked}
    await store.unforget_pods(["pod-a"])
    assert set(await store.forgotten()) == {"pod-b"}
    await store.add_aliases([("pod-a", "10.0.0.1:5557")])
    aliases = await store.aliases()
    assert aliases["pod-a"] == ["10.0.0.1:5557"] and aliases["10.0.0.1:5557"] == ["pod-a"]
    await store.remember_feed("tcp://e:5558", 0, "pod-a", "m")
    assert await store.feeds(["tcp://e:5558", "tcp://other:1"]) == [("tcp://e:5558", 0, "pod-a", "m")]
    await store.register_engine("eng-1", RegisteredEngine(url="http://e:8000"))
    assert (await store.registered_engines())["eng-1"].url == "http://e:8000"
    assert await store.unregister_engine("eng-1") and await store.registered_engines() == {}
    at = await store.put_fleet_diagnosis(b"all well")
    summary, stored_at, now = await store.fleet_diagnosis()
    assert summary == b"all well" and stored_at == at <= now
    policy = await store.maxmemory_policy()
    assert policy is None or (isinstance(policy, str) and policy), "Valkey's policy, or None where CONFIG is refused"
