"""Fault tests with real processes: kill -9 an ingester, restart Valkey, two ingesters, outages.
After each, the index equals the engine's true state (stored minus removed)."""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis

from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.events import BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import Index
from kv_preflight.index.layout import EPOCH_KEY, pod_state_key
from tests.e2e.harness import spawn, stop, wait_log
from tests.integration.engine_stub import EngineStub
from tests.integration.truth import engine_truth, index_state

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


class Workload:
    """A chain-shaped stream like vLLM's: new prompts store chains, the pool evicts old blocks."""

    def __init__(self, seed: int = 1):
        self.rng = random.Random(seed)
        self.next_ek = 1
        self.live: list[int] = []
        self.batches: list[EventBatch] = []

    def next_batch(self) -> EventBatch:
        events = []
        if len(self.live) > 40:
            victims = [self.live.pop(0) for _ in range(self.rng.randrange(1, 6))]
            events.append(BlockRemoved(victims, medium="GPU", group_idx=0))
        n = self.rng.randrange(1, 5)
        hashes = list(range(self.next_ek, self.next_ek + n))
        self.next_ek += n
        parent = self.rng.choice(self.live) if self.live and self.rng.random() < 0.5 else None
        tokens = [self.rng.randrange(1, 30000) for _ in range(32 * n)]
        events.append(BlockStored(hashes, parent, tokens, 32, medium="GPU", group_idx=0, extra_keys=[None] * n))
        self.live += hashes
        batch = EventBatch(time.time(), events, 0)
        self.batches.append(batch)
        return batch


async def wait_for_seq(ix: Index, pod: str, seq: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (await ix.meta.pod_info(pod)).seqs.get("0", -1) >= seq:
                return
        except Exception:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{pod} did not reach seq {seq}: {await ix.meta.pod_info(pod)}")


@pytest.fixture
async def own_valkey(tmp_path):
    server = ValkeyServer(tmp_path / "valkey", appendonly=True).start()
    yield server
    server.stop()


def engine_and_source():
    zport, rport = free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", "kv@pod-f@tiny", bind=True)
    return engine, f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"


async def publish(engine, wl, n, pause=0.005):
    for _ in range(n):
        engine.publish(wl.next_batch())
        await asyncio.sleep(pause)


async def assert_exact(ix, wl, engine):
    await wait_for_seq(ix, "pod-f", engine.seq - 1)
    assert await index_state(ix, "pod-f") == engine_truth(wl.batches)
    assert not (await ix.meta.pod_info("pod-f")).incomplete


async def test_kill_9_ingester_mid_stream_and_restart(own_valkey, tmp_path):
    engine, source = engine_and_source()
    wl = Workload()
    ix = Index.from_url(own_valkey.url)
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "ing1.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 60)
        stop(ing, kill=True)  # SIGKILL: no cleanup, whatever was in flight is lost
        await publish(engine, wl, 60)  # nobody is listening
        ing = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "ing2.log"))
        await engine.subscribed(2)  # the second ingester's subscription
        await publish(engine, wl, 20)
        await assert_exact(ix, wl, engine)
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_valkey_restart_with_aof(own_valkey, tmp_path):
    engine, source = engine_and_source()
    wl = Workload(2)
    ix = Index.from_url(own_valkey.url)
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "ing.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 50)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        own_valkey.stop()  # graceful: AOF flushed
        await publish(engine, wl, 50)  # the ingester retries with backoff meanwhile
        await asyncio.sleep(0.5)
        own_valkey.start()
        await publish(engine, wl, 10)
        await assert_exact(ix, wl, engine)
        assert "valkey unavailable" in (tmp_path / "ing.log").read_text()
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_valkey_lost_writes_are_recovered_by_replay(own_valkey, tmp_path):
    """kill -9 of Valkey may lose the last second of AOF; the persisted seq rolls back with the
    data (one script = one atomic unit), so the ingester sees a gap and replays it."""
    engine, source = engine_and_source()
    wl = Workload(3)
    ix = Index.from_url(own_valkey.url)
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "ing.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 40)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        own_valkey.stop(kill=True)
        own_valkey.start()
        await publish(engine, wl, 10)
        await assert_exact(ix, wl, engine)
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_a_rebuild_while_a_gap_is_replayed_takes_the_gap_with_it(own_valkey, tmp_path):
    """The index's epoch goes (as when Valkey loses its data; here the rest stays, as a cluster's other shards
    keep theirs) while a pod waits for a gap's replay, and the rebuild's replay (from seq 0) is in first: the
    rebuild takes the gap's batches over, and they apply after it. Before (a second review's finding), the
    rebuild's own batches queued behind the gap after the pod was cleared, and it was marked exact with
    nothing written again."""
    engine, source = engine_and_source()
    wl = Workload(5)
    ix = Index.from_url(own_valkey.url)
    log = str(tmp_path / "ing.log")
    # replays answered when the test says: none times out meanwhile (a gap's would be forced, and nothing tested)
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], log,
                env={"KVPF_REPLAY_TIMEOUT_S": "60"})

    async def asked(n: int) -> None:
        deadline = time.monotonic() + 30
        while engine.replay_requests < n:
            assert time.monotonic() < deadline, f"{engine.replay_requests} replay request(s), not {n}"
            await asyncio.sleep(0.05)

    try:
        await engine.subscribed()
        await publish(engine, wl, 10)
        await wait_for_seq(ix, "pod-f", engine.seq - 1)
        engine.answer_replays.clear()  # replays wait for the test
        asked_before = engine.replay_requests
        engine.publish(wl.next_batch(), send=False)  # lost on the wire: the next batch finds a gap
        await publish(engine, wl, 2)
        await asked(asked_before + 1)
        # the epoch gone (as when Valkey lost its data; the rest kept, as a cluster's other shards keep theirs),
        # the gap's replay still awaited
        redis.Redis.from_url(own_valkey.url).delete(EPOCH_KEY)
        wait_log(log, "Valkey lost the index's data", ing)
        await asked(asked_before + 2)
        assert engine.replay_starts[asked_before:] == [10, 0]  # the gap's, then the rebuild's
        engine.release_starts = {0}  # the rebuild's replay answered while the gap's still waits
        wait_log(log, "pod-f: rebuilt whole from its engine's replay buffer", ing)
        engine.answer_replays.set()
        await publish(engine, wl, 3)
        await assert_exact(ix, wl, engine)
        with open(log) as f:
            assert "did not answer" not in f.read()
        assert ing.poll() is None
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_a_rebuild_of_a_pod_with_two_ranks_ends_exact_and_unflagged(own_valkey, tmp_path):
    """A pod with two data-parallel ranks (a publisher and a replay socket each; each rank indexed as a pod of
    its own: pod-f and pod-f@dp1, kv_preflight/index/rank_pods.py) rebuilt after the index's epoch went: each
    rank ends exact and unflagged, and the ranks' shared llm-d entries stay (a rank's clear keeps the entries the
    other holds). (A review found, when the ranks were one pod, the second rank's reset answered "dup" once the
    first had cleared its seq, taken for a seq that moved meanwhile: the pod stayed flagged until its next reset.)"""
    import msgspec

    stubs, sources = [], []
    for _ in (0, 1):
        zport, rport = free_port(), free_port()
        stubs.append(EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", "kv@pod-f@tiny", bind=True))
        sources += ["--source", f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"]
    wls = [Workload(7), Workload(8)]
    wls[1].next_ek = 1_000_000  # the ranks' blocks apart
    ix = Index.from_url(own_valkey.url)
    log = str(tmp_path / "ing.log")
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, *sources], log)
    ranks = ("pod-f", "pod-f@dp1")

    async def publish_ranks(n: int) -> None:
        for _ in range(n):
            for rank, (stub, wl) in enumerate(zip(stubs, wls)):
                wl.next_batch()
                wl.batches[-1] = msgspec.structs.replace(wl.batches[-1], data_parallel_rank=rank)
                stub.publish(wl.batches[-1])
            await asyncio.sleep(0.005)

    async def at_seq(seq: int) -> None:
        deadline = time.monotonic() + 20
        while [(await ix.meta.pod_info(p)).seqs for p in ranks] != [{"0": seq}, {"1": seq}]:
            assert time.monotonic() < deadline, f"not at seq {seq}: {[await ix.meta.pod_info(p) for p in ranks]}"
            await asyncio.sleep(0.05)

    try:
        for stub in stubs:
            await stub.subscribed()
        await publish_ranks(10)
        await at_seq(9)
        redis.Redis.from_url(own_valkey.url).delete(EPOCH_KEY)  # the data kept: the seqs survive
        for pod in ranks:
            wait_log(log, f"{pod}: rebuilt whole from its engine's replay buffer", ing)
        await publish_ranks(3)
        await at_seq(12)
        for pod, wl in zip(ranks, wls):
            assert await index_state(ix, pod) == engine_truth(wl.batches)
            assert not (await ix.meta.pod_info(pod)).incomplete
        assert ing.poll() is None
    finally:
        stop(ing)
        for stub in stubs:
            stub.close()
        await ix.close()


async def test_a_rebuild_of_a_pod_whose_state_log_does_not_read_flags_it_and_the_others_go_on(own_valkey, tmp_path):
    """The index's epoch goes (as when Valkey loses its data; here the rest stays) and two pods are rebuilt from
    their replay buffers, one of them with junk in its state log (a hand edit, a bug, a build that writes another
    format). The rebuild clears a pod before it applies the replay, which loads its log: PodLogError left it and
    ended the process. Now that pod is not reset (its entries cannot be found to clear), logged, counted, flagged
    with the reason, its replay not applied; the other is rebuilt whole and goes on exact."""
    stubs, sources = {}, []
    for pod in ("pod-f", "pod-g"):
        zport, rport = free_port(), free_port()
        stubs[pod] = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", f"kv@{pod}@tiny", bind=True)
        sources += ["--source", f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport}"]
    wls = {"pod-f": Workload(9), "pod-g": Workload(10)}
    ix = Index.from_url(own_valkey.url)
    log = str(tmp_path / "ing.log")
    ing = spawn(["ingest", "--valkey-url", own_valkey.url, *sources], log)

    async def publish_both(n: int) -> None:
        for _ in range(n):
            for pod, stub in stubs.items():
                stub.publish(wls[pod].next_batch())
            await asyncio.sleep(0.005)

    try:
        for stub in stubs.values():
            await stub.subscribed()
        await publish_both(10)
        for pod in stubs:
            await wait_for_seq(ix, pod, 9)
        await ix.client.hset(pod_state_key("pod-f"), "s", b"\xc1junk")
        redis.Redis.from_url(own_valkey.url).delete(EPOCH_KEY)  # the data kept: the seqs survive
        wait_log(log, "pod-g: rebuilt whole from its engine's replay buffer", ing)
        deadline = time.monotonic() + 30
        while "state log does not read" not in (info := await ix.meta.pod_info("pod-f")).incomplete_reason:
            assert ing.poll() is None, "the ingester died: " + open(log).read()[-2000:]
            assert time.monotonic() < deadline, info
            await asyncio.sleep(0.05)
        await publish_both(3)
        await wait_for_seq(ix, "pod-g", 12)
        assert await index_state(ix, "pod-g") == engine_truth(wls["pod-g"].batches)
        assert not (await ix.meta.pod_info("pod-g")).incomplete
        info = await ix.meta.pod_info("pod-f")
        assert info.incomplete and "state log does not read" in info.incomplete_reason, info
        assert (await ix.meta.counters()).get("apply_errors", 0) >= 1
        text = open(log).read()
        assert "pod-f: rebuilt whole" not in text and "Traceback" not in text
        assert ing.poll() is None
    finally:
        stop(ing)
        for stub in stubs.values():
            stub.close()
        await ix.close()


async def test_an_engine_restart_probed_on_a_pod_whose_state_log_does_not_read_flags_it(own_valkey, tmp_path):
    """An ingester starts while its engine has restarted (its replay buffer no longer holds the pod's seq): the
    restart probe on connect clears the pod, loading its state log. With junk there the probe's task failed ("restart
    probe failed", a warning) and the pod stayed unflagged, its old entries answering as exact. Now the pod is flagged
    with the reason, logged, counted."""
    zport, rport = free_port(), free_port()
    pub, replay = f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}"
    engine = EngineStub(pub, replay, "kv@pod-f@tiny", bind=True)
    wl = Workload(11)
    ix = Index.from_url(own_valkey.url)
    args = ["ingest", "--valkey-url", own_valkey.url, "--source", f"{pub},replay={replay}"]
    ing = spawn(args, str(tmp_path / "ing1.log"))
    try:
        await engine.subscribed()
        await publish(engine, wl, 5)
        await wait_for_seq(ix, "pod-f", 4)
        stop(ing)
        engine.close()
        engine = EngineStub(pub, replay, "kv@pod-f@tiny", bind=True)  # restarted: seq 0, nothing buffered
        await ix.client.hset(pod_state_key("pod-f"), "s", b"\xc1junk")
        log = tmp_path / "ing2.log"
        ing = spawn(args, str(log))
        deadline = time.monotonic() + 30
        while "state log does not read" not in (info := await ix.meta.pod_info("pod-f")).incomplete_reason:
            assert ing.poll() is None, "the ingester died: " + log.read_text()[-2000:]
            assert time.monotonic() < deadline, (info, log.read_text()[-2000:])
            await asyncio.sleep(0.05)
        assert "engine restart" in info.incomplete_reason and info.blocks > 0, info  # not cleared
        assert (await ix.meta.counters()).get("apply_errors", 0) >= 1
        assert "restart probe failed" not in log.read_text() and "Traceback" not in log.read_text()
    finally:
        stop(ing)
        engine.close()
        await ix.close()


async def test_two_ingester_processes_one_engine(own_valkey, tmp_path):
    engine, source = engine_and_source()
    wl = Workload(4)
    ix = Index.from_url(own_valkey.url)
    a = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "a.log"))
    b = spawn(["ingest", "--valkey-url", own_valkey.url, "--source", source], str(tmp_path / "b.log"))
    try:
        await engine.subscribed(2)  # both ingesters
        await publish(engine, wl, 80)
        stop(a, kill=True)  # one dies; the other carries on alone
        await publish(engine, wl, 40)
        await assert_exact(ix, wl, engine)
        info = await ix.meta.pod_info("pod-f")
        assert info.counters["batches"] == engine.seq  # every batch applied exactly once
    finally:
        stop(a)
        stop(b)
        engine.close()
        await ix.close()
