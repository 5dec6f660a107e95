"""A master killed (kill -9) under live ingestion and prediction on a real local Valkey Cluster
(2 s node timeout): the replica is promoted, ingester and predictor carry on without a restart,
predictions answer again within node-timeout + 5 s, and writes the old master took with it (its
replica held back, so they really were lost) are found in the outbox and written again. The engine
is the simulator (``kv-preflight simulate``, a real process publishing vLLM's KV events), so after
the failover every prediction is checked against the cached tokens the engine itself reports."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from kv_preflight.cli.accuracy import run_workload, shared_prefix_workload
from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from kv_preflight.keys.chain import request_keys
from kv_preflight.index.layout import pod_outbox_key
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import SimEngine, sim_engine
from tests.integration.test_cluster import assert_exact, cluster_engine, wait_seq
from tests.integration.test_fault_accuracy import blind, exact
from tests.integration.test_faults import Workload, publish
from tests.integration.truth import engine_truth, index_state

pytestmark = [pytest.mark.integration, pytest.mark.anyio,
              # each kills or reshards masters while load runs and waits for the cluster's own failover
              # (2 s node timeout): another test's CPU would stretch those waits, not test anything more
              pytest.mark.serial(reason="failover and resharding timed against the cluster's node timeout")]


class Prober(threading.Thread):
    """Predictions in a loop; remembers when the last non-200 answer came."""

    def __init__(self, url: str, model: str = "tiny"):
        super().__init__(daemon=True)
        self.url, self.model, self.stop_flag, self.last_bad, self.answers = url, model, threading.Event(), 0.0, []

    def run(self) -> None:
        with httpx.Client(timeout=3) as client:
            while not self.stop_flag.is_set():
                try:
                    body = {"model": self.model, "token_ids": list(range(1, 65))}
                    code = client.post(self.url, json=body).status_code
                except httpx.HTTPError:
                    code = 0
                self.answers.append(code)
                if code != 200:
                    self.last_bad = time.monotonic()
                time.sleep(0.05)


def fresh_prompts(seed: int, n: int) -> list[dict]:
    """Prompts sharing nothing with each other: 3 to 5 whole blocks of 16 tokens (then a partial one), so each
    stores request keys the index has never held, spread over every shard."""
    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(10, 8000) for _ in range(16 * rng.randrange(3, 6) + 5)]} for _ in range(n)]


async def wait_applied(ix: Index, engine: SimEngine) -> None:
    """Until the index has applied every batch the engine has published."""
    await wait_seq(ix, engine.pod, len(engine.published()) - 1)


async def assert_index_is_the_engines(ix: Index, engine: SimEngine, timeout: float = 20.0) -> None:
    """The index holds exactly the blocks the engine's published batches leave cached, every request key of
    each listing the pod, and no outbox entry is left."""
    batches = engine.published()
    await wait_seq(ix, engine.pod, len(batches) - 1)
    deadline = time.monotonic() + timeout
    while await ix.client.exists(pod_outbox_key(engine.pod)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not await ix.client.exists(pod_outbox_key(engine.pod)), "an outbox entry was left behind"
    assert await index_state(ix, engine.pod) == engine_truth(batches)


async def test_master_killed_under_load(valkey_cluster, cluster_url, tmp_path):
    # 512 blocks: nothing is evicted, so the prompts whose keys the old master lost are still cached at
    # the end, and predicting them exactly needs those keys written again.
    engine = sim_engine("sim-fail", tmp_path, blocks=512).start()
    ix = Index.from_url(cluster_url)
    sync = redis.RedisCluster.from_url(cluster_url)
    port = free_port()
    predictor = f"http://127.0.0.1:{port}"
    ing = spawn(["ingest", "--valkey-url", cluster_url, "--engine", engine.url], str(tmp_path / "ing.log"))
    pred = spawn(["serve", "--valkey-url", cluster_url, "--port", str(port), "--engine-url", f"sim={engine.url}"],
                 str(tmp_path / "pred.log"))
    prober = Prober(f"{predictor}/v1/cache/predict", model="sim")
    warm = shared_prefix_workload(n=8, seed=13, block=16)
    held, during, after, new = (fresh_prompts(seed, n) for seed, n in ((1, 8), (2, 3), (3, 3), (4, 4)))
    held_replica = None
    try:
        wait_http(f"{predictor}/health")
        exact(run_workload(engine.url, predictor, "sim", warm))
        await assert_index_is_the_engines(ix, engine)
        prober.start()

        # The master of a request key the next batches write, and its replica, held back (SIGSTOP).
        masters = {n.port: n for n in valkey_cluster.masters_now()}
        pod_master = sync.get_node_from_key(pod_outbox_key(engine.pod)).port
        victim = next(n for p, n in masters.items() if p != pod_master)
        # KEYS on the victim itself: redis-py's cluster client sends KEYS to its default node only, which
        # is the victim only while the URL's node is still the first master (not after an earlier failover)
        on_victim = redis.Redis(port=victim.port)
        before = set(on_victim.keys("*"))
        held_replica = valkey_cluster.replicas_of(victim)[0]
        # Stopped, then cut off: what the master writes from here on never reaches the replica (a
        # stopped process cannot reconnect), as when a replica lags behind a master that then dies.
        os.kill(held_replica.proc.pid, signal.SIGSTOP)
        redis.Redis(port=victim.port).execute_command("CLIENT", "KILL", "TYPE", "replica")
        first = run_workload(engine.url, predictor, "sim", held)  # new prompts: no hits, and none predicted
        assert [(r.predicted, r.actual) for r in first] == [(0, 0)] * len(held)
        await wait_applied(ix, engine)
        # The seq moves in a batch's pod step, before its effects reach the shards: wait for those.
        deadline = time.monotonic() + 10
        while True:
            fresh = [k for k in set(on_victim.keys("*")) - before if k.decode().isdigit()]
            if fresh or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert fresh, "no new request key landed on the chosen master"

        # Freeze the ingester so nothing is repaired before the loss is shown; kill the master.
        os.kill(ing.pid, signal.SIGSTOP)
        killed_at = time.monotonic()
        victim.stop(kill=True)
        os.kill(held_replica.proc.pid, signal.SIGCONT)
        blind(engine.url, during)  # the engine goes on caching and publishing while the master is down
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if held_replica.port in {n.port for n in valkey_cluster.masters_now()}:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the replica was not promoted")
        promoted = redis.Redis(port=held_replica.port)
        lost = [k for k in fresh if not promoted.exists(k)]
        assert lost, "the held-back replica had every write: nothing was lost, so nothing is tested"

        os.kill(ing.pid, signal.SIGCONT)
        blind(engine.url, after)  # and after the promotion
        # Repaired: every key the engine's blocks need is back, and predictions equal the engine's own
        # cached tokens, for the prompts whose keys were lost as for those sent during and after.
        await assert_index_is_the_engines(ix, engine)
        results = run_workload(engine.url, predictor, "sim", held + during + after + new)
        exact(results)
        lost_ids = {int(k) for k in lost}
        needed = [(r.actual, 16 * (i + 1)) for r, p in zip(results, held)
                  for i, k in enumerate(request_keys(p["token_ids"], model="sim", block_size=16)) if k in lost_ids]
        assert needed and all(actual >= upto for actual, upto in needed), (
            f"a lost key no longer sits in a cached prefix, so its repair is not tested: {needed}")
        await assert_index_is_the_engines(ix, engine)
        assert ing.poll() is None and pred.poll() is None, "a process exited"
        seen = len(prober.answers)
        while len(prober.answers) < seen + 10 and prober.is_alive():  # answers after the repair, too
            await asyncio.sleep(0.05)
        prober.stop_flag.set()
        prober.join(timeout=5)
        assert prober.answers and prober.answers[-1] == 200
        assert prober.last_bad - killed_at <= 2.0 + 5.0, (
            f"predictions failed until {prober.last_bad - killed_at:.1f}s after the kill")
    finally:
        prober.stop_flag.set()
        if held_replica is not None and held_replica.proc is not None and held_replica.proc.poll() is None:
            os.kill(held_replica.proc.pid, signal.SIGCONT)
        if ing.poll() is None:
            os.kill(ing.pid, signal.SIGCONT)
        stop(ing)
        stop(pred)
        engine.stop()
        sync.close()
        await ix.close()


async def test_a_shard_down_with_no_replica_gives_a_partial_answer(valkey_cluster, cluster_url, caplog):
    """A shard with its master and replica both gone: the lookup still answers from the other
    shards, says where the first unanswered block is, and its counts are lower bounds; the predictor logs
    why (what the shard said), once, however many answers are partial."""
    from kv_preflight.index.index import StoreBlock, encode_entry, make_entry

    from httpx import ASGITransport

    from kv_preflight.predictor.http.app import create_app
    from kv_preflight.config import Config
    from kv_preflight.keys.chain import request_keys
    from kv_preflight.index.layout import PODS_KEY

    ix = Index.from_url(cluster_url)
    sync = redis.RedisCluster.from_url(cluster_url)
    try:
        # The shard going down is the one holding the registry too (kvpf:registry, read to know the model):
        # a prompt whose 11th key lands there, so the answer must not depend on the registry being readable.
        registry_port = sync.get_node_from_key(PODS_KEY).port
        for base in range(1, 500):
            tokens = [(7 * i + base) % 30000 + 1 for i in range(40 * 16)]
            chain = request_keys(tokens, model="m", block_size=16)
            if sync.get_node_from_key(str(chain[10])).port == registry_port:
                break
        f = encode_entry(make_entry("pod-p", "GPU", 0))
        await ix.apply_batch(pod_id="pod-p", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                             mutations=[StoreBlock(5000 + i, "gpu", f, (rk,)) for i, rk in enumerate(chain)])
        full = await ix.lookup_detailed(chain)
        assert not full.partial and [m.blocks for m in full.matches] == [40]
        # The shard of the 11th key goes down whole.
        port = sync.get_node_from_key(str(chain[10])).port
        master = valkey_cluster.node_at(port)
        for node in [*valkey_cluster.replicas_of(master), master]:
            node.stop(kill=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                got = await ix.lookup_detailed(chain)
                if got.partial:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("no partial answer while a shard was down")
        first_down = next(i for i, k in enumerate(chain) if ix.client.get_node_from_key(str(k)).port == port)
        assert got.unanswered_from == first_down <= 10
        assert [m.blocks for m in got.matches] == [first_down]  # a lower bound, never more
        # A chain wholly on that shard: an error, which says what the shard said (the slots unserved, or the
        # connection refused), not only that it was silent
        with pytest.raises(RedisConnectionError, match=r"^no shard of the cluster answered the lookup \((?!no reason)"):
            await ix.lookup_detailed([chain[first_down]])
        # Through the predictor: a 200 that says so, not a silently short answer.
        app = create_app(Config(valkey_url=cluster_url, engine_urls={}))
        caplog.set_level("WARNING", logger="kvpf.predictor")
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=ASGITransport(app), base_url="http://t") as client:
                for _ in range(3):
                    resp = await client.post("/v1/cache/predict", json={"model": "m", "token_ids": tokens})
                    assert resp.status_code == 200, resp.text
                    body = resp.json()
                    assert body["partial"] is True and body["partial_from_block"] == first_down
                    assert body["pod_affinities"][0]["cached_blocks"] == first_down
        said = [r.getMessage() for r in caplog.records if "shard did not answer" in r.getMessage()]
        assert len(said) == 1, said
        assert f"partial from block {first_down} on" in said[0] and "no reason given" not in said[0], said
    finally:
        sync.close()
        await ix.close()


async def test_reshard_while_ingesting_and_predicting(valkey_cluster, cluster_url, tmp_path):
    """`valkey-cli --cluster reshard` moves slots (and their keys) between masters while batches
    are applied and predictions served: no error reaches a client, nothing is lost."""
    import subprocess

    from kv_preflight.cli.valkey_cluster import cli_binary

    engine, source = cluster_engine()
    wl = Workload(43)
    ix = Index.from_url(cluster_url)
    port = free_port()
    ing = spawn(["ingest", "--valkey-url", cluster_url, "--source", source], str(tmp_path / "ing.log"))
    pred = spawn(["serve", "--valkey-url", cluster_url, "--port", str(port)], str(tmp_path / "pred.log"))
    prober = Prober(f"http://127.0.0.1:{port}/v1/cache/predict")
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        await engine.subscribed()
        await publish(engine, wl, 20)
        await assert_exact(ix, engine, wl)
        prober.start()
        masters = valkey_cluster.masters_now()
        ids = {}
        for m in masters:
            ids[m.port] = subprocess.run([cli_binary(), "-p", str(m.port), "cluster", "myid"], capture_output=True,
                                         text=True, timeout=10).stdout.strip()
        src, dst = masters[0], masters[1]
        reshard = subprocess.Popen([cli_binary(), "--cluster", "reshard", f"127.0.0.1:{src.port}",
                                    "--cluster-from", ids[src.port], "--cluster-to", ids[dst.port],
                                    "--cluster-slots", "1500", "--cluster-yes", "--cluster-pipeline", "10"],
                                   stdout=open(tmp_path / "reshard.log", "w"), stderr=subprocess.STDOUT)
        while reshard.poll() is None:
            await publish(engine, wl, 2, pause=0.02)
        assert reshard.returncode == 0, (tmp_path / "reshard.log").read_text()[-2000:]
        await publish(engine, wl, 5)
        await assert_exact(ix, engine, wl)
        prober.stop_flag.set()
        prober.join(timeout=5)
        bad = [c for c in prober.answers if c != 200]
        assert len(prober.answers) > 10 and not bad, f"{len(bad)} of {len(prober.answers)} predictions failed"
        assert ing.poll() is None and pred.poll() is None
        assert "Traceback" not in (tmp_path / "ing.log").read_text()
    finally:
        prober.stop_flag.set()
        stop(ing)
        stop(pred)
        engine.close()
        await ix.close()
