"""``kv-preflight gateway`` as a real process in front of real simulated engines (with a real ingester) and stub
engines whose answers the test sets to the byte: routing by the index, answers passed through, retries,
disconnects, limits and API keys."""
from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time

import httpx
import msgspec
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.fleet.records import PodRecord
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.openai_stub import OpenAIStub
from tests.integration.sim import sim_engine
from tests.integration.leases import vouch
from tests.integration.test_fleet_predictor import MODEL
from tests.integration.test_fleet_predictor import store as store_blocks


async def store(ix, pod: str, tokens: list[int]) -> None:
    """The pod holds these tokens' blocks, and a lease vouches for it (as its ingester's would: a pod no lease
    covers reads unknown, and a route does not weigh its blocks)."""
    await store_blocks(ix, pod, tokens)
    await vouch(ix, pod, ingester=f"test-ingester-{pod}")
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


class GatewayProc:
    def __init__(self, valkey_url: str, tmp_path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.log = tmp_path / f"gateway-{self.port}.log"
        self.proc = spawn(["gateway", "--valkey-url", valkey_url, "--port", str(self.port), *args], str(self.log),
                          env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> "GatewayProc":
        wait_http(self.url + "/health")
        return self

    async def complete(self, prompt, **body) -> httpx.Response:
        async with httpx.AsyncClient(timeout=30) as c:
            return await c.post(self.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, **body})

    def stop(self) -> None:
        stop(self.proc)


@pytest.fixture
def gateway(valkey_url, tmp_path):
    started: list[GatewayProc] = []

    def make(*args: str, env: dict[str, str] | None = None) -> GatewayProc:
        g = GatewayProc(valkey_url, tmp_path, *args, env=env)
        started.append(g)
        return g

    yield make
    for g in started:
        g.stop()


@pytest.fixture
def stubs():
    started: list[OpenAIStub] = []

    def make(**kwargs) -> OpenAIStub:
        s = OpenAIStub(**kwargs).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def record(url: str) -> PodRecord:
    return PodRecord(state="live", engine_url=url, models=[MODEL], block_size=16, owner="test-ingester")


async def fed(ix, *pods: str) -> None:
    """A live ingester's lease that lists the pods: their events are ingested (not approximate pods)."""
    from kv_preflight.fleet.records import IngesterLease

    now = await ix.fleet.now_ms()
    await ix.fleet.put_lease("test-ingester", IngesterLease(expires_ms=now + 600_000, state="current", current_ms=now,
                                                            pods=list(pods)))


def dead_url() -> str:
    """A URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_routes_by_the_index_and_answers_with_the_engines_own_bytes(valkey_url, tmp_path, gateway):
    """Two simulated engines, a real ingester, the gateway given --valkey-url alone: a prompt's second request goes
    where the first left its blocks, the prediction equal to what the engine reports it reused, and both the plain
    and the streamed answer (usage included) come back as the engine wrote them."""
    engines = [sim_engine(p, tmp_path).start() for p in ("sim-0", "sim-1")]
    ingester = spawn(["ingest", "--valkey-url", valkey_url, *(a for e in engines for a in ("--engine", e.url))],
                     str(tmp_path / "ingest.log"))
    try:
        g = gateway().ready()
        models = await until(lambda: _models(g), "the fleet's model in /v1/models")
        assert [m["id"] for m in models] == [MODEL]
        prompt = "Summarize this report about the quarterly numbers of the northern region, please. " * 3
        first = await g.complete(prompt, max_tokens=4)
        assert first.status_code == 200, first.text
        pod = first.headers["x-kvpf-pod"]
        assert first.headers["x-kvpf-reason"] == "no_overlap" and first.headers["x-kvpf-predicted-cached-tokens"] == "0"
        assert int(first.headers["content-length"]) == len(first.content)

        async def second():
            r = await g.complete(prompt, max_tokens=4)
            return r if r.headers["x-kvpf-reason"] == "best_overlap" else None

        again = await until(second, "the prompt routed by the blocks its first request left")
        assert again.headers["x-kvpf-pod"] == pod
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and again.headers["x-kvpf-predicted-cached-tokens"] == str(cached)
        # streamed: the engine's SSE events, usage and [DONE] included, as sent
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", g.url + "/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                assert r.headers["x-kvpf-pod"] in ("sim-0", "sim-1")
                raw = b"".join([chunk async for chunk in r.aiter_raw()])
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][len(b"data: "):])["usage"]["prompt_tokens"] > 0
    finally:
        stop(ingester)
        for e in engines:
            e.stop(kill=True)


async def _models(g: GatewayProc):
    async with httpx.AsyncClient(timeout=5) as c:
        return (await c.get(g.url + "/v1/models")).json()["data"]


async def test_answers_pass_through_byte_for_byte(valkey_url, ix, gateway, stubs):
    """A gzip-encoded answer stays gzip-encoded (the raw bytes, not decoded and re-encoded), and a stream's chunks
    arrive as the engine cut them."""
    raw = gzip.compress(b'{"id": "x",   "choices": [ ],\n "usage": {"prompt_tokens": 3}}')
    plain = stubs(body=raw, headers={"content-type": "application/json", "content-encoding": "gzip",
                                      "x-engine": "kept"})
    await ix.fleet.put_pod_records({"pod-a": record(plain.url)})
    g = gateway().ready()
    async with httpx.AsyncClient(timeout=10) as c:
        async def answered():
            r = await c.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
            return r if r.status_code == 200 else None

        got = await until(answered, "an answer through the gateway")
        async with c.stream("POST", g.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]}) as r:
            body = b"".join([chunk async for chunk in r.aiter_raw()])
            assert body == raw and r.headers["content-encoding"] == "gzip" and r.headers["x-engine"] == "kept"
    assert got.headers["x-kvpf-pod"] == "pod-a" and got.json()["usage"]["prompt_tokens"] == 3
    assert plain.seen[-1]["body"] == b'{"model":"sim","prompt":[1,2,3]}'  # the body went up as sent


async def test_an_unknown_model_is_a_404_that_names_the_gateways_own_flags(valkey_url, ix, gateway, stubs):
    """The 404 for a model nothing serves says what would make it known in the gateway's own words: its --engine
    (it said "no --engine-url or --tokenizer names it", serve's wording alone, to someone who had given --engine),
    and still lists the known models."""
    engine = stubs(body=b'{"ok": true}')
    await ix.fleet.put_pod_records({"pod-a": record(engine.url)})
    g = gateway().ready()
    async with httpx.AsyncClient(timeout=10) as c:
        async def judged():  # 503 until the fleet records are read
            r = await c.post(g.url + "/v1/completions", json={"model": "nope", "prompt": [1, 2, 3]})
            return r if r.status_code != 503 else None

        r = await until(judged, "the gateway's verdict on an unknown model")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError", r.text
    message = r.json()["error"]["message"]
    assert message.startswith("unknown model 'nope'") and f"known models: {MODEL!r}" in message, message
    assert "no --engine of this gateway serves it" in message and "--engine-url or --tokenizer" in message, message
    assert engine.seen == []  # nothing went upstream


async def test_a_prompt_no_engine_can_tokenize_is_a_503_that_names_the_gateways_own_command(valkey_url, ix, gateway):
    """The gateway's own /v1/cache/predict for a known model whose engines are all down: a 503 whose fix names
    `gateway --tokenizer` (it said `serve --tokenizer` to someone running a gateway)."""
    await store(ix, "pod-dead", list(range(900, 964)))  # the model is known from the index
    await ix.fleet.put_pod_records({"pod-dead": msgspec.structs.replace(record(dead_url()), state="unreachable")})
    g = gateway().ready()
    async with httpx.AsyncClient(timeout=10) as c:
        async def judged():
            r = await c.post(g.url + "/v1/cache/predict", json={"model": MODEL, "prompt": "hello"})
            return r if r.status_code == 503 and "cannot tokenize" in r.text else None

        r = await until(judged, "the gateway's 503 for a prompt it cannot tokenize")
    assert f"give gateway --tokenizer {MODEL}=DIR" in r.json()["error"], r.text


async def test_refused_connection_is_retried_on_the_next_candidate_and_the_fleet_told(valkey_url, ix, gateway, stubs):
    alive = stubs(body=b'{"ok": "alive"}')
    prompt = list(range(500, 564))
    await store(ix, "pod-dead", prompt)  # the dead pod holds the prompt: the index sends it there first
    await ix.fleet.put_pod_records({"pod-dead": record(dead_url()), "pod-alive": record(alive.url)})
    g = gateway("--gateway-avoid", "30").ready()
    r = await g.complete(prompt)
    assert r.status_code == 200, r.text
    assert r.content == b'{"ok": "alive"}'
    assert (r.headers["x-kvpf-pod"], r.headers["x-kvpf-retried-from"]) == ("pod-alive", "pod-dead")
    view = await ix.fleet.fleet_view()
    assert view.pods["pod-dead"].state == "unreachable" and "gateway" in view.pods["pod-dead"].reason
    again = await g.complete(prompt)  # avoided, and no longer offered: straight to the live pod
    assert again.headers["x-kvpf-pod"] == "pod-alive" and "x-kvpf-retried-from" not in again.headers
    metrics = httpx.get(g.url + "/metrics").text
    assert 'kvpf_gateway_upstream_failures_total{kind="connect"} 1.0' in metrics
    assert "kvpf_gateway_retries_total 1.0" in metrics


async def test_a_pod_whose_engine_never_got_the_request_is_given_no_speculative_blocks(
        valkey_url, ix, gateway, stubs):
    """A request's speculative entries are written once it is on its way to the engine: a pod whose engine refused
    the connection never got the prompt, and counting its blocks there (as was done, for the speculative TTL) would
    steer the prompt's next requests to a pod that does not hold it. (Its booking, made at the decision so this
    process's next decisions count it at once, is released with the failure.)"""
    import redis as sync_redis
    from kv_preflight.index.layout import pod_speculative_key

    alive = stubs(body=b'{"ok": "alive"}')
    await ix.fleet.put_pod_records({"pod-dead": record(dead_url()), "pod-alive": record(alive.url)})
    await fed(ix, "pod-dead", "pod-alive")  # ingested pods: speculative entries (not an approximate index)
    g = gateway("--gateway-avoid", "0.01", "--gateway-speculative-ttl", "60").ready()
    r = sync_redis.Redis.from_url(valkey_url)
    for start in range(1000, 20000, 64):  # new prompts: placed by their hash, until one went to pod-dead first
        got = await g.complete(list(range(start, start + 64)))
        assert got.status_code == 200, got.text
        if got.headers.get("x-kvpf-retried-from") == "pod-dead":
            break
        await asyncio.sleep(0.05)  # pod-dead avoided no longer
    else:
        raise AssertionError("no prompt was placed on pod-dead first")
    assert got.headers["x-kvpf-pod"] == "pod-alive"
    async def counted() -> bool:
        return bool(r.exists(pod_speculative_key("pod-alive")))

    await until(counted, "the pod it went to counting its blocks")
    assert not r.exists(pod_speculative_key("pod-dead")), "speculative blocks on a pod that never got the prompt"
    r.close()


async def test_5xx_before_the_first_byte_is_retried_once(valkey_url, ix, gateway, stubs):
    failing = stubs(status=500, body=b'{"error": "boom"}')
    other = stubs(body=b'{"ok": "other"}')
    prompt = list(range(700, 764))
    await store(ix, "pod-failing", prompt)
    await ix.fleet.put_pod_records({"pod-failing": record(failing.url), "pod-other": record(other.url)})
    g = gateway().ready()
    r = await g.complete(prompt)
    assert (r.status_code, r.content) == (200, b'{"ok": "other"}')
    assert (r.headers["x-kvpf-pod"], r.headers["x-kvpf-retried-from"]) == ("pod-other", "pod-failing")
    view = await ix.fleet.fleet_view()  # a 5xx proves the engine answers: not marked unreachable
    assert view.pods["pod-failing"].state == "live"


async def test_an_https_engine_is_forwarded_to_over_tls_and_an_untrusted_one_is_not_reported(valkey_url, ix, tmp_path,
                                                                                             gateway, stubs):
    """An engine served over https (a self-signed certificate) is forwarded to by a gateway that trusts its CA
    (SSL_CERT_FILE); a gateway that does not fails the TLS handshake, sends the request to the next candidate and
    leaves the pod's record live (its own trust failed, not the engine)."""
    from tests.integration.tls import self_signed

    cert, key = self_signed(tmp_path)
    secure = stubs(body=b'{"ok": "tls"}', tls=(str(cert), str(key)))
    plain = stubs(body=b'{"ok": "plain"}')
    assert secure.url.startswith("https://")
    prompt = list(range(800, 864))
    await store(ix, "pod-tls", prompt)  # the TLS pod holds the prompt: the index sends it there first
    await ix.fleet.put_pod_records({"pod-tls": record(secure.url), "pod-plain": record(plain.url)})
    trusting = gateway(env={"SSL_CERT_FILE": str(cert)}).ready()
    r = await trusting.complete(prompt)
    assert (r.status_code, r.content, r.headers["x-kvpf-pod"]) == (200, b'{"ok": "tls"}', "pod-tls"), r.text
    assert "x-kvpf-retried-from" not in r.headers and len(secure.seen) == 1
    assert secure.seen[0]["body"] == msgspec.json.encode({"model": MODEL, "prompt": prompt})
    untrusting = gateway().ready()
    r = await untrusting.complete(prompt)
    assert (r.status_code, r.content) == (200, b'{"ok": "plain"}'), r.text
    assert (r.headers["x-kvpf-pod"], r.headers["x-kvpf-retried-from"]) == ("pod-plain", "pod-tls")
    assert len(secure.seen) == 1
    assert 'kvpf_gateway_upstream_failures_total{kind="tls"} 1.0' in httpx.get(untrusting.url + "/metrics").text
    assert "TLS with 127.0.0.1" in untrusting.log.read_text()
    assert (await ix.fleet.fleet_view()).pods["pod-tls"].state == "live"


async def test_a_request_is_retried_once_at_most(valkey_url, ix, gateway, stubs):
    engines = [stubs(status=500, body=b'{"error": "boom"}') for _ in range(3)]
    await ix.fleet.put_pod_records({f"pod-{i}": record(e.url) for i, e in enumerate(engines)})
    g = gateway().ready()
    r = await g.complete(list(range(100, 164)))
    assert r.status_code == 502 and r.json()["error"]["type"] == "BadGatewayError"
    assert sum(len(e.seen) for e in engines) == 2
    failed = [f"pod-{i}" for i, e in enumerate(engines) if e.seen]
    assert all(p in r.json()["error"]["message"] for p in failed)


async def test_a_client_that_leaves_cancels_the_upstream_request(valkey_url, tmp_path, ix, gateway):
    """The simulated engine aborts a request whose client went away (as vLLM does): the gateway must close its
    connection to the engine when its own client leaves."""
    engine = sim_engine("slow", tmp_path)
    engine.proc = spawn(["simulate", "--pod", "slow", "--model", MODEL, "--port", engine.url.rsplit(":", 1)[1],
                         "--zmq", f"tcp://*:{engine.zmq_port}", "--replay", f"tcp://*:{engine.replay_port}",
                         "--blocks", "64", "--max-model-len", "512", "--step-ms", "200"], str(tmp_path / "slow.log"))
    wait_http(engine.url + "/v1/models")
    try:
        await ix.fleet.put_pod_records({"slow": record(engine.url)})
        g = gateway().ready()
        client = httpx.AsyncClient(timeout=60)
        request = asyncio.ensure_future(client.post(g.url + "/v1/completions",
                                                    json={"model": MODEL, "prompt": [5] * 40, "max_tokens": 200}))
        await until(lambda: _engine_metric(engine.url, "vllm:num_requests_running"), "the engine running it")
        request.cancel()
        await client.aclose()
        aborted = 'finished_reason="abort"'
        assert await until(lambda: _engine_metric(engine.url, "vllm:request_success_total", aborted),
                           "the engine's abort of the request") == 1
        assert await _engine_metric(engine.url, "vllm:request_success_total", 'finished_reason="length"') == 0
        metrics = httpx.get(g.url + "/metrics").text
        assert 'kvpf_gateway_requests_total{endpoint="completions",outcome="client_gone"} 1.0' in metrics
    finally:
        engine.stop(kill=True)


async def _engine_metric(url: str, name: str, label: str = "") -> float:
    async with httpx.AsyncClient(timeout=5) as c:
        text = (await c.get(url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(name) and label in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_slow_engine_blocks_no_other_request_and_the_inflight_limit_answers_503(valkey_url, ix, gateway,
                                                                                         stubs):
    slow = stubs(hold_s=60, body=b'{"slow": true}')
    fast = stubs(body=b'{"fast": true}')
    slow_prompt, fast_prompt = list(range(900, 964)), list(range(1900, 1964))
    await store(ix, "pod-slow", slow_prompt)
    await store(ix, "pod-fast", fast_prompt)
    await ix.fleet.put_pod_records({"pod-slow": record(slow.url), "pod-fast": record(fast.url)})
    g = gateway("--gateway-max-inflight", "2").ready()
    held = asyncio.ensure_future(g.complete(slow_prompt))
    await until(lambda: _async(len(slow.seen) == 1), "the slow engine holding a request")
    r = await g.complete(fast_prompt)
    assert (r.status_code, r.content) == (200, b'{"fast": true}') and not held.done()
    second = asyncio.ensure_future(g.complete(slow_prompt))
    await until(lambda: _async(len(slow.seen) == 2), "two requests held")
    busy = await g.complete(fast_prompt)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert "--gateway-max-inflight" in busy.json()["error"]["message"]
    held.cancel()
    second.cancel()


async def _async(value):
    return value


async def test_body_size_limit_api_keys_and_connection_cap(valkey_url, ix, gateway, stubs, tmp_path):
    engine = stubs(body=b'{"ok": true}')
    await ix.fleet.put_pod_records({"pod-a": record(engine.url)})
    keys = tmp_path / "keys"
    keys.write_text("secret-1\n")
    g = gateway("--api-keys-file", str(keys), "--max-body-bytes", "2000", "--max-connections-per-client", "1").ready()
    auth = {"authorization": "Bearer secret-1"}
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(g.url + "/health")).status_code == 200  # open, for the balancer's probes
        denied = await c.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2]})
        assert denied.status_code == 401
        big = await c.post(g.url + "/v1/completions", headers=auth, json={"model": MODEL, "prompt": [1] * 2000})
        assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]["message"]
        ok = await until(lambda: c.post(g.url + "/v1/completions", headers=auth,
                                        json={"model": MODEL, "prompt": [1, 2]}), "an answer")
        assert ok.status_code == 200
    # the gateway's API key is its own: not handed to the engine
    assert "authorization" not in engine.seen[-1]["headers"]
    # one connection per client address here: a second one at once is refused
    with socket.create_connection(("127.0.0.1", g.port)):
        time.sleep(0.2)
        refused = httpx.get(g.url + "/health", timeout=5)
        assert refused.status_code == 503 and "per_client" in refused.text


async def test_a_decision_that_names_a_data_parallel_rank_pins_it_with_vllms_header(stubs):
    """Through the gateway's own upstream client: ``X-data-parallel-rank`` when the decision names a rank, none
    otherwise; hop-by-hop headers never go up."""
    from kv_preflight.config import Config
    from kv_preflight.predictor.gateway.forward import Upstream

    engine = stubs(body=b"{}")
    upstream = Upstream(Config())
    try:
        sent = [(b"content-type", b"application/json"), (b"connection", b"close"), (b"x-client", b"kept")]
        for rank in (2, None):
            response = await upstream.open(engine.url + "/v1/completions", b"{}", sent, dp_rank=rank)
            await response.aread()
            await response.aclose()
    finally:
        await upstream.aclose()
    ranked, plain = engine.seen
    assert ranked["headers"]["x-data-parallel-rank"] == "2" and "x-data-parallel-rank" not in plain["headers"]
    assert ranked["headers"]["x-client"] == "kept" and ranked["headers"].get("connection") != "close"


def test_up_starts_a_gateway_that_routes_by_its_index(tmp_path):
    import signal
    import subprocess
    import sys
    import threading

    from tests.integration.up_procs import reaped

    port, gateway_port = free_port(), free_port()
    with reaped(tmp_path) as env:
        proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", "up", "--data-dir", ".data", "--port", str(port),
                                 "--gateway-port", str(gateway_port), "--workers", "1", "--ingesters", "1"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            prompt = {"model": "sim-model", "prompt": "You are a helpful assistant. " * 8, "max_tokens": 2}
            deadline = time.monotonic() + 120
            reasons = []
            while time.monotonic() < deadline and proc.poll() is None and not (
                    "best_overlap" in reasons and any("Ctrl-C stops everything" in ln for ln in lines)):
                try:
                    r = httpx.post(f"http://127.0.0.1:{gateway_port}/v1/completions", json=prompt, timeout=10)
                    if r.status_code == 200:
                        reasons.append(r.headers["x-kvpf-reason"])
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
            assert "best_overlap" in reasons, (reasons, proc.poll(), lines)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            reader.join(10)
        out = "".join(lines)
        assert f"gateway    http://127.0.0.1:{gateway_port}" in out and "stopped." in out, out


async def _route(g: GatewayProc, prompt) -> dict:
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(g.url + "/v1/cache/route", json={"model": MODEL, "token_ids": prompt})
        assert r.status_code == 200, r.text
        return r.json()


def _candidate(decision: dict, pod: str) -> dict:
    return next(c for c in decision["candidates"] if c["pod_id"] == pod)


async def test_bookings_of_one_gateway_process_steer_another(valkey_url, ix, gateway, stubs):
    """Gateway A forwards four long requests to pod-x (which holds their prompt); gateway B, another process,
    sees them booked there at once (no metrics say so: the stubs report idle) and sends the same prompt to
    pod-y; when A's requests end, or A dies and its bookings expire, B goes back to pod-x."""
    x, y = stubs(hold_s=60, body=b'{"x": 1}'), stubs(body=b'{"y": 1}')
    prompt = list(range(3000, 3064))
    await store(ix, "pod-x", prompt)
    await ix.fleet.put_pod_records({"pod-x": record(x.url), "pod-y": record(y.url)})
    await fed(ix, "pod-x", "pod-y")
    a = gateway("--gateway-booking-ttl", "2").ready()
    # (B writes no speculative entries: its request to pod-y would make pod-y hold the prompt as pod-x does)
    b = gateway("--route-overload-abs", "2", "--gateway-speculative-ttl", "0").ready()
    assert (await _route(b, prompt))["pod_id"] == "pod-x"

    held = [asyncio.ensure_future(a.complete(prompt)) for _ in range(4)]
    await until(lambda: _async(len(x.seen) == 4), "four requests held by pod-x")
    d = await _route(b, prompt)
    cost = (64 - 48) + 256  # its prompt's tokens not cached there (the last block is recomputed) + default decode
    assert (_candidate(d, "pod-x")["booked_requests"], _candidate(d, "pod-x")["booked_tokens"]) == (4, 4 * cost)
    assert (d["pod_id"], d["reason"]) == ("pod-y", "least_loaded")
    assert (await b.complete(prompt)).headers["x-kvpf-pod"] == "pod-y"

    for h in held:  # the clients leave: the requests end, their bookings go at once
        h.cancel()
    await until(lambda: _routed_to(b, prompt, "pod-x"), "pod-x chosen again once A's requests ended")
    assert _candidate(await _route(b, prompt), "pod-x")["booked_requests"] == 0

    held = [asyncio.ensure_future(a.complete(prompt)) for _ in range(4)]
    await until(lambda: _async(len(x.seen) == 8), "four more requests held by pod-x")
    await until(lambda: _routed_to(b, prompt, "pod-y"), "pod-y chosen while they run")
    a.proc.kill()  # gone without releasing anything: its bookings expire after their TTL (2 s)
    await until(lambda: _routed_to(b, prompt, "pod-x"), "pod-x chosen again once A's bookings expired")
    for h in held:
        h.cancel()


async def test_requests_ending_together_release_their_bookings_in_one_write(valkey_url, ix, gateway, stubs):
    """Six requests held by their engine end together (their clients leave): their bookings leave Valkey in one
    script call, not one each (a write and a script call per request cost the gateway's CPU and Valkey's)."""
    import threading

    import redis

    from kv_preflight.index.layout import pod_booking_keys

    x = stubs(hold_s=60, body=b'{"x": 1}')
    prompt = list(range(3100, 3164))
    await store(ix, "pod-x", prompt)
    await ix.fleet.put_pod_records({"pod-x": record(x.url)})
    await fed(ix, "pod-x")
    g = gateway().ready()
    held = [asyncio.ensure_future(g.complete(prompt)) for _ in range(6)]
    await until(lambda: _async(len(x.seen) == 6), "six requests held by pod-x")
    assert _candidate(await _route(g, prompt), "pod-x")["booked_requests"] == 6
    releases: list[int] = []
    watching = threading.Event()

    def watch() -> None:  # every booking script call that releases, as Valkey runs it
        with redis.Redis.from_url(valkey_url).monitor() as m:
            watching.set()
            for c in m.listen():
                words = c["command"].split()
                if len(words) > 2 and words[0] == "EVALSHA" and "release" in words:
                    releases.append(len(words) - words.index("release") - 1)
                if c["command"] == "ECHO done-watching":
                    return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    watching.wait(10)
    for h in held:
        h.cancel()
    await until(lambda: _async(not redis.Redis.from_url(valkey_url).zcard(pod_booking_keys("pod-x")[0])),
                "the six bookings released")
    redis.Redis.from_url(valkey_url).echo("done-watching")
    watcher.join(10)
    assert sum(releases) == 6 and len(releases) < 6, releases


async def _routed_to(g: GatewayProc, prompt, pod: str) -> bool:
    return (await _route(g, prompt))["pod_id"] == pod


async def test_a_routed_prompt_counts_on_its_pod_for_every_gateway_until_its_ttl_lapses(valkey_url, ix, gateway,
                                                                                        stubs):
    """Gateway A sends a new prompt to a pod an ingester feeds but whose engine (a stub) sends no event to confirm it;
    gateway B, another process, routes the same prompt there by A's speculative entries (best_overlap, its
    blocks marked speculative in /route, /predict and /explain) until A's TTL lapses, then by itself again."""
    x, y = stubs(body=b'{"x": 1}'), stubs(body=b'{"y": 1}')
    await ix.fleet.put_pod_records({"pod-x": record(x.url), "pod-y": record(y.url)})
    await fed(ix, "pod-x", "pod-y")  # an ingester feeds them (else they are approximate pods: the next test)
    a = gateway("--gateway-speculative-ttl", "3").ready()
    b = gateway().ready()
    prompt = list(range(4000, 4064))
    assert (await _route(b, prompt))["reason"] == "no_overlap"
    sent = (await a.complete(prompt)).headers["x-kvpf-pod"]
    d = await _route(b, prompt)
    assert (d["pod_id"], d["reason"], d["cached_tokens"]) == (sent, "best_overlap", 48)
    async with httpx.AsyncClient(timeout=10) as c:
        body = {"model": MODEL, "token_ids": prompt}
        predicted = (await c.post(b.url + "/v1/cache/predict", json=body)).json()
        explained = (await c.post(b.url + "/v1/cache/explain", json=body)).json()
    assert predicted["pod_affinities"] == [{"pod_id": sent, "cached_blocks": 4, "cached_tokens": 48, "device_tier": "gpu",
                                            "estimated_ttft_ms": predicted["pod_affinities"][0]["estimated_ttft_ms"],
                                            "speculative_blocks": 4}]
    chain = next(c for c in explained["pods"] if c["pod_id"] == sent)
    assert (chain["stop_block"], chain["speculative_blocks"]) == (4, 4)
    await until(lambda: _reason(b, prompt, "no_overlap"), "the speculative entries gone with their TTL")


async def test_a_new_prefix_one_gateway_placed_is_pending_there_for_every_gateway(valkey_url, ix, gateway, stubs):
    """Gateway A places a new prompt (no speculative entries: what a second gateway sees before they land); gateway
    B, another process, sends the same prompt to the same pod although its own rule (the fewest blocks of other
    prefixes homed there) would now pick the other pod, until --route-pending lapses. Through one gateway a burst
    of a new prefix stays on one pod (placement.py's pending); through eight it scattered."""
    from kv_preflight.index.routed import RoutedStore

    x, y = stubs(body=b'{"x": 1}'), stubs(body=b'{"y": 1}')
    await ix.fleet.put_pod_records({"pod-x": record(x.url), "pod-y": record(y.url)})
    await fed(ix, "pod-x", "pod-y")
    a = gateway("--gateway-speculative-ttl", "0").ready()
    b = gateway("--route-pending", "3").ready()
    prompt = list(range(4100, 4164))
    sent = (await a.complete(prompt)).headers["x-kvpf-pod"]
    other = "pod-y" if sent == "pod-x" else "pod-x"
    # another prefix, 40 blocks, homed on the pod A chose: by footprints alone the prompt goes to the other pod
    await RoutedStore(ix.client).home(sent, 12345, 40, 60_000)
    d = await _route(b, prompt)
    assert (d["pod_id"], d["reason"]) == (sent, "no_overlap") and "pending" in d["detail"], d["detail"]
    await until(lambda: _routed_to(b, prompt, other), "placed by footprints once --route-pending lapsed")


async def test_new_prefixes_placed_through_two_gateways_at_once_take_different_pods(valkey_url, ix, gateway, stubs):
    """Two gateway processes each place a new prompt, both prompts hashed to the same pod, each gateway seeing both
    pods as empty and idle (no placement window: nothing homed is read, as in the ms before a home lands). Claimed
    fleet-wide, the two prompts go to different pods, and the first prompt keeps its pod through the other
    gateway; without the claim both went where the hash sends them, as a cold fleet's first burst through eight
    gateways piled most tenants on a few pods."""
    from kv_preflight.keys.chain import request_keys
    from kv_preflight.predictor.scoring.route import rendezvous

    x, y = stubs(body=b'{"x": 1}'), stubs(body=b'{"y": 1}')
    await ix.fleet.put_pod_records({"pod-x": record(x.url), "pod-y": record(y.url)})
    await fed(ix, "pod-x", "pod-y")
    a = gateway("--route-placement-window", "0").ready()
    b = gateway("--route-placement-window", "0").ready()

    def hashed_to(prompt) -> str:
        key = request_keys(prompt, model=MODEL, block_size=16)[0]
        return max(("pod-x", "pod-y"), key=lambda p: rendezvous(key, p))

    prompts = [list(range(s, s + 64)) for s in range(5000, 5600, 64)]
    p1, p2 = [p for p in prompts if hashed_to(p) == "pod-x"][:2]
    d1, d2 = await _route(a, p1), await _route(b, p2)
    assert d1["reason"] == d2["reason"] == "no_overlap"
    assert {d1["pod_id"], d2["pod_id"]} == {"pod-x", "pod-y"}, (d1["detail"], d2["detail"])
    assert (await _route(b, p1))["pod_id"] == d1["pod_id"]


async def _reason(g: GatewayProc, prompt, reason: str) -> bool:
    return (await _route(g, prompt))["reason"] == reason


async def test_speculative_blocks_give_way_to_the_engines_events(valkey_url, ix, tmp_path, gateway):
    """With a real engine and ingester: a prompt a gateway sent there counts as speculative until the engine's
    events are in the index, then as the index's (speculative_blocks gone), the count unchanged."""
    from kv_preflight.index.routed import RoutedStore, keys_blob
    from kv_preflight.keys.chain import request_keys

    engine = sim_engine("sim-0", tmp_path).start()
    ingester = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url], str(tmp_path / "ingest.log"))
    try:
        g = gateway().ready()
        await until(lambda: _models(g), "the engine's fleet record")
        prompt = list(range(5000, 5064))
        # what a gateway writes as it sends the prompt (a minute's TTL: the events must be what ends it here)
        await RoutedStore(ix.client).speculate("sim-0", keys_blob(request_keys(prompt, model=MODEL)), 60_000)

        async def affinity():
            async with httpx.AsyncClient(timeout=10) as c:
                d = (await c.post(g.url + "/v1/cache/predict", json={"model": MODEL, "token_ids": prompt})).json()
            return d["pod_affinities"][0]

        assert await affinity() == {"pod_id": "sim-0", "cached_blocks": 4, "cached_tokens": 48, "device_tier": "gpu",
                                    "estimated_ttft_ms": (await affinity())["estimated_ttft_ms"],
                                    "speculative_blocks": 4}
        async with httpx.AsyncClient(timeout=30) as c:  # the engine computes the prompt: its events follow
            r = await c.post(engine.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200

        async def confirmed():
            a = await affinity()
            return a["cached_tokens"] == 48 and "speculative_blocks" not in a

        await until(confirmed, "the engine's events confirming the speculative blocks", timeout=60)
    finally:
        stop(ingester)
        engine.stop(kill=True)


async def test_engines_no_ingester_feeds_are_routed_approximately_until_their_events_flow(valkey_url, ix, tmp_path,
                                                                                       gateway):
    """Two simulated engines named to the gateway with --engine, no ingester: each prompt's second request goes
    where its first went, by the approximate index the gateway keeps of what it sent (the prediction equal to what
    the engine then reports), bounded by the engine's KV capacity, the pods' freshness `approximate`, never an
    exact answer. Once an ingester feeds them, they are exact, and the approximate index is gone."""
    import redis.asyncio as aioredis

    engines = [sim_engine(p, tmp_path, blocks=64).start() for p in ("sim-0", "sim-1")]  # 63 usable x 16 tokens
    ingester = None
    try:
        g = gateway(*(a for e in engines for a in ("--engine", e.url))).ready()
        await until(lambda: _models(g), "the engines' models")
        prompt = "Tell me about the weather in the northern mountains this winter, in detail please. " * 2
        first = await g.complete(prompt, max_tokens=2)
        pod = first.headers["x-kvpf-pod"]
        assert first.headers["x-kvpf-reason"] == "no_overlap"
        again = await g.complete(prompt, max_tokens=2)
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (again.headers["x-kvpf-pod"], again.headers["x-kvpf-reason"]) == (pod, "best_overlap")
        assert cached > 0 and again.headers["x-kvpf-predicted-cached-tokens"] == str(cached)
        async with httpx.AsyncClient(timeout=10) as c:
            d = (await c.post(g.url + "/v1/cache/route", json={"model": MODEL, "prompt": prompt})).json()
        assert d["freshness"]["pods"][pod]["state"] == "approximate" and d["freshness"]["state"] == "degraded"
        assert any("approximate" in r for r in d["freshness"]["reasons"])
        # bounded by the engine's capacity (vllm:cache_config_info: 64 blocks of 16 = 1024 tokens, 64 request keys)
        client = aioredis.Redis.from_url(valkey_url)
        for i in range(12):
            await g.complete(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 200)), max_tokens=1)
        sizes = [await client.zcard(f"kvpf:{{{p}}}:approximate") for p in ("sim-0", "sim-1")]
        assert max(sizes) == 64 and min(sizes) > 0, sizes
        # the events start flowing: exact
        ingester = spawn(["ingest", "--valkey-url", valkey_url, *(a for e in engines for a in ("--engine", e.url))],
                         str(tmp_path / "ingest.log"))

        async def exact():
            async with httpx.AsyncClient(timeout=10) as c:
                d = (await c.post(g.url + "/v1/cache/route", json={"model": MODEL, "prompt": prompt})).json()
            return d if all(f["state"] == "current" for f in d["freshness"]["pods"].values()) else None

        d = await until(exact, "both pods fed by the ingester, their answers exact", timeout=60)
        assert d["freshness"]["state"] == "exact"
        await until(lambda: _all_gone(client, ["sim-0", "sim-1"]), "the approximate index dropped")
        await client.aclose()
    finally:
        if ingester is not None:
            stop(ingester)
        for e in engines:
            e.stop(kill=True)


async def _all_gone(client, pods) -> bool:
    return not any([await client.exists(f"kvpf:{{{p}}}:approximate") for p in pods])


async def _raw_server(answer, *, close_after: bool):
    """A raw HTTP/1.1 engine on a real port: each request answered with ``answer`` bytes, the connection closed
    after it when ``close_after`` (an engine dropping a kept-alive connection without saying so)."""
    served = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                served.append(head)
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", served


async def test_the_forwarding_client_reconnects_a_dropped_keepalive_and_reads_every_framing():
    """The gateway's own client (predictor/gateway/forward.py): a pooled connection the engine closed is replaced
    without a failure; chunked and connection-delimited answers come back whole."""
    from kv_preflight.config import Config
    from kv_preflight.predictor.gateway.forward import Upstream

    upstream = Upstream(Config())
    chunked = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
               b"7\r\ndata: 1\r\n9\r\n\n\ndata: 2\r\n0\r\n\r\n")
    server, url, served = await _raw_server(chunked, close_after=True)
    try:
        for _ in range(3):  # each reuse finds the connection closed, and goes again on a new one
            response = await upstream.open(url + "/v1/completions", b"{}", [])
            assert response.status_code == 200 and await response.aread() == b"data: 1\n\ndata: 2"
            await response.aclose()
        assert len(served) == 3
    finally:
        server.close()
    delimited = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n{\"whole\": true}"
    server, url, served = await _raw_server(delimited, close_after=True)
    try:
        response = await upstream.open(url + "/v1/completions", b"{}", [])
        assert await response.aread() == b'{"whole": true}'
        await response.aclose()
    finally:
        server.close()
        await upstream.aclose()


async def test_writes_valkey_refuses_are_counted_and_the_request_answered(valkey_url, ix, gateway, stubs):
    """The booking, the speculative entries and the release go out without holding the request up (written in the
    request's own turn of the loop, no task each): each one Valkey refuses (a key of another type in their place)
    is counted (kvpf_gateway_write_failures_total, the bookings' errors logged), never the request's failure."""
    import redis as redis_sync

    from kv_preflight.index.layout import pod_booking_keys, pod_speculative_key

    x = stubs(body=b'{"x": 1}')
    await ix.fleet.put_pod_records({"pod-x": record(x.url)})
    await fed(ix, "pod-x")
    r = redis_sync.Redis.from_url(valkey_url)
    r.hset(pod_booking_keys("pod-x")[0], "not", "a zset")  # booked.lua's ZSET: WRONGTYPE
    r.hset(pod_speculative_key("pod-x"), "not", "a zset")
    g = gateway().ready()
    for i in range(3):
        got = await g.complete(list(range(7000 + 100 * i, 7064 + 100 * i)))
        assert got.status_code == 200 and got.headers["x-kvpf-pod"] == "pod-x"

    async def counted() -> bool:
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(g.url + "/metrics")).text
        lines = [ln for ln in text.splitlines() if ln.startswith("kvpf_gateway_write_failures_total")]
        return any('what="speculative"' in ln and float(ln.split()[-1]) >= 3 for ln in lines)

    await until(counted, "three speculative writes counted as failed")
    async def logged() -> bool:
        return "bookings: a write to Valkey failed" in g.log.read_text()

    await until(logged, "the bookings' failure logged")
    r.close()
