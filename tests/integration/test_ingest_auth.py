"""Who may write through an ingester's sockets, with real `kv-preflight ingest` processes, real ZMQ
publishers and a real Valkey: CURVE on --bind (only --curve-allow keys connect), CURVE towards an
engine that is a CURVE server (curve_server_key=), and per-socket pods= allowlists."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import zmq
import zmq.auth

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.events import BlockStored, EventBatch, encode_frames
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_http
from tests.prom import metric

pytestmark = [pytest.mark.integration]


def batch(n: int) -> EventBatch:
    return EventBatch(time.time(), [BlockStored([9000 + n], None, [n + 1] * 16, 16, medium="GPU", group_idx=0,
                                                extra_keys=[None])], 0)


class Publisher:
    """One engine's PUB socket: connects to a --bind ingester (or binds, as a CURVE server), its own seqs per pod."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, keys: tuple[bytes, bytes] | None = None,
                 server_key: bytes | None = None, bind: bool = False, curve_server: bool = False):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keys
        if server_key is not None:
            self.sock.curve_serverkey = server_key
        if curve_server:
            self.sock.curve_server = True
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self.seqs: dict[str, int] = {}

    def publish(self, pod: str) -> int:
        seq = self.seqs.get(pod, 0)
        self.seqs[pod] = seq + 1
        self.sock.send_multipart(encode_frames(f"kv@{pod}@tiny", seq, batch(seq)))
        return seq


class Valkey:
    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.ix = Index.from_url(url)

    def pods(self) -> dict[str, str]:
        return self.loop.run_until_complete(self.ix.meta.pod_ids())

    def seq(self, pod: str) -> int:
        return self.loop.run_until_complete(self.ix.meta.pod_info(pod)).seqs.get("0", -1)

    def counters(self) -> dict[str, int]:
        return self.loop.run_until_complete(self.ix.meta.counters())

    def close(self) -> None:
        self.loop.run_until_complete(self.ix.close())
        self.loop.close()


def publish_until_indexed(pub: Publisher, vk: Valkey, pod: str, proc, timeout_s: float = 20.0) -> None:
    """Publish the pod's next batch every 0.2 s until one is indexed (ZMQ's slow joiner, a CURVE handshake)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seq = pub.publish(pod)
        for _ in range(20):
            if vk.seq(pod) >= seq:
                return
            time.sleep(0.01)
        assert proc.poll() is None, "the ingester died"
        assert time.monotonic() < deadline, f"{pod} never indexed"


def spawn_ingester(valkey_url: str, tmp_path: Path, *args: str):
    mport = free_port()
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--metrics-port", str(mport), *args],
                 str(tmp_path / f"ingest-{mport}.log"))
    url = f"http://127.0.0.1:{mport}/metrics"
    wait_http(url)
    return proc, url, tmp_path / f"ingest-{mport}.log"


def certificates(tmp_path: Path, *names: str) -> dict[str, tuple[bytes, bytes]]:
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    out = {}
    for name in names:
        _, secret_file = zmq.auth.create_certificates(keys, name)
        out[name] = zmq.auth.load_certificate(secret_file)
    return out


def test_curve_bind_admits_only_listed_publishers(valkey_url, tmp_path):
    certs = certificates(tmp_path, "ingester", "engine", "intruder")
    allow = tmp_path / "allow"
    allow.mkdir()
    (allow / "engine.key").write_bytes((tmp_path / "keys" / "engine.key").read_bytes())
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc, metrics_url, log = spawn_ingester(
        valkey_url, tmp_path, "--bind", endpoint,
        "--curve-secret-key-file", str(tmp_path / "keys" / "ingester.key_secret"), "--curve-allow", str(allow))
    ctx = zmq.Context()
    vk = Valkey(valkey_url)
    server_key = certs["ingester"][0]
    try:
        engine = Publisher(ctx, endpoint, keys=certs["engine"], server_key=server_key)
        publish_until_indexed(engine, vk, "sim-0", proc)

        # A publisher whose key is not listed, one without CURVE, and one that does not know the
        # ingester's key: none of their batches may reach Valkey.
        intruder = Publisher(ctx, endpoint, keys=certs["intruder"], server_key=server_key)
        plain = Publisher(ctx, endpoint)
        wrong_server = Publisher(ctx, endpoint, keys=certs["engine"], server_key=certs["intruder"][0])
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            intruder.publish("sim-0")  # would move sim-0's seq, or restart it
            intruder.publish("forged")
            plain.publish("forged-plain")
            wrong_server.publish("forged-wrong-key")
            time.sleep(0.05)
        publish_until_indexed(engine, vk, "sim-0", proc)  # the listed engine goes on
        assert vk.seq("sim-0") == engine.seqs["sim-0"] - 1
        assert set(vk.pods()) == {"sim-0"}
        scraped = httpx.get(metrics_url, timeout=5).text
        assert metric(scraped, "kvpf_ingest_publishers_refused_total") >= 1
        assert "is not in --curve-allow" in log.read_text()
        assert proc.poll() is None
    finally:
        ctx.destroy(linger=0)
        vk.close()
        stop(proc)


def test_curve_server_key_reaches_an_engine_that_is_a_curve_server(valkey_url, tmp_path):
    """An engine that binds a CURVE server PUB: `--source ...,curve_server_key=KEY` subscribes; a source
    that names another key gets nothing."""
    certs = certificates(tmp_path, "engine", "other")
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    vk = Valkey(valkey_url)
    engine = Publisher(ctx, f"tcp://127.0.0.1:{port}", keys=certs["engine"], bind=True, curve_server=True)
    good, _, _ = spawn_ingester(valkey_url, tmp_path, "--source",
                                f"{endpoint},curve_server_key={certs['engine'][0].decode()}")
    wrong, _, wrong_log = spawn_ingester(valkey_url, tmp_path, "--source",
                                         f"{endpoint},curve_server_key={certs['other'][0].decode()}")
    try:
        publish_until_indexed(engine, vk, "secure-0", good)
        stop(good)  # from here only the ingester with the wrong key listens
        before = vk.seq("secure-0")
        for _ in range(20):
            engine.publish("secure-0")
            time.sleep(0.05)
        time.sleep(0.5)
        assert vk.seq("secure-0") == before
        assert wrong.poll() is None and "secure-0" not in wrong_log.read_text()
        # the failing handshake is retried with backoff (0.1 s doubling to 5 s), not in a tight loop
        assert wrong_log.read_text().count("handshake failed") <= 3
    finally:
        ctx.destroy(linger=0)
        vk.close()
        stop(good)
        stop(wrong)


def test_pods_allowlist_drops_a_forged_pods_frames(valkey_url, tmp_path):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc, metrics_url, log = spawn_ingester(valkey_url, tmp_path, "--bind", f"{endpoint},pods=sim-0@sim-1")
    ctx = zmq.Context()
    vk = Valkey(valkey_url)
    try:
        pub = Publisher(ctx, endpoint)
        publish_until_indexed(pub, vk, "sim-0", proc)
        forged = 25
        for _ in range(forged):
            pub.publish("sim-9")
        publish_until_indexed(pub, vk, "sim-1", proc)  # same socket, in order: the forged frames came first
        assert set(vk.pods()) == {"sim-0", "sim-1"}
        scraped = httpx.get(metrics_url, timeout=5).text
        assert metric(scraped, "kvpf_ingest_frames_refused_total", endpoint=endpoint) == forged
        assert vk.counters().get("frames_refused") == forged
        assert "'sim-9' is not in its pods= allowlist" in log.read_text()
        assert proc.poll() is None
    finally:
        ctx.destroy(linger=0)
        vk.close()
        stop(proc)


def test_an_engine_found_through_engine_may_write_only_for_the_pod_it_announced(valkey_url, tmp_path):
    """A rogue engine given with --engine announces pod ``rogue`` in /kv_event_sources and publishes topic
    ``kv@sim-0@sim`` with sim-0's next seq. Its frames were written into sim-0 (blocks sim-0 never held, answered
    as exact; sim-0's next real batch then looked like a restart and cleared it), unlogged and uncounted. Now
    every source found through --engine has its announced pod as its pods= list: the forged frames are refused,
    logged and counted, and sim-0's index stays exactly what sim-0 published (its replay vs the index)."""
    from tests.integration.engine_stub import EngineStub
    from tests.integration.http_engine import HttpEngine
    from tests.integration.sim import sim_engine
    from tests.integration.truth import engine_truth, index_state
    from kv_preflight.cli.accuracy import shared_prefix_workload

    def serve(prompts: list[dict]) -> None:
        for p in prompts:
            r = httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": p["token_ids"],
                                                                 "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text

    zport, rport = free_port(), free_port()
    stub = EngineStub(f"tcp://*:{zport}", f"tcp://*:{rport}", "kv@sim-0@sim", bind=True)
    rogue = HttpEngine("rogue", ["sim"], kv_event_sources={"0": {
        "endpoint": f"tcp://*:{zport}", "replay_endpoint": f"tcp://*:{rport}", "topic": "kv@rogue@sim"}}).start()
    engine = sim_engine("sim-0", tmp_path).start()
    proc, metrics_url, log = spawn_ingester(valkey_url, tmp_path, "--engine", engine.url, "--engine", rogue.url)
    vk = Valkey(valkey_url)
    try:
        work = shared_prefix_workload(n=6, seed=21, block=16)
        serve(work[:3])
        deadline = time.monotonic() + 30
        while vk.seq("sim-0") < len(engine.published()) - 1:
            assert time.monotonic() < deadline, "sim-0 was not ingested"
            time.sleep(0.05)
        stub.count_subscriptions()
        deadline = time.monotonic() + 30
        while stub.subscriptions < 1:  # the ingester subscribed to the rogue too
            assert time.monotonic() < deadline, "the rogue engine was never subscribed to"
            time.sleep(0.05)
            stub.count_subscriptions()
        forged = 0
        for _ in range(20):  # sim-0's next seq each time, as /stats shows it
            stub.seq = vk.seq("sim-0") + 1
            stub.publish(EventBatch(time.time() + 60, [BlockStored([777000 + forged], None, [5 + forged] * 16, 16,
                                                                   medium="GPU", group_idx=0, extra_keys=[None])], 0))
            forged += 1
            time.sleep(0.05)
        deadline = time.monotonic() + 20
        while metric(httpx.get(metrics_url, timeout=5).text, "kvpf_ingest_frames_refused_total") < forged:
            assert time.monotonic() < deadline, "the forged frames were not refused"
            time.sleep(0.1)
        assert "'sim-0' is not in its pods= allowlist" in log.read_text()
        serve(work[3:])  # sim-0 goes on: no restart, no clear
        published = engine.published()
        deadline = time.monotonic() + 30
        while vk.seq("sim-0") < len(published) - 1:
            assert time.monotonic() < deadline, "sim-0's later batches were not applied"
            time.sleep(0.05)
        held = vk.loop.run_until_complete(index_state(vk.ix, "sim-0"))
        assert held == engine_truth(published)
        info = vk.loop.run_until_complete(vk.ix.meta.pod_info("sim-0"))
        assert not info.incomplete and not info.counters.get("restarts") and not info.counters.get("cleared")
        assert proc.poll() is None
    finally:
        vk.close()
        stop(proc)
        engine.stop()
        rogue.stop()
        stub.close()


def test_two_sources_publishing_one_pod_keep_it_the_first_ones(valkey_url, tmp_path):
    """Two replicas given one topic pod id (``kv@sim-dup@sim``), each given with its own --source: their batches
    went into one pod as one seq (each a restart or a gap of the other's: clears, replays, blocks of one replica
    missing, the pod answered as exact), unnoticed, pod_conflicts 0. Now the socket that published the pod first
    keeps it; the other's frames are refused, logged, counted (frames_refused, and one pod_conflict), and the pod
    ends exactly what the first replica published (its replay vs the index), never flagged, never cleared."""
    from tests.integration.sim import sim_engine
    from tests.integration.truth import engine_truth, index_state
    from kv_preflight.cli.accuracy import shared_prefix_workload

    first, second = sim_engine("sim-dup", tmp_path / "a"), sim_engine("sim-dup", tmp_path / "b")
    for e, d in ((first, "a"), (second, "b")):
        (tmp_path / d).mkdir()
        e.start()
    sources = [f"tcp://127.0.0.1:{e.zmq_port},replay=tcp://127.0.0.1:{e.replay_port}" for e in (first, second)]
    proc, metrics_url, log = spawn_ingester(valkey_url, tmp_path, "--source", sources[0], "--source", sources[1])
    vk = Valkey(valkey_url)

    def serve(engine, prompts: list[dict]) -> None:
        for p in prompts:
            r = httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": p["token_ids"],
                                                                 "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text

    def applied(engine) -> list:
        published = engine.published()
        deadline = time.monotonic() + 30
        while vk.seq("sim-dup") < len(published) - 1:
            assert time.monotonic() < deadline, f"sim-dup did not reach seq {len(published) - 1}"
            time.sleep(0.05)
        return published

    try:
        work = shared_prefix_workload(n=12, seed=33, block=16)
        serve(first, work[:2])
        applied(first)
        deadline = time.monotonic() + 30
        while metric(httpx.get(metrics_url, timeout=5).text, "kvpf_ingest_pod_conflicts_total") < 1:
            serve(second, work[6:7])  # its first batches reach the ingester once its SUB has joined
            assert time.monotonic() < deadline, "the second publisher's frames were never refused"
        for a, b in zip(work[2:6], work[7:11]):  # interleaved from here on
            serve(first, [a])
            serve(second, [b])
        published = applied(first)
        scraped = httpx.get(metrics_url, timeout=5).text
        assert metric(scraped, "kvpf_ingest_pod_conflicts_total") == 1
        refused = metric(scraped, "kvpf_ingest_frames_refused_total", endpoint=sources[1].split(",")[0])
        assert refused >= 5, scraped
        assert vk.counters().get("pod_conflicts") == 1
        assert "'sim-dup' rank 0 is already published by" in log.read_text()
        assert vk.loop.run_until_complete(index_state(vk.ix, "sim-dup")) == engine_truth(published)
        info = vk.loop.run_until_complete(vk.ix.meta.pod_info("sim-dup"))
        assert not info.incomplete and info.counters["batches"] == len(published)
        assert not info.counters.get("restarts") and not info.counters.get("cleared")
        assert proc.poll() is None
    finally:
        vk.close()
        stop(proc)
        first.stop()
        second.stop()
