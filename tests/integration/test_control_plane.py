"""The control plane cannot be knocked over (issue 26), with real processes: ``kv-preflight ingest``
processes, simulated engines (``kv-preflight simulate``), a real predictor with the remote-indexer port, a
real valkey-server. Registrations, discovery answers and endpoint strings that no socket can use are refused
per engine (400 at ``/register``, a logged and counted refusal in an ingester), never the end of an ingester;
a registered engine is a named source (its frames need no topic)."""
from __future__ import annotations

import asyncio
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.fleet.records import RegisteredEngine, encode
from kv_preflight.index.index import Index
from kv_preflight.index.layout import EPOCH_KEY
from tests.e2e.harness import spawn, stop, wait_http, wait_log
from tests.integration import waits
from tests.integration.unlisted import unlisted_pods

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

FAST_ENV = {"KVPF_DISCOVERY_INTERVAL_S": "0.3"}
_STARTED: list = []  # every process a test here started, stopped after it whatever happened


@pytest.fixture(autouse=True)
def _stop_what_was_started():
    yield
    while _STARTED:
        stop(_STARTED.pop())


def _started(proc):
    _STARTED.append(proc)
    return proc
FAST = ["--lease-ttl", "3", "--membership-hold", "0", "--health-failures", "2"]


until = functools.partial(waits.until, timeout=30.0)


def ingester(valkey_url: str, log: str, *args: str, env: dict[str, str] | None = None, nofile: int | None = None):
    if nofile is None:
        return _started(spawn(["ingest", "--valkey-url", valkey_url, *FAST, *args], log,
                              env={**FAST_ENV, **(env or {})}))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    out = open(log, "w")
    return _started(subprocess.Popen(
        [sys.executable, "-m", "kv_preflight", "ingest", "--valkey-url", valkey_url, *FAST, *args],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limit,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **FAST_ENV, **(env or {}))))


class Sim:
    """A simulated engine; ``topic=""`` publishes with vLLM's default empty topic, as Dynamo's workers do."""

    def __init__(self, pod: str, tmp_path, *, topic: str | None = None, zmq: str | None = None):
        self.pod, self.port, self.zmq_port, self.replay_port = pod, free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.zmq = zmq or f"tcp://*:{self.zmq_port}"
        args = ["simulate", "--pod", pod, "--model", "sim", "--port", str(self.port), "--zmq", self.zmq,
                "--replay", f"tcp://*:{self.replay_port}", "--block-size", "16", "--blocks", "64"]
        if topic is not None:
            args += ["--topic", topic]
        self.log = str(tmp_path / f"{pod}.log")
        self.proc = _started(spawn(args, self.log))
        wait_http(self.url + "/v1/models")

    def complete(self, tokens: list[int]) -> int:
        r = httpx.post(self.url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1}, timeout=10)
        r.raise_for_status()
        return r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    def stop(self) -> None:
        stop(self.proc)


def dynamo_server(valkey_url: str, tmp_path, *args: str, env: dict[str, str] | None = None):
    port, dport = free_port(), free_port()
    proc = _started(spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--dynamo-port", str(dport),
                           *args], str(tmp_path / "serve.log"), env=env))
    wait_http(f"http://127.0.0.1:{dport}/health")
    return proc, f"http://127.0.0.1:{dport}", f"http://127.0.0.1:{port}"


def register_body(instance: int, endpoint: str, **extra) -> dict:
    return {"instance_id": instance, "endpoint": endpoint, "model_name": "sim", "block_size": 16, **extra}


async def ingested(ix: Index, pod: str) -> bool:
    return pod in await ix.meta.pod_ids() and (await ix.meta.pod_info(pod)).blocks > 0


async def register_until_ingested(c: httpx.AsyncClient, ix: Index, sim: Sim, instance: int) -> None:
    """Register a simulator as Dynamo worker ``instance`` (pod dynamo-<instance>) and have it publish until its
    pod is in the index."""
    r = await c.post("/register", json=register_body(
        instance, f"tcp://127.0.0.1:{sim.zmq_port}", replay_endpoint=f"tcp://127.0.0.1:{sim.replay_port}"))
    assert r.status_code == 201, r.text

    async def published():
        await asyncio.to_thread(sim.complete, list(range(64)))
        return await ingested(ix, f"dynamo-{instance}")

    await until(published, f"registered worker {instance} ingested")


def alive(*procs) -> list[int | None]:
    return [p.poll() for p in procs]


async def test_bad_endpoints_are_refused_and_never_end_an_ingester(valkey_url, tmp_path):
    """Finding 1: an endpoint with a trailing newline, or an ipc:// path over 107 bytes, was accepted by
    /register (201) and ended every ingester at its next round, for good (the record stays). Now /register
    answers 400, and the same records written straight into kvpf:engines are skipped, logged and counted by
    ingesters that go on ingesting a good registration beside them."""
    ings = [ingester(valkey_url, str(tmp_path / f"ing{i}.log"), "--copies", "1", "--ingester-id", f"ing-{i}")
            for i in range(2)]
    serve, dyn, _ = dynamo_server(valkey_url, tmp_path)
    sim = Sim("dynamo-sim", tmp_path, topic="")  # Dynamo's workers publish with vLLM's empty topic
    ix = Index.from_url(valkey_url)
    bad = ["tcp://127.0.0.1:5557\n", "ipc:///tmp/" + "x" * 120, "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000",
           "tcp://127.0.0.1:5557 ", "tcp://bad host:5557"]
    try:
        async with httpx.AsyncClient(base_url=dyn, timeout=10) as c:
            for i, endpoint in enumerate(bad):
                r = await c.post("/register", json=register_body(100 + i, endpoint))
                assert r.status_code == 400, (endpoint, r.status_code, r.text)
                r = await c.post("/register", json=register_body(200 + i, f"tcp://127.0.0.1:{sim.zmq_port}",
                                                                 replay_endpoint=endpoint))
                assert r.status_code == 400 and "replay" in r.json()["error"], (endpoint, r.text)
            # what an older API or a hand wrote: the ingesters must survive it too
            now = await ix.fleet.now_ms()
            for i, endpoint in enumerate(bad):
                await ix.fleet.register_engine(f"dynamo:{300 + i}:0", RegisteredEngine(
                    source=endpoint, pod=f"dynamo-{300 + i}", model="sim", engine="vllm", instance_id=300 + i,
                    registered_ms=now, block_size=16))
            r = await c.post("/register", json=register_body(
                7, f"tcp://127.0.0.1:{sim.zmq_port}", replay_endpoint=f"tcp://127.0.0.1:{sim.replay_port}"))
            assert r.status_code == 201, r.text
            await asyncio.to_thread(sim.complete, list(range(64)))
            # Finding 10: frames with an empty topic from a registered engine are its pod's
            await until(lambda: ingested(ix, "dynamo-7"), "the registered engine's pod in the index")
            r = await c.post("/query", json={"token_ids": list(range(64)), "model_name": "sim"})
            assert r.status_code == 200 and r.json()["scores"]["7"]["0"] == 64, r.text
        assert alive(*ings) == [None, None]
        logs = "".join(open(tmp_path / f"ing{i}.log").read() for i in range(2))
        assert "registered engine dynamo:300:0 skipped" in logs
        assert "Invalid argument" not in logs and "Traceback" not in logs
    finally:
        await ix.close()
        for p in ings:
            stop(p)
        stop(serve)
        sim.stop()


async def test_two_engines_asking_to_be_bound_at_one_address(valkey_url, tmp_path):
    """Finding 6: two engines that connect to the same ingester address (their /kv_event_sources say so)
    made the ingester bind tcp://*:PORT twice: "Address already in use", fatal. Now the second is refused
    alone (logged with its URL, counted, retried) and the first is ingested; once the first engine is gone
    (stopped, retired, its address let go) a retry of the second succeeds and it is ingested."""
    port = free_port()
    a = Sim("bind-a", tmp_path, zmq=f"tcp://127.0.0.1:{port}")
    b = Sim("bind-b", tmp_path, zmq=f"tcp://127.0.0.1:{port}")
    log = str(tmp_path / "ing.log")
    ing = ingester(valkey_url, log, "--engine", a.url, "--engine", b.url, "--metrics-port", str(mport := free_port()),
                   "--retire-after", "2")
    ix = Index.from_url(valkey_url)
    try:
        got = wait_log(log, "already bound here", ing)
        assert "not ingested" in got
        first = next(s for s in (a, b) if f"engine {s.url}: ingesting" in open(log).read())

        async def publish_and_look():  # a connecting PUB drops what it sends before its connection is up
            await asyncio.to_thread(first.complete, list(range(48)))
            return await ingested(ix, first.pod)

        await until(publish_and_look, "the first engine ingested")
        metrics = httpx.get(f"http://127.0.0.1:{mport}/metrics").text
        assert 'kvpf_ingest_engine_errors_total{step="attach"}' in metrics
        second = b if first is a else a
        first.stop()

        # its frames may come in on the first's bound socket meanwhile (a connecting PUB finds whoever binds the
        # address): what is awaited is the ingester attaching the second engine itself, a retry that succeeded
        wait_log(log, f"engine {second.url}: ingesting", ing, timeout_s=90)

        async def second_published_and_looked():
            await asyncio.to_thread(second.complete, list(range(48, 96)))
            return await ingested(ix, second.pod)

        await until(second_published_and_looked, "the second engine ingested once the first let the address go")
        assert ing.poll() is None
    finally:
        await ix.close()
        stop(ing)
        a.stop()
        b.stop()


async def test_registrations_past_the_socket_budget_are_refused_not_fatal(valkey_url, tmp_path):
    """Finding 2: ~340 registrations exhausted sockets (Too many open files) and the ingester died before
    ingesting anything, and again after each restart. With an open-file limit of 256 and 120 registrations,
    the ingester subscribes what its budget allows (``source_cap``), refuses the rest (logged, counted) and
    ingests its own --source beside them."""
    sim = Sim("budget-sim", tmp_path)
    ix = Index.from_url(valkey_url)
    now = await ix.fleet.now_ms()
    for i in range(120):  # nobody listens on these: connecting is asynchronous, each still costs sockets
        await ix.fleet.register_engine(f"dynamo:{1000 + i}:0", RegisteredEngine(
            source=f"tcp://127.0.0.1:{20000 + i}", pod=f"dynamo-{1000 + i}", model="sim", engine="vllm",
            instance_id=1000 + i, registered_ms=now, block_size=16))
    log = str(tmp_path / "ing.log")
    ing = ingester(valkey_url, log, "--source", f"tcp://127.0.0.1:{sim.zmq_port},replay=tcp://127.0.0.1:{sim.replay_port}",
                   nofile=256)
    try:
        got = wait_log(log, "the cap is", ing)
        assert "Too many open files" not in got
        await asyncio.to_thread(sim.complete, list(range(48)))
        await until(lambda: ingested(ix, "budget-sim"), "the engine ingested beside the registrations")
        assert ing.poll() is None
    finally:
        await ix.close()
        stop(ing)
        sim.stop()


_ENDPOINT_PARTS = st.sampled_from(["tcp://", "ipc://", "inproc://", "udp://", "tcp://127.0.0.1:", "tcp://[::1]:",
                                   "tcp://*:", "ipc:///tmp/", "", "tcp://localhost:"])
_ENDPOINT_TAILS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=140)
ENDPOINTS = st.one_of(
    st.builds(lambda a, b: a + b, _ENDPOINT_PARTS, _ENDPOINT_TAILS),
    st.builds(lambda p, s: f"tcp://127.0.0.1:{p}{s}", st.integers(-5, 99999), st.sampled_from(["", "\n", " ", "\x00", "/x"])),
    st.builds(lambda n: "ipc:///tmp/" + "p" * n, st.integers(90, 130)),
)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
                    max_leaves=8)
BODIES = st.one_of(
    st.builds(lambda i, e, r, m, b, d: {"instance_id": i, "endpoint": e, "replay_endpoint": r, "model_name": m,
                                        "block_size": b, "dp_rank": d},
              st.integers(0, 2**64), ENDPOINTS, ENDPOINTS | st.none(), st.text(max_size=300), st.integers(-1, 2**33),
              st.integers(-1, 2**33) | st.none()),
    st.dictionaries(st.sampled_from(["instance_id", "endpoint", "model_name", "block_size", "dp_rank",
                                     "routing_group", "replay_endpoint"]), JSON, max_size=7),
)


async def test_fuzzed_registrations_never_end_an_ingester(valkey_url, tmp_path):
    """Hypothesis over /register bodies and endpoint strings against live ingesters, and the same endpoint
    strings written straight into kvpf:engines: no ingester exits, /register answers 201 only for what an
    ingester can use (4xx otherwise, never 5xx), and a good engine registered last is ingested."""
    ings = [ingester(valkey_url, str(tmp_path / f"ing{i}.log"), "--copies", "1", "--ingester-id", f"fz-{i}")
            for i in range(2)]
    serve, dyn, _ = dynamo_server(valkey_url, tmp_path)
    sim = Sim("fuzz-sim", tmp_path, topic="")
    ix = Index.from_url(valkey_url)
    statuses: list[int] = []
    raw = redis.Redis.from_url(valkey_url)
    try:
        with httpx.Client(base_url=dyn, timeout=10) as c:
            counter = iter(range(10**6))

            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
            @given(body=BODIES, endpoint=ENDPOINTS)
            def one(body, endpoint):
                r = c.post("/register", json=body)
                statuses.append(r.status_code)
                assert r.status_code < 500, (body, r.text)
                if r.status_code == 201:
                    c.post("/unregister", json={"instance_id": body["instance_id"], "model_name": body["model_name"]})
                n = next(counter)
                raw.hset("kvpf:engines", f"dynamo:{5000 + n}:0", encode(RegisteredEngine(
                    source=endpoint, pod=f"dynamo-{5000 + n}", model="sim", engine="vllm", instance_id=5000 + n,
                    registered_ms=0, block_size=16)))
                assert alive(*ings) == [None, None]

            await asyncio.to_thread(one)
            r = c.post("/register", json=register_body(
                9, f"tcp://127.0.0.1:{sim.zmq_port}", replay_endpoint=f"tcp://127.0.0.1:{sim.replay_port}"))
            assert r.status_code == 201, r.text
        await asyncio.to_thread(sim.complete, list(range(48)))
        await until(lambda: ingested(ix, "dynamo-9"), "the good registration ingested after the fuzz", timeout=60)
        assert alive(*ings) == [None, None]
        assert 400 in statuses
    finally:
        raw.close()
        await ix.close()
        for p in ings:
            stop(p)
        stop(serve)
        sim.stop()


async def test_dead_replay_endpoints_hold_up_neither_ingestion_nor_the_lease(valkey_url, tmp_path):
    """Finding 3: twenty registrations whose replay endpoint never answers froze ingestion for every pod
    (each attach waited its replay timeout in turn, inside the round the ingest loop waits on) and the lease
    went unrenewed. With a replay timeout of 60 s: while every one of those replays is still waiting (none
    has logged its answer), a live engine's batches are applied and the lease is renewed, again and again."""
    sim = Sim("live-sim", tmp_path)
    log = str(tmp_path / "ing.log")
    ing = ingester(valkey_url, log, "--engine", sim.url, "--ingester-id", "slow-1",
                   env={"KVPF_REPLAY_TIMEOUT_S": "60"})
    ix = Index.from_url(valkey_url)
    try:
        wait_log(log, f"engine {sim.url}: ingesting", ing)
        now = await ix.fleet.now_ms()
        for i in range(20):  # nothing listens on the replay ports: each fetch waits its whole timeout
            await ix.fleet.register_engine(f"dynamo:{700 + i}:0", RegisteredEngine(
                source=f"tcp://127.0.0.1:{free_port()}", replay=f"tcp://127.0.0.1:{free_port()}",
                pod=f"dynamo-{700 + i}", model="sim", engine="vllm", instance_id=700 + i, registered_ms=now,
                block_size=16))
        wait_log(log, "engine tcp://127.0.0.1", ing)
        await until(lambda: _attached_all(log, 20), "the twenty registrations attached")
        leases = []

        async def applied_and_renewed():
            await asyncio.to_thread(sim.complete, list(range(16 * (len(leases) + 2))))
            leases.append((await ix.fleet.fleet_view()).ingesters["slow-1"].expires_ms)
            return await ingested(ix, "live-sim") and len(set(leases)) >= 3

        await until(applied_and_renewed, "the live engine ingested and the lease renewed")
        assert "resume dynamo-7" not in open(log).read()  # every dead replay still waiting meanwhile
        assert ing.poll() is None
    finally:
        await ix.close()
        stop(ing)
        sim.stop()


async def _attached_all(log: str, n: int) -> bool:
    return open(log).read().count("ingesting pod(s) ['dynamo-7") >= n


async def test_unregister_of_a_worker_that_still_publishes_leaves_no_zombie(valkey_url, tmp_path):
    """Finding 4: /unregister of a worker that still publishes cleared and forgot its pod while an ingester
    still owned it; its next batch made it a pod again that no listing showed (registry row gone, the
    ingester's registry cache never wrote it back), which /route then picked. Now every ingester lets the pod
    go before its keys go, refuses its frames, and no key is left of a pod that no listing shows."""
    ing = ingester(valkey_url, str(tmp_path / "ing.log"), "--ingester-id", "zz-1")
    serve, dyn, pred = dynamo_server(valkey_url, tmp_path)
    # topics naming the registered pods (kv@dynamo-11@sim), so this test needs nothing of finding 10's fix
    sim = Sim("dynamo-11", tmp_path)
    control = Sim("dynamo-12", tmp_path)
    ix = Index.from_url(valkey_url)
    raw = redis.Redis.from_url(valkey_url)
    try:
        async with httpx.AsyncClient(base_url=dyn, timeout=30) as c:
            await register_until_ingested(c, ix, sim, 11)
            await register_until_ingested(c, ix, control, 12)
            r = await c.post("/unregister", json={"instance_id": 11, "model_name": "sim"})
            assert r.status_code == 200, r.text
        for n in range(4):  # the worker goes on publishing, new blocks each time
            await asyncio.to_thread(sim.complete, list(range(1000 + 64 * n, 1064 + 64 * n)))
        # then a worker still registered publishes: once its batch is in, the ingester has read past the others
        before = (await ix.meta.pod_info("dynamo-12")).blocks

        async def control_moved():
            await asyncio.to_thread(control.complete, list(range(7000, 7064)))
            return (await ix.meta.pod_info("dynamo-12")).blocks > before

        await until(control_moved, "the still-registered worker's next batch ingested")
        assert "dynamo-11" not in await ix.meta.pod_ids()
        assert unlisted_pods(valkey_url) == set()
        route = httpx.post(pred + "/v1/cache/route", json={"model": "sim", "token_ids": list(range(64))}, timeout=10)
        assert "dynamo-11" not in route.text
        assert ing.poll() is None
    finally:
        raw.close()
        await ix.close()
        stop(ing)
        stop(serve)
        sim.stop()
        control.stop()


async def test_clear_forget_of_a_source_that_still_publishes_brings_it_back_listed(valkey_url, tmp_path):
    """Issue 26 for an engine given by ``--source`` with no replay socket: ``index clear --forget`` while it
    publishes, then its next batch (a gap, forced: nothing can replay it). The ingester refused the pod's
    frames while it was being forgotten but kept the registry row and number it had cached (only an attached
    engine's pods were dropped from that cache), and the apply script's check for a pod with no number never
    answered (HMGET's false compared with nil): the forced batch wrote the pod's meta, state and bits under
    its freed number with no registry row, a pod that no listing showed until the cached row was 10 s old.
    Now it comes back listed and numbered like any other, its meta naming the number it has."""
    pod, zmq = "src-sim", free_port()
    port = free_port()
    _started(spawn(["simulate", "--pod", pod, "--model", "sim", "--port", str(port), "--zmq", f"tcp://*:{zmq}",
                    "--replay", "none", "--block-size", "16", "--blocks", "64"], str(tmp_path / "sim.log")))
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/v1/models")
    ing = ingester(valkey_url, str(tmp_path / "ing.log"), "--source", f"tcp://127.0.0.1:{zmq}",
                   "--ingester-id", "src-1")
    ix = Index.from_url(valkey_url)
    raw = redis.Redis.from_url(valkey_url, decode_responses=True)
    prompts = iter(range(10**6))

    async def publish() -> None:
        n = next(prompts)
        body = {"model": "sim", "prompt": list(range(64 * n, 64 * n + 64)), "max_tokens": 1}
        got = await asyncio.to_thread(httpx.post, url + "/v1/completions", json=body, timeout=10)
        got.raise_for_status()

    async def published_and_ingested():
        await publish()
        return await ingested(ix, pod)

    async def published_and_back():  # frames are refused until the ingester sees the forget is over
        await publish()
        return int(raw.hget(f"kvpf:{{{pod}}}:meta", "blocks") or 0) > 0

    try:
        await until(published_and_ingested, "the source's pod ingested")
        got = await asyncio.to_thread(subprocess.run, [
            sys.executable, "-m", "kv_preflight", "index", "clear", "--valkey-url", valkey_url, "--pod", pod, "--forget"],
            capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        assert pod not in raw.hkeys("kvpf:registry") and unlisted_pods(valkey_url) == set()
        await until(published_and_back, "the pod's next batch applied")
        assert unlisted_pods(valkey_url) == set()
        assert pod in raw.hkeys("kvpf:registry")
        assert raw.hget(f"kvpf:{{{pod}}}:meta", "num") == raw.hget("kvpf:{nums}:byname", pod) is not None
        assert ing.poll() is None
    finally:
        raw.close()
        await ix.close()
        stop(ing)


async def test_valkey_losing_its_data_is_noticed_and_the_registry_rebuilt(valkey_server, valkey_url, tmp_path):
    """Finding 5: after Valkey lost its data (kill -9, no persistence, restarted empty) the ingester restored
    the pods' keys by replay but the registry stayed empty (its in-process cache), so `index pods` said "no
    pods" and export exported nothing while predictions answered; a pod that could not be rebuilt was empty
    with no flag. Now the lost epoch is noticed: the registry is rebuilt, a pod whose engine still buffers its
    whole history is rebuilt exact, and one whose engine has no replay socket is flagged incomplete; and what
    lists the pods and their blocks agrees with the index again (`index export`, `index pods`, a predictor's
    `/stats`), which is what the issue found broken, not only the registry."""
    whole = Sim("whole-sim", tmp_path)
    port = free_port()
    # a simulated engine with no replay socket: what it published is lost for good
    bare_log = str(tmp_path / "bare.log")
    bare_proc = _started(spawn(["simulate", "--pod", "bare-sim", "--model", "sim", "--port", str(port), "--zmq",
                       f"tcp://*:{free_port()}", "--replay", "none", "--block-size", "16", "--blocks", "64"], bare_log))
    wait_http(f"http://127.0.0.1:{port}/v1/models")
    bare_url = f"http://127.0.0.1:{port}"
    log = str(tmp_path / "ing.log")
    ing = ingester(valkey_url, log, "--engine", whole.url, "--engine", bare_url)
    pred_port = free_port()
    _started(spawn(["serve", "--valkey-url", valkey_url, "--port", str(pred_port)], str(tmp_path / "serve.log")))
    pred = f"http://127.0.0.1:{pred_port}"
    wait_http(pred + "/stats")
    ix = Index.from_url(valkey_url)
    try:
        async def both_ingested():
            await asyncio.to_thread(whole.complete, list(range(64)))
            await asyncio.to_thread(lambda: httpx.post(bare_url + "/v1/completions", json={
                "model": "sim", "prompt": list(range(64)), "max_tokens": 1}, timeout=10).raise_for_status())
            return await ingested(ix, "whole-sim") and await ingested(ix, "bare-sim")

        await until(both_ingested, "both engines ingested")
        exported_before = await asyncio.to_thread(_exported, valkey_url, "whole-sim")
        epoch = redis.Redis.from_url(valkey_url).hget(EPOCH_KEY, "id")
        assert epoch
        valkey_server.proc.kill()
        valkey_server.proc.wait()
        for lost in ("appendonlydir", "dump.rdb"):  # as if it ran without persistence
            shutil.rmtree(valkey_server.data_dir / lost, ignore_errors=True)
            (valkey_server.data_dir / lost).unlink(missing_ok=True) if (valkey_server.data_dir / lost).is_file() else None
        valkey_server.start()
        # restarted empty (the ingester and the predictor may write again at once: no dbsize() == 0 here)
        assert redis.Redis.from_url(valkey_url).hget(EPOCH_KEY, "id") != epoch
        wait_log(log, "Valkey lost the index's data", ing)

        async def rebuilt():
            try:
                pods = await ix.meta.pod_ids()
                infos = {i.pod_id: i for i in await ix.meta.pod_infos(["whole-sim", "bare-sim"])}
            except Exception:  # noqa: BLE001 - the connection re-established
                return False
            return ({"whole-sim", "bare-sim"} <= set(pods) and infos["whole-sim"].blocks > 0
                    and not infos["whole-sim"].incomplete and infos["bare-sim"].incomplete)

        await until(rebuilt, "the registry rebuilt, one pod rebuilt exact and the other flagged", timeout=60)
        assert "Valkey lost" in (await ix.meta.pod_info("bare-sim")).incomplete_reason

        seen: list = []  # the last look, for the failure's message

        async def listings_agree():
            held = {i.pod_id: i.blocks for i in await ix.meta.pod_infos(["whole-sim", "bare-sim"])}
            listed = await asyncio.to_thread(_listed_blocks, valkey_url, pred)
            seen[:] = [held, listed]
            return listed if all(got == held for got in listed.values()) else None

        try:
            listed = await until(listings_agree, "export, index pods and /stats agreeing with the index", timeout=60)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: the index held {seen[0]}, the listings showed {seen[1]}") from None
        assert listed["export"]["whole-sim"] > 0, listed
        # rebuilt exact: what it exports is what it exported before the loss, copy for copy
        assert await asyncio.to_thread(_exported, valkey_url, "whole-sim") == exported_before
        assert ing.poll() is None
    finally:
        await ix.close()
        stop(ing)
        stop(bare_proc)
        whole.stop()


async def test_an_ingester_warns_at_start_of_an_evicting_maxmemory_policy(valkey_url, tmp_path):
    """Under an ``allkeys-*`` policy Valkey evicts index keys at maxmemory and predictions go wrong with nothing
    to tell (the epoch notices only the loss of its own key): the one notice is the ingester's warning at
    start, which docs/operations.md promises."""
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    log = str(tmp_path / "ing.log")
    was = r.config_get("maxmemory-policy")["maxmemory-policy"]
    try:
        r.config_set("maxmemory-policy", "allkeys-lru")
        ing = ingester(valkey_url, log, "--source", "tcp://127.0.0.1:1")
        wait_log(log, "maxmemory-policy is allkeys-lru", ing)
        assert ing.poll() is None  # a warning, not a refusal
    finally:
        r.config_set("maxmemory-policy", was)
        r.close()


def _index_cli(valkey_url: str, *args: str) -> str:
    got = subprocess.run([sys.executable, "-m", "kv_preflight", "index", *args, "--valkey-url", valkey_url],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    return got.stdout


def _exported(valkey_url: str, pod: str | None = None) -> list[dict]:
    """`index export`'s lines (of one pod, or of all), sorted: one pod line, then one per physical block copy."""
    rows = [json.loads(line) for line in _index_cli(valkey_url, "export").splitlines()]
    return sorted((r for r in rows if pod in (None, r["pod"])), key=lambda r: json.dumps(r, sort_keys=True))


def _listed_blocks(valkey_url: str, predictor: str) -> dict[str, dict[str, int]]:
    """Pod -> blocks as each listing shows them: `index export` (its distinct engine blocks: a block the
    engine computed again is exported once per copy), `index pods --json`, and a predictor's `/stats` (one
    page of pods is every pod here)."""
    exported: dict[str, set] = {}
    for row in _exported(valkey_url):
        held = exported.setdefault(row["pod"], set())
        if "engine_key" in row:
            held.add((row["engine_key"], row["tier"], row.get("group", 0)))
    stats = httpx.get(predictor + "/stats", timeout=10).json()
    return {"export": {pod: len(held) for pod, held in exported.items()},
            "index pods": {p["pod_id"]: p["blocks"] for p in json.loads(_index_cli(valkey_url, "pods", "--json"))},
            "/stats": {p["pod_id"]: p["blocks"] for p in stats["pods"]}}


async def test_registrations_are_bounded_and_copies_of_a_source_refused(valkey_url, tmp_path):
    """Findings 7 and 8: /register took another pod's own sockets (a phantom second pod with the same cache;
    any 127.x.y.z spelling passed as a new engine), and any number of registrations of any size (1,000 with a
    60 KB model_name made /workers answer 60 MB). Now: 409 for an endpoint that is already an engine's source
    (whatever loopback spelling), 400 over the field sizes, 429 over the caps, and /workers is paged."""
    sim = Sim("sim-a", tmp_path)
    ing = ingester(valkey_url, str(tmp_path / "ing.log"), "--engine", sim.url, "--ingester-id", "cap-1")
    serve, dyn, _ = dynamo_server(valkey_url, tmp_path, env={"KVPF_MAX_REGISTERED_PER_MODEL": "3",
                                                             "KVPF_MAX_REGISTERED_ENGINES": "5"})
    ix = Index.from_url(valkey_url)
    try:
        async def lease_lists_the_engine():  # a lease renewed since sim-a was attached lists its sockets too
            lease = (await ix.fleet.fleet_view()).ingesters.get("cap-1")
            return lease is not None and sim.url in lease.engines

        await until(lease_lists_the_engine, "the ingester attached sim-a")
        async with httpx.AsyncClient(base_url=dyn, timeout=10) as c:
            for endpoint in (f"tcp://127.0.0.1:{sim.zmq_port}", f"tcp://127.0.0.2:{sim.zmq_port}",
                             f"tcp://localhost:{sim.zmq_port}"):
                r = await c.post("/register", json=register_body(901, endpoint))
                assert r.status_code == 409 and "already a source" in r.json()["error"], (endpoint, r.text)
            r = await c.post("/register", json=register_body(902, "tcp://127.0.0.1:1", replay_endpoint=f"tcp://127.0.0.3:{sim.replay_port}"))
            assert r.status_code == 409, r.text
            r = await c.post("/register", json=register_body(903, "tcp://127.0.0.1:2", model_name="m" * 60_000))
            assert r.status_code == 400 and "model_name" in r.json()["error"]
            for i in range(3):
                assert (await c.post("/register", json=register_body(910 + i, f"tcp://127.0.0.1:{3000 + i}"))).status_code == 201
            r = await c.post("/register", json=register_body(913, "tcp://127.0.0.1:3003"))
            assert r.status_code == 429 and "per-model" in r.json()["error"]
            r = await c.post("/register", json=register_body(920, "tcp://127.0.0.9:3000", model_name="other"))
            assert r.status_code == 409  # the same socket as 910's, spelled with another loopback address
            for i in range(2):
                assert (await c.post("/register", json=register_body(
                    930 + i, f"tcp://127.0.0.1:{4000 + i}", model_name="other"))).status_code == 201
            r = await c.post("/register", json=register_body(940, "tcp://127.0.0.1:5000", model_name="third"))
            assert r.status_code == 429 and "max-registered-engines" in r.json()["error"]
            page = await c.get("/workers", params={"limit": 2})
            assert len(page.json()) == 2 and page.headers["x-kvpf-next-offset"] == "2"
            rest = await c.get("/workers", params={"offset": 2, "limit": 1000})
            assert len(page.json()) + len(rest.json()) == 5  # the 5 registered (sim-a has sent no batch yet)
        assert ing.poll() is None
    finally:
        await ix.close()
        stop(ing)
        stop(serve)
        sim.stop()


async def test_one_client_holding_connections_locks_nobody_else_out(valkey_url, tmp_path):
    """Finding 11: 400 connections with half-sent headers (the server at ulimit -n 256) locked new clients out
    until the header deadline freed them. Now one client address holds at most --max-connections-per-client
    connections (the rest answered 503 and closed at once, counted), and another client is served."""
    import socket

    port = free_port()
    out = open(tmp_path / "serve.log", "w")
    serve = _started(subprocess.Popen(
        [sys.executable, "-m", "kv_preflight", "serve", "--valkey-url", valkey_url, "--port", str(port),
         "--request-read-timeout", "120"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", KVPF_MAX_CONNECTIONS_PER_CLIENT="16"),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))))
    held = []
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        for _ in range(150):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\nHo")  # half a header, then nothing
            held.append(s)
        transport = httpx.HTTPTransport(local_address="127.0.0.2")
        with httpx.Client(transport=transport, timeout=60) as other:
            assert other.get(f"http://127.0.0.1:{port}/health").status_code == 200
            metrics = other.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'kvpf_connections_refused_total{limit="per_client"}' in metrics
        assert serve.poll() is None
    finally:
        for s in held:
            s.close()
        stop(serve)


async def test_connections_past_the_total_cap_are_refused_and_counted(valkey_url, tmp_path):
    """--max-connections: past the connections all clients hold open, a new one is answered 503 and closed at
    once (counted under limit="total"), rather than left unaccepted when descriptors run out; once they
    are let go the predictor serves again. The held connections come from one address, under its own cap,
    so the refusal is the total's."""
    import socket

    port = free_port()
    serve = _started(spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), "--max-connections", "8",
                            "--request-read-timeout", "120"], str(tmp_path / "serve.log")))
    url = f"http://127.0.0.1:{port}"
    held = []
    try:
        wait_http(url + "/health")
        for _ in range(8):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.sendall(b"GET /health HTTP/1.1\r\nHo")  # half a header, then nothing
            held.append(conn)
        extra = socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0), timeout=30)
        try:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.recv(4096)
        finally:
            extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        for conn in held:
            conn.close()
        held.clear()

        def served_again():
            try:
                return httpx.get(url + "/metrics", timeout=10)
            except httpx.HTTPError:
                return None

        deadline = time.monotonic() + 30
        while (got := served_again()) is None or got.status_code != 200:
            assert time.monotonic() < deadline, "the predictor never served again after the connections closed"
            time.sleep(0.1)
        refused = {line.split()[0]: float(line.split()[1]) for line in got.text.splitlines()
                   if line.startswith("kvpf_connections_refused_total{")}
        assert refused.get('kvpf_connections_refused_total{limit="total"}', 0) >= 1, refused
        assert not refused.get('kvpf_connections_refused_total{limit="per_client"}'), refused
        assert serve.poll() is None
    finally:
        for conn in held:
            conn.close()
        stop(serve)


async def test_answers_say_when_the_index_is_stale(valkey_url, tmp_path):
    """Finding 9: with ingestion stalled (Valkey under noeviction at maxmemory, the ingester retrying OOM),
    /predict, /route and /health answered 200 with nothing saying the index was behind. Now the pod reads
    "stalled" in every answer (/predict, /explain, and the Dynamo /query for a registered worker), the answer
    "degraded" with the reason, /health 200 with status "degraded", and /route with max_staleness_ms routes by
    load alone (reason stale_index); all current again after."""
    sim = Sim("fresh-sim", tmp_path)
    worker = Sim("dynamo-931", tmp_path)  # its topic names the pod it registers as
    ing = ingester(valkey_url, str(tmp_path / "ing.log"), "--engine", sim.url, "--ingester-id", "fr-1")
    serve, dyn, pred = dynamo_server(valkey_url, tmp_path)
    r = redis.Redis.from_url(valkey_url)
    ix = Index.from_url(valkey_url)
    first, second = list(range(64)), list(range(500, 564))
    try:
        async with httpx.AsyncClient(base_url=dyn, timeout=30) as c:
            await register_until_ingested(c, ix, worker, 931)

        async def query(tokens):
            got = await asyncio.to_thread(httpx.post, dyn + "/query", json={"token_ids": tokens, "model_name": "sim"},
                                          timeout=10)
            return got.json() if got.status_code == 200 else {"error": got.text}

        async def answer(tokens, path="/v1/cache/predict", **extra):
            got = await asyncio.to_thread(httpx.post, pred + path, json={"model": "sim", "token_ids": tokens, **extra},
                                          timeout=10)
            return got.json() if got.status_code == 200 else {"error": got.text}

        async def worker_is(state: str):
            fresh = (await query(first)).get("freshness", {})
            return fresh.get("pods", {}).get("931", {}).get("state") == state and fresh

        async def current():
            await asyncio.to_thread(sim.complete, first)
            doc = await answer(first)
            pods = doc.get("freshness", {}).get("pods", {})
            # the worker holds the prompt too (it published it to register): its pod current as well, not
            # "unknown" while its ingester's lease does not list it yet (an unknown holder degrades the answer)
            return all(pods.get(p, {}).get("state") == "current" for p in ("fresh-sim", "dynamo-931")) and doc

        doc = await until(current, "the pods ingested and current")
        assert doc["freshness"]["state"] == "exact" and doc["predicted_cached_tokens"] > 0, doc["freshness"]
        await until(lambda: worker_is("current"), "the registered worker current in /query")
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", str(used // 2))  # every write refused: OOM
        await asyncio.to_thread(sim.complete, second)  # cached by the engine, never indexed while this lasts

        async def stalled():
            doc = await answer(second)
            return doc.get("freshness", {}).get("pods", {}).get("fresh-sim", {}).get("state") == "stalled" and doc

        doc = await until(stalled, "the pod reported stalled")
        assert doc["freshness"]["state"] == "degraded" and "stalled" in doc["freshness"]["reasons"][0]
        explained = (await answer(second, "/v1/cache/explain"))["freshness"]
        assert explained["state"] == "degraded" and explained["pods"]["fresh-sim"]["state"] == "stalled", explained
        queried = await until(lambda: worker_is("stalled"), "the registered worker stalled in /query")
        assert queried["state"] == "degraded" and "stalled" in queried["reasons"][0], queried
        health = await asyncio.to_thread(httpx.get, pred + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        # among fresh-sim alone, as before the registered worker was added beside it
        route = await answer(first, "/v1/cache/route", max_staleness_ms=1000, pods=["fresh-sim"])
        assert route["reason"] == "stale_index" and route["pod_id"] == "fresh-sim", route
        # the cache was not consulted: the detail says so, not a rule's reason about prefixes nobody looked at
        assert route["detail"].startswith("routed by load alone, the cache not consulted") and \
            "no_overlap" not in route["detail"], route
        assert (await answer(first, "/v1/cache/route", pods=["fresh-sim"]))["reason"] != "stale_index"
        r.config_set("maxmemory", "0")

        async def caught_up():
            doc = await answer(second)
            return doc.get("freshness", {}).get("state") == "exact" and doc.get("predicted_cached_tokens", 0) > 0

        await until(caught_up, "the index caught up and the answer exact again")
        await until(lambda: worker_is("current"), "the registered worker current in /query again")
        assert ing.poll() is None
    finally:
        r.config_set("maxmemory", "0")
        r.close()
        await ix.close()
        stop(ing)
        stop(serve)
        sim.stop()
        worker.stop()


LIFECYCLE_STEPS = st.lists(st.tuples(st.sampled_from(["register", "unregister", "publish", "clear", "restart",
                                                      "retire"]),
                                     st.integers(0, 2)), min_size=2, max_size=6)


async def test_any_lifecycle_sequence_leaves_every_pod_with_keys_listed(valkey_server, valkey_url, tmp_path):
    """The property of issue 26: after any sequence of register, unregister, `index clear --forget`, a Valkey
    restart without persistence, retirement, and publishing, every pod with keys is listed (the registry) and
    every listed pod answers. Real processes throughout; after each step the fleet settles on an observable
    event (a batch of an engine ingested all along comes in after everything the step caused), never a sleep.
    Retirement is an engine leaving an ``--engines-from`` listing (retired, then dropped after a short
    retention: both the ingester's, through the one pod lifecycle); a later retire step lists it again."""
    sims = [Sim(f"dynamo-{800 + i}", tmp_path) for i in range(3)]  # topics naming the pods they register as
    control = Sim("control-ps", tmp_path)
    retiree = Sim("retiree-ps", tmp_path)
    listing = tmp_path / "engines.json"
    listed = {"retiree": True}

    def list_retiree(on: bool) -> None:
        tmp = tmp_path / "engines.json.tmp"
        tmp.write_text(json.dumps([{"url": retiree.url, "pod": retiree.pod}] if on else []))
        os.replace(tmp, listing)  # atomically, as a ConfigMap update is
        listed["retiree"] = on

    list_retiree(True)
    ing = ingester(valkey_url, str(tmp_path / "ing.log"), "--engine", control.url, "--ingester-id", "ps-1",
                   "--engines-from", f"file://{listing}", "--retired-retention", "1")
    serve, dyn, pred = dynamo_server(valkey_url, tmp_path)
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    prompts = iter(range(10**6))
    registered: set[int] = set()

    def fresh_prompt() -> list[int]:
        n = next(prompts)
        return list(range(10_000 + 64 * n, 10_064 + 64 * n))

    def control_batches() -> int:
        try:
            return int(r.hget("kvpf:{control-ps}:meta", "batches") or 0)
        except redis.RedisError:
            return -1

    def settle() -> None:
        before = control_batches()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            control.complete(fresh_prompt())
            now = control_batches()
            if now > 0 and now != before:
                return
            time.sleep(0.2)
        raise AssertionError(f"the control engine's batches never came in: {open(tmp_path / 'ing.log').read()[-3000:]}")

    def step(action: str, i: int, c: httpx.Client) -> None:
        sim = sims[i]
        if action == "register" and i not in registered:
            got = c.post("/register", json=register_body(800 + i, f"tcp://127.0.0.1:{sim.zmq_port}",
                                                         replay_endpoint=f"tcp://127.0.0.1:{sim.replay_port}"))
            assert got.status_code == 201, got.text
            registered.add(i)
        elif action == "unregister" and i in registered:
            assert c.post("/unregister", json={"instance_id": 800 + i, "model_name": "sim"}).status_code == 200
            registered.discard(i)
        elif action == "publish":
            sim.complete(fresh_prompt())
            retiree.complete(fresh_prompt())
        elif action == "retire":
            retire_or_list_again()
        elif action == "clear" and f"dynamo-{800 + i}" in r.hkeys("kvpf:registry"):
            got = subprocess.run([sys.executable, "-m", "kv_preflight", "index", "clear", "--valkey-url", valkey_url,
                                  "--pod", f"dynamo-{800 + i}", "--forget"], capture_output=True, text=True, timeout=60)
            assert got.returncode == 0, got.stderr
        elif action == "restart":
            noticed = open(tmp_path / "ing.log").read().count("Valkey lost the index's data")
            valkey_server.proc.kill()
            valkey_server.proc.wait()
            shutil.rmtree(valkey_server.data_dir / "appendonlydir", ignore_errors=True)
            valkey_server.start()
            registered.clear()  # the registrations were in the lost data
            deadline = time.monotonic() + 60
            while open(tmp_path / "ing.log").read().count("Valkey lost the index's data") == noticed:
                assert time.monotonic() < deadline and ing.poll() is None, "the ingester never noticed the loss"
                time.sleep(0.1)

    def retire_or_list_again() -> None:
        """The retiree leaves the listing (and the step waits until its pod was retired and then dropped), or,
        gone, is listed again (its history replayed from its engine, as for any engine newly found)."""
        if not listed["retiree"]:
            list_retiree(True)
            return
        wait_for(lambda: r.hexists("kvpf:fleet", retiree.pod), "the retiree's record (it was listed)")
        retired = open(tmp_path / "ing.log").read().count("pod retiree-ps retired")
        list_retiree(False)
        wait_for(lambda: retiree.pod not in r.hkeys("kvpf:registry") and not r.hexists("kvpf:fleet", retiree.pod),
                 "the retiree retired and dropped")
        assert open(tmp_path / "ing.log").read().count("pod retiree-ps retired") == retired + 1

    def wait_for(done, what: str) -> None:
        deadline = time.monotonic() + 60
        while not done():
            assert time.monotonic() < deadline and ing.poll() is None, f"never: {what}"
            time.sleep(0.1)

    def check() -> None:
        assert unlisted_pods(valkey_url) == set()
        for pod in r.hkeys("kvpf:registry"):
            got = httpx.post(pred + "/v1/cache/predict", json={"model": "sim", "token_ids": list(range(64)),
                                                               "pods": [pod]}, timeout=10)
            assert got.status_code == 200, (pod, got.text)

    try:
        with httpx.Client(base_url=dyn, timeout=30) as c:
            @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
            @given(steps=LIFECYCLE_STEPS)
            def run(steps):
                for action, i in steps:
                    step(action, i, c)
                    settle()
                    check()
                    assert ing.poll() is None

            await asyncio.to_thread(run)
    finally:
        r.close()
        stop(ing)
        stop(serve)
        for s in [*sims, control, retiree]:
            s.stop()
