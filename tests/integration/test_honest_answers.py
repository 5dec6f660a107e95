"""Answers that say ``exact`` are exact (issue 40, the predictor's side), with real processes: a valkey-server (or a
local Valkey Cluster), simulated engines (``kv-preflight simulate``: vLLM 0.32's cache and events), ingesters and
a ``kv-preflight serve``. Each fault leaves the index holding what the engine does not (a stopped engine, a
frozen ingester, a ghost pod, the leases' shard down while the ingester dies); the answer must say so.

1. a dead engine (SIGTERM): its pod reads ``unreachable`` once its fleet record does, is never the best pod, and
   an answer naming it as a holder is degraded; /health is degraded once a model has no live pod;
2. a frozen sole ingester (SIGSTOP): ``behind`` once its lease missed two renewals, whatever the lease's TTL;
3. a ghost pod (a one-off ``ingest --pod-id endpoint`` gone): ``unknown``, degrading the answers that hold it,
   never routed to by overlap, and retired after ``--retire-after`` like any pod nobody ingests;
4. (cluster) the shard holding ``kvpf:ingesters`` down with its replica while the ingester dies: every answer
   says the fleet's records could not be read.
"""
from __future__ import annotations

import os
import random
import signal

import httpx
import pytest
import redis

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from kv_preflight.index.layout import INGESTERS_KEY, NUMS_BYID_KEY, pod_meta_key
from kv_preflight.ingester.membership_rules import address_pod_id
from kv_preflight.keys.chain import request_keys
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import SimEngine, sim_engine
from tests.integration.test_fleet import FAST, FAST_ENV
from tests.integration.truth import engine_truth, index_state
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

BLOCK = 16


def prompt_of(seed: int, blocks: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 8000) for _ in range(BLOCK * blocks + 3)]


class Predictor:
    """A ``kv-preflight serve`` process and the few calls the tests make of it."""

    def __init__(self, valkey_url: str, tmp_path):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = spawn(["serve", "--valkey-url", valkey_url, "--port", self.url.rsplit(":", 1)[1]],
                          str(tmp_path / "serve.log"))
        wait_http(self.url + "/health")

    async def post(self, path: str, tokens: list[int], **extra) -> dict:
        async with httpx.AsyncClient(timeout=15) as c:
            r = await c.post(self.url + path, json={"model": "sim", "token_ids": tokens, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    async def predict(self, tokens: list[int], **extra) -> dict:
        return await self.post("/v1/cache/predict", tokens, **extra)

    async def answer(self, tokens: list[int]) -> dict:
        """A prediction, or {} while the predictor cannot answer yet (503: no pod reported yet)."""
        async with httpx.AsyncClient(timeout=15) as c:
            r = await c.post(self.url + "/v1/cache/predict", json={"model": "sim", "token_ids": tokens})
        assert r.status_code in (200, 503), r.text
        return r.json() if r.status_code == 200 else {"pod_affinities": [], "freshness": {"state": None, "pods": {}}}

    async def get(self, path: str) -> dict:
        async with httpx.AsyncClient(timeout=15) as c:
            return (await c.get(self.url + path)).json()

    async def fleet_state(self, pod: str) -> str | None:
        """The pod's state in the fleet records as this predictor last read them."""
        return (await self.get("/stats"))["fleet"]["pods"].get(pod, {}).get("state")

    def stop(self) -> None:
        stop(self.proc)


def pod_state(answer: dict, pod: str) -> str | None:
    return answer["freshness"]["pods"].get(pod, {}).get("state")


def cached(answer: dict) -> dict[str, int]:
    return {a["pod_id"]: a["cached_tokens"] for a in answer["pod_affinities"]}


async def record_state(ix: Index, pod: str) -> str | None:
    rec = (await ix.fleet.fleet_view()).pods.get(pod)
    return rec.state if rec is not None else None


async def test_a_dead_engine_is_never_a_current_holder(valkey_url, tmp_path):
    """Item 2: an engine stopped (SIGTERM) was named best_pod with its cached tokens, the answer ``exact`` and the
    pod ``current``, /health ok, until its retirement 60 s later."""
    a, b = sim_engine("sim-da", tmp_path).start(), sim_engine("sim-db", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", a.url, "--engine", b.url, *FAST,
                 "--retire-after", "600"], str(tmp_path / "ing.log"), env=FAST_ENV)
    pred = Predictor(valkey_url, tmp_path)
    ix = Index.from_url(valkey_url)
    prompt = prompt_of(1)
    try:
        a.complete(prompt)
        b.complete(prompt[:2 * BLOCK + 3])

        async def both_current():
            d = await pred.answer(prompt)
            return (d["freshness"]["state"] == "exact" and cached(d) == {"sim-da": 80, "sim-db": 32}
                    and pod_state(d, "sim-da") == pod_state(d, "sim-db") == "current" and d)

        d = await until(both_current, "both pods ingested and current, the answer exact")
        assert d["best_pod"] == "sim-da"

        a.stop()  # SIGTERM: its engine holds nothing any more
        await until(lambda: _is(record_state(ix, "sim-da"), "unreachable"), "sim-da's record unreachable")
        await until(lambda: _is(pred.fleet_state("sim-da"), "unreachable"), "the predictor reading it")
        d = await pred.predict(prompt)
        # listed, marked, with what the index still holds for it; never the best pod
        assert (d["best_pod"], d["predicted_cached_tokens"], d["blocks_cached"]) == ("sim-db", 32, 2), d
        by_pod = {x["pod_id"]: x for x in d["pod_affinities"]}
        assert by_pod["sim-da"]["unreachable"] is True and "unreachable" not in by_pod["sim-db"], d
        fresh = d["freshness"]
        assert fresh["state"] == "degraded" and fresh["pods"]["sim-da"]["state"] == "unreachable", fresh
        assert any(r.startswith("engine unreachable for sim-da") for r in fresh["reasons"]), fresh
        route = await pred.post("/v1/cache/route", prompt)
        assert (route["pod_id"], route["reason"], route["cached_tokens"]) == ("sim-db", "best_overlap", 32), route
        health = await pred.get("/health")
        assert not any("no live pod" in r for r in health.get("reasons", [])), health

        b.stop()  # now the model has no live pod at all
        await until(lambda: _is(pred.fleet_state("sim-db"), "unreachable"), "the predictor reading sim-db down")

        async def health_degraded():
            h = await pred.get("/health")
            return any(r.startswith("no live pod for model(s) sim") for r in h.get("reasons", [])) and h

        assert (await until(health_degraded, "/health degraded: no live pod for sim"))["status"] == "degraded"
        d = await pred.predict(prompt)
        assert (d["best_pod"], d["predicted_cached_tokens"], d["freshness"]["state"]) == (None, 0, "degraded"), d
    finally:
        stop(ing)
        pred.stop()
        a.stop()
        b.stop()
        await ix.close()


async def test_a_frozen_sole_ingester_reads_behind_after_two_missed_renewals(valkey_url, tmp_path):
    """Item 9: a SIGSTOPped sole ingester's last account ("current") was taken as current for the lease's whole
    TTL (60 s here): answers said ``exact`` while the engine cached what nobody indexed. Two renewals missed
    (2.5 s), its pods read ``behind``; after SIGCONT the index catches up, exact again, and equal to the engine."""
    e = sim_engine("sim-fz", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", e.url, "--lease-ttl", "60", "--membership-hold",
                 "1", "--health-failures", "2"], str(tmp_path / "ing.log"), env=FAST_ENV)
    pred = Predictor(valkey_url, tmp_path)
    ix = Index.from_url(valkey_url)
    first, second = prompt_of(2), prompt_of(3)
    frozen = False
    try:
        e.complete(first)

        async def current():
            d = await pred.answer(first)
            return d["freshness"]["state"] == "exact" and cached(d).get("sim-fz") == 80 and d

        await until(current, "the pod ingested, the answer exact")
        os.kill(ing.pid, signal.SIGSTOP)
        frozen = True
        e.complete(second)  # cached by the engine; nobody indexes it while the ingester is stopped

        async def behind():
            d = await pred.predict(second)
            return pod_state(d, "sim-fz") == "behind" and d

        d = await until(behind, "the pod behind: its only lease missed two renewals")
        assert d["freshness"]["state"] == "degraded" and "ingestion behind for sim-fz" in d["freshness"]["reasons"]
        health = await pred.get("/health")
        assert health["status"] == "degraded" and any("renewals missed" in r for r in health["reasons"]), health

        os.kill(ing.pid, signal.SIGCONT)
        frozen = False

        async def caught_up():
            d = await pred.predict(second)
            return d["freshness"]["state"] == "exact" and d["predicted_cached_tokens"] == 80 and d

        await until(caught_up, "the index caught up, exact again")
        assert await index_state(ix, "sim-fz") == engine_truth(e.published())  # the oracle: the engine's replay
    finally:
        if frozen:
            os.kill(ing.pid, signal.SIGCONT)
        stop(ing)
        pred.stop()
        e.stop()
        await ix.close()


async def test_a_ghost_pod_left_by_a_one_off_ingester_is_never_exact_nor_routed_to(valkey_url, tmp_path):
    """Item 7: a one-off ``ingest --pod-id endpoint`` beside a fleet ingested the fleet's engine as
    ``127.0.0.1:PORT`` for a few seconds and left that pod behind, listed by no lease: answers holding it said
    ``exact`` (48 cached where the engine held 0) and /route chose it as best overlap. Such a one-off is refused
    now (``--pod-id`` is one of the index's settings: test_fleet.py); a ghost can still be left by a one-off that
    names the engine's pod its own way (``--source ...,pod=``), as here. The ghost is ``unknown``, degrades the
    answers that hold it, is not weighed by routes, and is retired after ``--retire-after``."""
    e = sim_engine("sim-gh", tmp_path).start()
    ghost = address_pod_id(e.url)
    fleet = spawn(["ingest", "--valkey-url", valkey_url, "--engine", e.url, "--ingester-id", "fleet-1", *FAST,
                   "--retire-after", "6"], str(tmp_path / "fleet.log"), env=FAST_ENV)
    pred = Predictor(valkey_url, tmp_path)
    ix = Index.from_url(valkey_url)
    oneoff = spawn(["ingest", "--valkey-url", valkey_url, "--source",
                    f"tcp://127.0.0.1:{e.zmq_port},replay=tcp://127.0.0.1:{e.replay_port},pod={ghost},model=sim",
                    "--ingester-id", "oneoff", *FAST], str(tmp_path / "oneoff.log"), env=FAST_ENV)
    prompt = prompt_of(4)
    try:
        async def oneoff_ingesting():
            lease = (await ix.fleet.fleet_view()).ingesters.get("oneoff")
            return lease is not None and ghost in lease.pods

        await until(oneoff_ingesting, "the one-off ingester ingesting the engine as its address")
        e.complete(prompt)

        async def both_hold():
            return cached(await pred.answer(prompt)) == {"sim-gh": 80, ghost: 80}

        await until(both_hold, "the prompt indexed under both names")

        async def recorded():  # a fleet ingester records every pod it ingests within a membership round
            return ghost in (await ix.fleet.fleet_view()).pods

        await until(recorded, "the one-off's pod recorded in the fleet")
        stop(oneoff)  # it leaves; nobody ingests the ghost any more
        filler = prompt_of(5, blocks=1)
        e.clear(filler)  # the engine holds none of the prompt now

        async def cleared():  # and the one-off's lease gone from the predictor's view (read every second)
            d = await pred.predict(prompt)
            return "sim-gh" not in cached(d) and pod_state(d, ghost) != "current" and d

        d = await until(cleared, "sim-gh's clear applied, the one-off's lease gone")
        # the ghost still holds the prompt in the index: no answer holding it is exact
        assert cached(d) == {ghost: 80} and pod_state(d, ghost) == "unknown", d
        assert d["freshness"]["state"] == "degraded", d
        assert f"ingestion unknown for {ghost} (no ingester's lease covers it)" in d["freshness"]["reasons"], d
        route = await pred.post("/v1/cache/route", prompt)
        assert route["best_overlap_pod"] is None and route["reason"] == "no_overlap", route

        # long-term: retired as any pod nobody ingests, its entries cleared (the usual lifecycle)
        async def retired():
            d = await pred.predict(prompt)
            return await record_state(ix, ghost) == "retired" and not d["pod_affinities"] and d

        d = await until(retired, "the ghost retired and cleared", timeout=40)
        rec = (await ix.fleet.fleet_view()).pods[ghost]
        assert rec.reason.startswith("no ingester has ingested it for") and rec.engine_url == "", rec
        assert d["freshness"]["state"] == "exact" and d["predicted_cached_tokens"] == 0
        assert e.complete(prompt) == 0  # the engine's own account agrees

        async def ghost_cleared():  # a retired pod is never offered at once; its entries go once every ingester let go
            return await index_state(ix, ghost) == set()

        await until(ghost_cleared, "the ghost's entries cleared")
    finally:
        stop(oneoff)
        stop(fleet)
        pred.stop()
        e.stop()
        await ix.close()


@pytest.mark.serial(reason="kills a whole shard of the cluster, as test_cluster_failover.py does")
async def test_the_leases_shard_down_is_said_in_every_answer(valkey_cluster, cluster_url, tmp_path):
    """Item 3: the shard holding ``kvpf:ingesters`` (and ``kvpf:load``) down, master and replica, while the
    ingester dies: the predictor kept its last fleet view, its answers ``exact`` with a staleness of a minute and
    the engine's cache reset under it. Now every answer is degraded and says the records could not be read (and
    the pod's lease ages to behind, then stalled, as the staleness grows from the last successful read)."""
    sync = redis.RedisCluster.from_url(cluster_url)
    down = sync.get_node_from_key(INGESTERS_KEY).port
    assert sync.get_node_from_key(NUMS_BYID_KEY).port != down, "the numbering shares the leases' shard here"
    pod = next(p for p in (f"sim-c{i}" for i in range(100)) if sync.get_node_from_key(pod_meta_key(p)).port != down)
    # a prompt whose request keys (and their presence hashes, in the same slots) are all on the shards left
    prompt = next(t for t in (prompt_of(100 + i, blocks=3) for i in range(500))
                  if all(sync.get_node_from_key(str(k)).port != down
                         for k in request_keys(t, model="sim", block_size=BLOCK)))
    e: SimEngine = sim_engine(pod, tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", cluster_url, "--engine", e.url, *FAST], str(tmp_path / "ing.log"),
                env=FAST_ENV)
    pred = Predictor(cluster_url, tmp_path)
    try:
        e.complete(prompt)

        async def current():
            d = await pred.answer(prompt)
            return d["freshness"]["state"] == "exact" and cached(d).get(pod) == 48 and d

        await until(current, "the pod ingested, the answer exact", timeout=40)
        master = valkey_cluster.node_at(down)
        for node in [*valkey_cluster.replicas_of(master), master]:  # no replica left to take over
            node.stop(kill=True)
        stop(ing, kill=True)
        e.clear(prompt_of(7, blocks=1))  # the engine holds none of the prompt; nobody tells the index

        async def degraded():
            d = await pred.predict(prompt)
            return d["freshness"]["state"] == "degraded" and d

        d = await until(degraded, "the answer degraded")
        assert cached(d) == {pod: 48}  # what the index still holds, not vouched for
        said = [r for r in d["freshness"]["reasons"]
                if r.startswith("the fleet records (ingester leases, pod records) not read for")]
        assert said and "each pod's account is as of the last successful read" in said[0], d["freshness"]
        for path in ("/v1/cache/route", "/v1/cache/explain"):  # every answer, not only /health
            other = await pred.post(path, prompt)
            assert other["freshness"]["state"] == "degraded", (path, other["freshness"])
            assert any(r.startswith("the fleet records") for r in other["freshness"]["reasons"]), path
        health = await pred.get("/health")
        assert health["status"] == "degraded" and any("fleet records not readable" in r for r in health["reasons"])
    finally:
        stop(ing, kill=True)
        pred.stop()
        e.stop()
        sync.close()


async def _is(value, expected) -> bool:
    return await value == expected
