"""Fleet membership with real processes: simulated engines (``kv-preflight simulate``), several real
``kv-preflight ingest`` processes sharing them through leases in a real valkey-server, a real predictor.

Engines are discovered from a file and from DNS (the hosts file: glibc reads it on every lookup, so a
test can add and remove A records for a name of its own), split among ingesters by rendezvous hashing,
taken over after a kill -9 within the lease TTL, and retired when they leave or stay unreachable."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import uuid

import httpx
import pytest

from kv_preflight.cli.accuracy import run_workload, shared_prefix_workload
from kv_preflight.cli.valkey_server import free_port
from kv_preflight.ingester.membership_rules import rendezvous_owners
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine
from tests.integration.test_fault_accuracy import blind, exact
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

FAST = ["--lease-ttl", "3", "--membership-hold", "1", "--health-failures", "2"]
FAST_ENV = {"KVPF_DISCOVERY_INTERVAL_S": "0.5"}




def write_engines(path, engines) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump([{"url": e.url, "pod": e.pod} for e in engines], f)
    os.replace(tmp, path)  # atomically, as a ConfigMap update is


async def owners(ix: Index) -> dict[str, list[str]]:
    """engine URL -> live ingesters ingesting it."""
    view = await ix.fleet.fleet_view()
    out: dict[str, list[str]] = {}
    for ingester, lease in view.live_ingesters().items():
        for url in lease.engines:
            out.setdefault(url, []).append(ingester)
    return out


async def test_fleet_records_load_and_lease(valkey_url, tmp_path):
    """One ingester with --engine: the pod's record (engine URL, models, block size, owner), its load
    scraped into kvpf:load, and the ingester's lease, which `index ingesters` lists."""
    engine = sim_engine("sim-rec", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, "--ingester-id", "ing-1"],
                str(tmp_path / "ing.log"))
    ix = Index.from_url(valkey_url)
    try:
        httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": list(range(40)), "max_tokens": 1},
                   timeout=10).raise_for_status()

        async def record():
            rec = (await ix.fleet.fleet_view()).pods.get("sim-rec")
            return rec if rec is not None and rec.block_size else None

        rec = await until(record, "the pod's fleet record")
        assert (rec.state, rec.engine_url, rec.models, rec.block_size, rec.owner) == \
            ("live", engine.url, ["sim"], 16, "ing-1")
        view = await until(lambda: _with_load(ix, "sim-rec"), "the pod's load")
        assert view.load_age_s("sim-rec") < 5
        out = spawn(["index", "ingesters", "--valkey-url", valkey_url, "--json"], str(tmp_path / "cli.log"))
        assert out.wait(30) == 0
        rows = json.loads(open(tmp_path / "cli.log").read())
        assert [(r["ingester"], r["live"], r["engines"]) for r in rows] == [("ing-1", True, [engine.url])]
        out = spawn(["index", "pods", "--valkey-url", valkey_url, "--json"], str(tmp_path / "pods.log"))
        assert out.wait(30) == 0
        rows = json.loads(open(tmp_path / "pods.log").read())
        assert rows[0]["fleet"]["state"] == "live" and rows[0]["fleet"]["engine_url"] == engine.url
        stop(ing)  # a clean stop gives the lease back at once
        assert not (await ix.fleet.fleet_view()).ingesters
    finally:
        stop(ing)
        engine.stop()
        await ix.close()


async def test_a_pods_load_row_is_stamped_with_its_scrapes_time(valkey_url, tmp_path):
    """A pod's load row (kvpf:load) says when its engine was scraped, not when the round that wrote it ran: the
    probe started in one round is read in the next, about a chores period (1 s) later, and gateways discount a
    scrape by the requests that ended since it (predictor/routed.py), so a row a round younger than its scrape made
    them count ended requests as running. Each new row, seen within 50 ms of being written, is already about a round
    old (a row stamped at its write is seen a few ms old)."""
    engine = sim_engine("sim-age", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, "--ingester-id", "ing-age"],
                str(tmp_path / "ing.log"))
    ix = Index.from_url(valkey_url)
    try:
        await until(lambda: _with_load(ix, "sim-age"), "the pod's load")
        ages, last = [], None
        while len(ages) < 4:
            view = await ix.fleet.fleet_view()
            at = view.load["sim-age"].at_ms
            if last is not None and at != last:
                ages.append(view.now_ms - at)  # a new row, read within a poll of its write
            last = at
            await asyncio.sleep(0.05)
        assert min(ages) >= 500, ages
    finally:
        stop(ing)
        engine.stop()
        await ix.close()


async def _with_load(ix: Index, pod: str):
    view = await ix.fleet.fleet_view()
    return view if pod in view.load else None


@pytest.mark.serial(reason="8 engines, 3 ingesters and a predictor: the heaviest test, and its takeover and retirement waits assume the machine is its own")
async def test_three_ingesters_share_eight_engines_and_take_over_after_kill9(valkey_url, tmp_path):
    engines = [sim_engine(f"sim-{i}", tmp_path).start() for i in range(8)]
    listing = tmp_path / "engines.json"
    write_engines(listing, engines)
    args = ["ingest", "--valkey-url", valkey_url, "--engines-from", f"file://{listing}", "--copies", "1", *FAST]
    ings = {name: spawn([*args, "--ingester-id", name], str(tmp_path / f"{name}.log"), env=FAST_ENV)
            for name in ("ing-a", "ing-b", "ing-c")}
    port = free_port()
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--engine-url", f"sim={engines[0].url}"],
                 str(tmp_path / "pred.log"))
    predictor = f"http://127.0.0.1:{port}"
    ix = Index.from_url(valkey_url)
    urls = sorted(e.url for e in engines)
    try:
        wait_http(predictor + "/health")

        async def split_once():
            got = await owners(ix)
            return got if sorted(got) == urls and all(len(o) == 1 for o in got.values()) \
                and len({o[0] for o in got.values()}) == 3 else None

        split = await until(split_once, "each engine ingested by exactly one of the 3 ingesters")
        work = shared_prefix_workload(n=12, seed=5, block=16)
        for e in engines:
            exact(run_workload(e.url, predictor, "sim", work[:4]))

        victim = split[engines[0].url][0]
        orphans = [e for e in engines if split[e.url] == [victim]]
        stop(ings[victim], kill=True)
        for e in orphans:  # cached while nobody ingests them: found again only by replay
            blind(e.url, work[4:8])

        async def taken_over():
            got = await owners(ix)
            return got if all(got.get(e.url) and victim not in got[e.url] for e in orphans) else None

        await until(taken_over, f"{victim}'s engines taken over", timeout=15)
        for e in engines:
            exact(run_workload(e.url, predictor, "sim", work[8:12]))

        # Two engines leave the listing: retired (entries cleared, record kept with the reason).
        gone, kept = engines[6:], engines[:6]
        write_engines(listing, kept)

        async def retired():
            # the record says retired first (a compare-and-set: a new engine may have taken the pod id), then
            # the entries are cleared
            view = await ix.fleet.fleet_view()
            states = {p: (view.pods[p].state, (await ix.meta.pod_info(p)).blocks)
                      for p in (e.pod for e in gone) if p in view.pods}
            return states if states == {e.pod: ("retired", 0) for e in gone} else None

        await until(retired, "the departed engines' pods retired and their entries cleared")
        view = await ix.fleet.fleet_view()
        for e in gone:
            assert "left discovery" in view.pods[e.pod].reason

        async def let_go():
            return sorted(await owners(ix)) == sorted(e.url for e in kept)

        await until(let_go, "the departed engines let go")
        # One comes back: ingested again, its pod live.
        write_engines(listing, [*kept, gone[0]])

        async def back():
            rec = (await ix.fleet.fleet_view()).pods.get(gone[0].pod)
            return rec if rec is not None and rec.state == "live" else None

        await until(back, "the returning engine's pod live again")

        async def predictor_sees_it():  # the predictor reads the fleet records about every second
            stats = httpx.get(predictor + "/stats", timeout=5).json()
            return (stats.get("fleet") or {}).get("pods", {}).get(gone[0].pod, {}).get("state") == "live"

        await until(predictor_sees_it, "the predictor to see the returning pod live")

        async def rebuilt():  # live at once; its entries back once the replay fetched in the background is applied
            return any(f"{gone[0].pod}: rebuilt whole" in (tmp_path / f"{name}.log").read_text() for name in ings)

        await until(rebuilt, "the returning engine's pod rebuilt from its replay buffer (its ingester says so)")
        exact(run_workload(gone[0].url, predictor, "sim", work[:4]))
    finally:
        for p in ings.values():
            stop(p)
        stop(pred)
        for e in engines:
            e.stop()
        await ix.close()


def ids_plain_rendezvous_leaves_idle(urls: list[str]) -> list[str]:
    """Three ingester ids among which plain rendezvous hashing (the split before bounded loads) gives one
    no engine of ``urls`` (an idle ingester that looks stalled), found by trying id suffixes (pure hashing,
    no I/O)."""
    for n in range(10_000):
        ids = [f"ing-{n}-{c}" for c in "abc"]
        if len({rendezvous_owners(u, ids, 1)[0] for u in urls}) < 3:
            return ids
    raise AssertionError("no such ids")  # pragma: no cover


async def test_every_ingester_gets_a_share_where_plain_rendezvous_leaves_one_idle(valkey_url, tmp_path):
    """3 ingesters, 4 engines, --copies 1, with ingester ids for which plain rendezvous hashing gives one
    ingester nothing: each of the 3 ingests at least one engine (2/1/1), each engine exactly one."""
    engines = [sim_engine(f"sim-{i}", tmp_path).start() for i in range(4)]
    listing = tmp_path / "engines.json"
    write_engines(listing, engines)
    ids = ids_plain_rendezvous_leaves_idle([e.url for e in engines])
    args = ["ingest", "--valkey-url", valkey_url, "--engines-from", f"file://{listing}", "--copies", "1", *FAST]
    ings = [spawn([*args, "--ingester-id", i], str(tmp_path / f"{i}.log"), env=FAST_ENV) for i in ids]
    ix = Index.from_url(valkey_url)
    try:
        async def shared_by_all():
            got = await owners(ix)
            return got if len(got) == 4 and all(len(o) == 1 for o in got.values()) \
                and {o[0] for o in got.values()} == set(ids) else None

        got = await until(shared_by_all, "each of the 3 ingesters ingesting a share of the 4 engines")
        assert sorted(collections.Counter(o[0] for o in got.values()).values()) == [1, 1, 2]
        # the idle-looking one said why, in its log: its share
        assert all("share: " in open(tmp_path / f"{i}.log").read() for i in ids)
    finally:
        for p in ings:
            stop(p)
        for e in engines:
            e.stop()
        await ix.close()


async def test_unreachable_pod_is_retired_then_returns(valkey_url, tmp_path):
    engine = sim_engine("sim-down", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, *FAST, "--retire-after", "3"],
                str(tmp_path / "ing.log"), env=FAST_ENV)
    ix = Index.from_url(valkey_url)
    try:
        blind(engine.url, shared_prefix_workload(n=3, seed=2, block=16))

        async def state(want):
            rec = (await ix.fleet.fleet_view()).pods.get("sim-down")
            return rec if rec is not None and rec.state == want else None

        await until(lambda: state("live"), "live")
        await until(lambda: _blocks(ix, "sim-down"), "entries")
        engine.stop(kill=True)
        rec = await until(lambda: state("unreachable"), "unreachable after 2 failed health checks")
        assert "2 times" in rec.reason
        rec = await until(lambda: state("retired"), "retired after --retire-after")
        assert "unreachable for" in rec.reason

        async def cleared():  # after the record (the record is a compare-and-set, then the entries go)
            return (await ix.meta.pod_info("sim-down")).blocks == 0

        await until(cleared, "the retired pod's entries cleared")
        engine.start()  # a new process: seq from 0, an empty cache
        await until(lambda: state("live"), "live again")
        blind(engine.url, shared_prefix_workload(n=2, seed=3, block=16))
        await until(lambda: _blocks(ix, "sim-down"), "entries again")
        assert not (await ix.meta.pod_info("sim-down")).incomplete  # the restart reset it: exact again
    finally:
        stop(ing)
        engine.stop()
        await ix.close()


async def test_a_pod_taken_over_whose_state_log_does_not_read_is_flagged_and_its_engine_ingested(valkey_url, tmp_path):
    """A pod last served by an engine that left, now published by another (a restarted stack naming its engines as
    before): it is reset as the new engine starts it, which loads its state log. With junk in that log (a hand
    edit, a bug, a build that writes another format) PodLogError left the membership round and ended the process.
    Now the pod is not reset (its old entries cannot be found to clear): logged, counted, flagged with the reason;
    its new engine is ingested (its record names it) and the other engines go on."""
    from kv_preflight.fleet.records import PodRecord
    from kv_preflight.index.layout import pod_state_key

    ix = Index.from_url(valkey_url)
    moved, other = sim_engine("sim-moved", tmp_path).start(), sim_engine("sim-other", tmp_path).start()
    # the pod as the engine that left wrote it (an address no ingester knows), its log junk
    await ix.fleet.put_pod_records({"sim-moved": PodRecord(state="live", since_ms=1, engine_url="http://127.0.0.1:9",
                                                           owner="gone")})
    await ix.client.hset(pod_state_key("sim-moved"), "s", b"\xc1junk")
    log = tmp_path / "ing.log"
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", moved.url, "--engine", other.url, *FAST], str(log),
                env=FAST_ENV)
    try:
        async def flagged():
            assert ing.poll() is None, "the ingester died: " + log.read_text()[-2000:]
            info = await ix.meta.pod_info("sim-moved")
            return info if "state log does not read" in info.incomplete_reason else None

        await until(flagged, "sim-moved flagged")

        async def record():
            rec = (await ix.fleet.fleet_view()).pods.get("sim-moved")
            return rec if rec is not None and rec.engine_url == moved.url else None

        await until(record, "sim-moved's record naming its new engine")
        blind(other.url, shared_prefix_workload(n=2, seed=4, block=16))
        await until(lambda: _blocks(ix, "sim-other"), "the other engine's entries")
        assert (await ix.meta.counters()).get("apply_errors", 0) >= 1
        text = log.read_text()
        assert text.count("sim-moved: taken over") == 1 and "Traceback" not in text  # once: no retry loop
        assert ing.poll() is None
    finally:
        stop(ing)
        moved.stop()
        other.stop()
        await ix.close()


async def _blocks(ix: Index, pod: str) -> int:
    return (await ix.meta.pod_info(pod)).blocks


async def _cleared(ix: Index, pod: str) -> bool:
    return await _blocks(ix, pod) == 0


HOSTS = "/etc/hosts"


@pytest.mark.skipif(not os.access(HOSTS, os.W_OK), reason="needs a writable /etc/hosts to publish DNS records")
async def test_dns_discovery_names_pods_by_address(valkey_url, tmp_path):
    """Two engines behind one DNS name (as a headless Service): both ingested, each pod named by its
    address HOST:PORT although both publish the same topic; one record removed: its pod retired."""
    name = f"kvpf-{uuid.uuid4().hex[:8]}.test"
    port = free_port()
    engines = [sim_engine("same-topic", tmp_path, host=f"127.0.0.{i}", port=port) for i in (2, 3)]
    for i, e in enumerate(engines):
        e.log = str(tmp_path / f"dns-{i}.log")
        e.start()
    original = open(HOSTS).read()

    def publish(addresses):
        lines = "".join(f"{a} {name}\n" for a in addresses)
        with open(HOSTS, "w") as f:
            f.write(original.rstrip("\n") + "\n" + lines)

    publish(["127.0.0.2", "127.0.0.3"])
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engines-from", f"dns://{name}:{port}", *FAST],
                str(tmp_path / "ing.log"), env=FAST_ENV)
    ix = Index.from_url(valkey_url)
    pods = [f"127.0.0.2:{port}", f"127.0.0.3:{port}"]
    try:
        async def both_live():
            view = await ix.fleet.fleet_view()
            return all(p in view.pods and view.pods[p].state == "live" for p in pods) or None

        await until(both_live, "both engines' pods live, named by address")
        blind(engines[0].url, shared_prefix_workload(n=2, seed=4, block=16))
        await until(lambda: _blocks(ix, pods[0]), "entries of the first engine under its address")
        assert await _blocks(ix, pods[1]) == 0 and "same-topic" not in await ix.meta.pod_ids()
        publish(["127.0.0.3"])

        async def first_retired():
            rec = (await ix.fleet.fleet_view()).pods.get(pods[0])
            return rec if rec is not None and rec.state == "retired" else None

        rec = await until(first_retired, "the removed address's pod retired")
        assert "left discovery" in rec.reason
        # The record turns retired first (predictors stop counting the pod), then its entries are cleared.
        await until(lambda: _cleared(ix, pods[0]), "the retired pod's entries cleared")
    finally:
        with open(HOSTS, "w") as f:
            f.write(original)
        stop(ing)
        for e in engines:
            e.stop()
        await ix.close()


async def test_an_ingester_with_other_settings_refuses_to_write(valkey_url, tmp_path):
    """Request keys hashed with another seed would never be found by this index's readers."""
    ix = Index.from_url(valkey_url)
    try:
        first = spawn(["ingest", "--valkey-url", valkey_url, "--source", "tcp://127.0.0.1:1", "--hash-seed", "42"],
                      str(tmp_path / "first.log"))
        await until(lambda: ix.fleet.settings(), "the first writer's settings")
        stop(first)
        assert (await ix.fleet.settings()).hash_seed == "42"
        other = spawn(["ingest", "--valkey-url", valkey_url, "--source", "tcp://127.0.0.1:1", "--block-size", "32",
                       "--hash-seed", "42"], str(tmp_path / "other.log"))
        assert other.wait(30) == 1
        out = open(tmp_path / "other.log").read()
        assert "other settings" in out and "block_size: 32 != 16" in out and "Traceback" not in out
    finally:
        await ix.close()


async def test_retired_pods_are_forgotten_after_retention(valkey_url, tmp_path):
    engine = sim_engine("sim-gone", tmp_path).start()
    listing = tmp_path / "engines.json"
    write_engines(listing, [engine])
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engines-from", f"file://{listing}", *FAST,
                 "--retired-retention", "2"], str(tmp_path / "ing.log"), env=FAST_ENV)
    ix = Index.from_url(valkey_url)
    try:
        blind(engine.url, shared_prefix_workload(n=2, seed=6, block=16))
        await until(lambda: _blocks(ix, "sim-gone"), "entries")
        write_engines(listing, [])

        async def state():
            rec = (await ix.fleet.fleet_view()).pods.get("sim-gone")
            return rec.state if rec else "dropped"

        await until(lambda: _is(state, "retired"), "retired")
        assert "sim-gone" in await ix.meta.pod_ids()  # kept, with the reason, during the retention
        await until(lambda: _is(state, "dropped"), "dropped after the retention")
        assert "sim-gone" not in await ix.meta.pod_ids()
    finally:
        stop(ing)
        engine.stop()
        await ix.close()


async def test_a_retired_pod_whose_state_log_does_not_read_is_flagged_kept_and_not_refused(valkey_url, tmp_path):
    """Two engines leave discovery; one pod's state log holds junk (a hand edit, a bug, a build that writes another
    format). Its retirement asked every ingester to let it go, then failed to clear it ("leaving the index failed",
    uncounted), leaving it refused by every ingester (``kvpf:forget``) and flagged only "retired"; at its
    retention's end the drop failed again every round. Now its log is read before anything is let go: the pod is
    flagged with the reason, logged and counted, not refused; at the retention's end it is kept (its number still
    names it in the entries its log no longer lists), said once. The other pod is cleared and dropped as ever."""
    from kv_preflight.index.layout import FORGET_KEY, pod_state_key

    junk, fine = sim_engine("sim-junk", tmp_path).start(), sim_engine("sim-fine", tmp_path).start()
    listing = tmp_path / "engines.json"
    write_engines(listing, [junk, fine])
    log = tmp_path / "ing.log"
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engines-from", f"file://{listing}", *FAST,
                 "--retired-retention", "2"], str(log), env=FAST_ENV)
    ix = Index.from_url(valkey_url)
    try:
        for engine in (junk, fine):
            blind(engine.url, shared_prefix_workload(n=2, seed=7, block=16))
            await until(lambda: _blocks(ix, engine.pod), f"{engine.pod}'s entries")
        await ix.client.hset(pod_state_key("sim-junk"), "s", b"\xc1junk")
        write_engines(listing, [])

        async def dropped():
            assert ing.poll() is None, "the ingester died: " + log.read_text()[-2000:]
            return "sim-fine" not in await ix.meta.pod_ids() and "retention over" in log.read_text()

        await until(dropped, "sim-fine dropped, sim-junk's retention over")
        info = await ix.meta.pod_info("sim-junk")
        assert info.incomplete and "state log does not read" in info.incomplete_reason, info
        assert info.blocks > 0 and "sim-junk" in await ix.meta.pod_ids()  # kept, its entries left
        assert (await ix.fleet.fleet_view()).pods["sim-junk"].state == "retired"
        assert not await ix.client.hexists(FORGET_KEY, "sim-junk")  # not refused: a return is ingested
        assert (await ix.meta.counters()).get("apply_errors", 0) >= 2
        await asyncio.sleep(3)  # rounds go by: the drop is not tried again
        text = log.read_text()
        assert text.count("sim-junk: retention over") == 1 and "Traceback" not in text, text[-2000:]
        assert "leaving the index failed" not in text
    finally:
        stop(ing)
        junk.stop()
        fine.stop()
        await ix.close()


async def _is(fn, want) -> bool:
    return await fn() == want


@pytest.mark.parametrize("flag, value, found", [("--pod-id", "endpoint", "pod_id: 'endpoint' != 'topic'"),
                                                ("--kv-cache-report-mode", "full",
                                                 "kv_cache_report_mode: 'full' != 'incremental'")])
async def test_an_ingester_that_would_name_or_read_pods_otherwise_refuses_to_write(valkey_url, tmp_path, flag, value,
                                                                                    found):
    """--pod-id and --kv-cache-report-mode are the index's too (kvpf:settings): a one-off ingester started with
    --pod-id endpoint beside a fleet that names pods by topic ingested a fleet engine again under its address (a
    ghost pod holding the engine's blocks, never evicted); two report modes read one engine's parentless runs two
    ways. The second writer is refused with the flag to give, before it subscribes to anything."""
    engine = sim_engine("sim-set", tmp_path).start()
    ix = Index.from_url(valkey_url)
    procs = []
    try:
        fleet = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, *FAST], str(tmp_path / "fleet.log"),
                      env=FAST_ENV)
        procs.append(fleet)
        await until(lambda: ix.fleet.settings(), "the fleet's settings")
        one_off = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, flag, value, *FAST],
                        str(tmp_path / "one_off.log"), env=FAST_ENV)
        procs.append(one_off)
        assert one_off.wait(30) == 1
        out = open(tmp_path / "one_off.log").read()
        assert "other settings" in out and found in out and f"({flag})" in out and "Traceback" not in out
        assert set(await ix.meta.pod_ids()) <= {"sim-set"}  # no pod under the engine's address
        assert fleet.poll() is None
    finally:
        for p in procs:
            stop(p)
        engine.stop()
        await ix.close()
