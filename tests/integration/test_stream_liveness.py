"""An event stream that goes dead without a word, with real processes: a simulated vLLM engine
(``kv-preflight simulate``), a real ingester and predictor, and a TCP proxy between the engine's PUB and the
ingester's SUB (tests/integration/tcp_proxy.py) that turns the connection half-open (the engine's half reset, the
ingester's left open and silent: a NAT or conntrack drop) or partitions it.

Before: no ZMTP heartbeat and no keepalive, so the ingester never noticed; every new block was missing, answers
said ``exact`` with the pod ``current``, and a half-open stream never recovered without restarting the ingester.
Now the SUB's heartbeats (or, with them off, a probe of the engine's replay socket when the stream is silent past
its usual gap) find the stream dead, the pod reads ``behind`` until it is connected again and what it missed is
replayed, and the index ends exactly the engine's (its replay vs the index), with no ingester restart.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import SimEngine, sim_engine
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.truth import engine_truth, index_state
from tests.integration.waits import until
from tests.prom import metric

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

FAST = ["--zmq-heartbeat", "0.5", "--zmq-heartbeat-timeout", "2"]


class Stack:
    """An engine, a proxy in front of its PUB, an ingester subscribed through the proxy, a predictor."""

    def __init__(self, valkey_url: str, tmp_path, *ingest_args: str, pod: str = "sim-live"):
        self.engine: SimEngine = sim_engine(pod, tmp_path).start()
        self.proxy = TcpProxy(self.engine.zmq_port).start()
        self.mport, port = free_port(), free_port()
        source = f"{self.proxy.endpoint},replay=tcp://127.0.0.1:{self.engine.replay_port}"
        self.log = tmp_path / "ingest.log"
        self.ingester = spawn(["ingest", "--valkey-url", valkey_url, "--source", source, "--metrics-port",
                               str(self.mport), *ingest_args], str(self.log))
        self.predictor = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--engine-url",
                                f"sim={self.engine.url}"], str(tmp_path / "serve.log"))
        self.url = f"http://127.0.0.1:{port}"
        self.ix = Index.from_url(valkey_url)
        self.pod = pod
        wait_http(self.url + "/health")
        wait_http(f"http://127.0.0.1:{self.mport}/metrics")

    def serve(self, tokens: list[int]) -> int:
        """The engine serves a prompt; its cached tokens for it (before this request stored it)."""
        r = httpx.post(self.engine.url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1},
                       timeout=30)
        r.raise_for_status()
        return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    async def answer(self, tokens: list[int]) -> dict:
        got = await asyncio.to_thread(httpx.post, self.url + "/v1/cache/predict",
                                      json={"model": "sim", "token_ids": tokens}, timeout=10)
        assert got.status_code == 200, got.text
        return got.json()

    def metric(self, name: str) -> float:
        return metric(httpx.get(f"http://127.0.0.1:{self.mport}/metrics", timeout=5).text, name)

    async def exact(self, tokens: list[int], cached: int, what: str, timeout: float = 30.0) -> dict:
        """Until an answer for ``tokens`` says exact and predicts ``cached`` tokens."""
        async def right():
            doc = await self.answer(tokens)
            return doc["freshness"]["state"] == "exact" and doc["predicted_cached_tokens"] == cached and doc
        return await until(right, what, timeout)

    def pod_state(self, doc: dict) -> str:
        return doc["freshness"].get("pods", {}).get(self.pod, {}).get("state", "")

    async def assert_index_is_the_engines(self) -> None:
        published = self.engine.published()
        await until(lambda: self._reached(len(published) - 1), "the index at the engine's last seq")
        assert await index_state(self.ix, self.pod) == engine_truth(published)
        assert not (await self.ix.meta.pod_info(self.pod)).incomplete

    async def _reached(self, seq: int) -> bool:
        return (await self.ix.meta.pod_info(self.pod)).seqs.get("0", -1) >= seq

    async def close(self) -> None:
        stop(self.ingester)
        stop(self.predictor)
        self.proxy.stop()
        self.engine.stop()
        await self.ix.close()


def prompt(seed: int, blocks: int = 4) -> list[int]:
    """The first prompt's first 3 blocks, then blocks of its own: an answer for it names the pod (it holds 3 of
    its blocks from the start) whether or not the rest is indexed."""
    first = [1000 + i for i in range(16 * 3)]
    return first + [seed * 1000 + i for i in range(16 * (blocks - 3) + 3)] if seed != 1 else \
        first + [1000 + 48 + i for i in range(16 * (blocks - 3) + 3)]


def whole_blocks(tokens: list[int]) -> int:
    """The tokens a prompt served once leaves cached for itself: its whole blocks but the last token's."""
    return (len(tokens) - 1) // 16 * 16


async def warm(stack: Stack) -> None:
    first = prompt(1)
    stack.serve(first)
    await stack.exact(first, stack.serve(first), "the first prompt indexed")


async def test_a_half_open_stream_is_noticed_replayed_and_recovered_without_a_restart(valkey_url, tmp_path):
    """The proxy resets the engine's half of the connection and keeps the ingester's open and silent. The SUB's
    heartbeats go unanswered, it closes the connection and connects again (the path is fine), and what the pod
    missed meanwhile is replayed at once, with the engine quiet: the prompt served after the cut is predicted
    exactly, no ingester restart."""
    stack = Stack(valkey_url, tmp_path, *FAST)
    try:
        await warm(stack)
        stack.proxy.half_open()
        second = prompt(2)
        stack.serve(second)  # published while the connection is half-open: it reaches nobody; then the engine is quiet
        await stack.exact(second, whole_blocks(second), "the prompt served during the half-open connection indexed")
        assert stack.metric("kvpf_ingest_stream_drops_total") >= 1
        assert "connected again after a stream went down" in stack.log.read_text()
        await stack.assert_index_is_the_engines()
        assert stack.ingester.poll() is None
    finally:
        await stack.close()


async def test_a_partition_reads_behind_while_it_lasts_and_heals(valkey_url, tmp_path):
    """A plain partition (both halves open, nothing passes, new connections held): the heartbeats close the
    connection and the reconnection cannot finish, so the pod reads ``behind`` and no answer says ``exact`` while
    it lasts (before: ``exact``, the pod ``current``, the new prompt predicted 0). Healed, the pod is replayed and
    exact again."""
    stack = Stack(valkey_url, tmp_path, *FAST)
    try:
        await warm(stack)
        stack.proxy.blackhole()
        second = prompt(3)
        stack.serve(second)
        cached = whole_blocks(second)

        async def behind():
            doc = await stack.answer(second)
            return stack.pod_state(doc) in ("behind", "stalled") and doc["freshness"]["state"] == "degraded" and doc
        await until(behind, "the pod read behind during the partition", timeout=20)
        deadline = time.monotonic() + 4  # it stays so while the partition lasts
        while time.monotonic() < deadline:
            doc = await stack.answer(second)
            assert doc["freshness"]["state"] != "exact", doc
            await asyncio.sleep(0.2)
        stack.proxy.pass_()
        await stack.exact(second, cached, "the prompt served during the partition indexed once it healed")
        await stack.assert_index_is_the_engines()
        assert stack.ingester.poll() is None
    finally:
        await stack.close()


async def test_with_heartbeats_off_a_silent_dead_stream_is_found_by_its_replay_socket(valkey_url, tmp_path):
    """Heartbeats off (--zmq-heartbeat 0): the half-open connection looks alive to libzmq. The stream is silent
    past its usual gap, so the engine's replay socket is asked for the next seq; it holds batches that never came,
    so the stream is dead: connected again, its pod replayed (counted: kvpf_ingest_streams_dead_total)."""
    stack = Stack(valkey_url, tmp_path, "--zmq-heartbeat", "0", "--silence-probe", "2")
    try:
        await warm(stack)
        stack.proxy.half_open()
        second = prompt(4)
        stack.serve(second)
        await stack.exact(second, whole_blocks(second), "the prompt served during the half-open connection indexed", timeout=40)
        assert stack.metric("kvpf_ingest_streams_dead_total") >= 1
        await stack.assert_index_is_the_engines()
        assert stack.ingester.poll() is None
    finally:
        await stack.close()


async def test_a_half_open_stream_of_an_engine_that_connects_to_a_bound_ingester(valkey_url, tmp_path):
    """vLLM connects its PUB when its endpoint names a host (``--bind`` on our side). The proxy drops what the engine
    sends, then resets the engine's half of the connection and keeps the ingester's open and silent; the engine
    connects again at once, a new connection beside the dead one. The bound SUB's heartbeats close the dead one, and
    the publisher that connected again has its pod replayed: what was lost on the dead connection is indexed, the
    engine quiet (before: only once the engine published again and the gap showed)."""
    from tests.e2e.harness import spawn as spawn_cli

    bind_port, http_port, replay_port = free_port(), free_port(), free_port()
    mport, port = free_port(), free_port()
    log = tmp_path / "ingest.log"
    ingester = spawn(["ingest", "--valkey-url", valkey_url, "--bind",
                      f"tcp://127.0.0.1:{bind_port},replay=tcp://127.0.0.1:{replay_port}", "--metrics-port", str(mport),
                      *FAST], str(log))
    wait_http(f"http://127.0.0.1:{mport}/metrics")
    proxy = TcpProxy(bind_port).start()
    engine = SimEngine("sim-bound", f"http://127.0.0.1:{http_port}", proxy.port, replay_port,
                       log=str(tmp_path / "sim.log"))
    engine.proc = spawn_cli(["simulate", "--pod", "sim-bound", "--model", "sim", "--port", str(http_port),
                             "--zmq", proxy.endpoint, "--replay", f"tcp://*:{replay_port}", "--block-size", "16",
                             "--blocks", "64"], engine.log)
    wait_http(engine.url + "/v1/models")
    predictor = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--engine-url", f"sim={engine.url}"],
                      str(tmp_path / "serve.log"))
    stack = Stack.__new__(Stack)
    stack.engine, stack.proxy, stack.mport, stack.log, stack.ingester, stack.predictor = (
        engine, proxy, mport, log, ingester, predictor)
    stack.url, stack.ix, stack.pod = f"http://127.0.0.1:{port}", Index.from_url(valkey_url), "sim-bound"
    try:
        wait_http(stack.url + "/health")
        first = prompt(1)

        async def indexed_first():  # the engine's first frames go out before its connection is up: published again
            cached = stack.serve(first)
            doc = await stack.answer(first)
            return cached and doc["freshness"]["state"] == "exact" and doc["predicted_cached_tokens"] == cached
        await until(indexed_first, "the first prompt indexed")
        await until(lambda: asyncio.to_thread(lambda: stack.proxy.live_connections() == 1), "one live connection")
        # A middlebox that lost the connection's state drops what the engine sends into it until the engine learns
        # so (an RST to its next segment, or a timeout): a connecting PUB queues only what it sends after that
        stack.proxy.blackhole()
        second = prompt(5)
        stack.serve(second)
        stack.proxy.half_open(keep="up")
        stack.proxy.pass_()
        await stack.exact(second, whole_blocks(second), "the prompt served during the half-open connection indexed")
        await stack.assert_index_is_the_engines()
        assert ingester.poll() is None
    finally:
        await stack.close()
