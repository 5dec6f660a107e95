"""The predictor's request limits, from an outside hardening review: the pods filter's length, JSON
nesting, how much input an error echoes, the media type, a client leaving mid-body, and slow clients
(headers and body), against a real valkey-server and, for what the HTTP server does, real uvicorn
servers: in a thread for each HTTP protocol, and ``kv-preflight serve`` itself."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.errors import ECHO_LIMIT
from kv_preflight.predictor.http.protocols import protocol_factory
from kv_preflight.config import Config
from tests.e2e.harness import stop, wait_http
from tests.integration.test_predictor import MODEL, PREDICT, IndexWriter, tokens_of
from tests.prom import metric

pytestmark = [pytest.mark.integration]

ROUTE = "/v1/cache/route"
# An error may carry fixed text and a few clipped inputs, never much more than one input's limit.
ERROR_BOUND = 4 * ECHO_LIMIT


@pytest.fixture
def writer(ix):
    return IndexWriter(ix)


class EchoEngine:
    """An engine whose /tokenize refuses every prompt and quotes it back whole, as some do."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

        async def tokenize(request: Request) -> JSONResponse:
            body = await request.json()
            return JSONResponse({"error": {"message": f"cannot tokenize {body.get('prompt')!r}"}}, 400)

        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/tokenize", tokenize, methods=["POST"])]),
                                                    host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "EchoEngine":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "echo engine did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
async def make_client(valkey_url):
    made = []

    async def make(**overrides) -> httpx.AsyncClient:
        app = create_app(Config(**({"valkey_url": valkey_url, "block_size": 16} | overrides)))
        await app.state.predictor.fleet.read_once()  # as the lifespan does before serving (not run here)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://predictor")
        made.append((app, client))
        return client

    yield make
    for app, client in made:
        await client.aclose()
        await app.state.predictor.aclose()


# ---------------------------------------------------------------- 1a: the pods filter is bounded


@pytest.mark.anyio
@pytest.mark.parametrize("path", [PREDICT, ROUTE])
async def test_pods_filter_over_the_limit_is_a_400_naming_it(make_client, writer, path):
    await writer.store("pod-a", tokens_of(32))
    for i in range(7):  # pods the index knows: /route refuses a filter naming unknown pods
        await writer.store(f"p{i}", tokens_of(16, start=50_000 + 100 * i))
    client = await make_client(max_pods_filter=8)
    ok = {"model": MODEL, "token_ids": tokens_of(33), "pods": ["pod-a"] + [f"p{i}" for i in range(7)]}
    r = await client.post(path, json=ok)
    assert r.status_code == 200, r.text
    nine = ok["pods"] + ["one-too-many"]
    for body in ({**ok, "pods": nine}, {**ok, "token_ids": [], "pods": nine},
                 {"model": MODEL, "prompt": "hi", "pods": nine},
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "pods": nine}):
        r = await client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert "too many pods in the pods filter: 9 > the limit of 8 (max_pods_filter)" in r.json()["error"]


@pytest.mark.anyio
async def test_default_pods_limit_is_1024(make_client, writer):
    await writer.store("pod-a", tokens_of(32))
    client = await make_client()
    pods = ["pod-a"] + [f"pod-{i}" for i in range(1023)]
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(33), "pods": pods})
    assert r.status_code == 200 and r.json()["predicted_cached_tokens"] == 32, r.text
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(33), "pods": pods + ["pod-x"]})
    assert r.status_code == 400 and "1025 > the limit of 1024" in r.json()["error"]
    big = [f"p{i}" for i in range(700_000)]  # the review's case: refused before Valkey sees it
    r = await client.post(PREDICT, json={"model": MODEL, "token_ids": tokens_of(33), "pods": big})
    assert r.status_code == 400 and "700000 > the limit of 1024" in r.json()["error"]


# ---------------------------------------------------------------- 1b: deep JSON is a 400, never a 500


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


DEEP_BODIES = {  # where the nesting is: (body, what the error says)
    "top level": (nested(5000), "JSON object"),
    "in messages": (b'{"model": "test-model", "messages": ' + nested(1500) + b"}", "nested too deeply"),
    "in a message": (b'{"model": "test-model", "messages": [{"role": "user", "content": ' + nested(1200) + b"}]}",
                     "nested too deeply"),
    "decodable but deep content": (b'{"model": "test-model", "messages": [{"role": "user", "content": '
                                   + nested(900) + b"}]}", "messages nests more than 32 levels"),
    "in an unknown field": (b'{"model": "test-model", "token_ids": [1, 2], "extra": ' + nested(100_000) + b"}",
                            "nested too deeply"),
    "in pods": (b'{"model": "test-model", "prompt": "x", "pods": ' + nested(3000) + b"}", "pods must be a list"),
    "in an object": (b'{"model": "test-model", "token_ids": [1], "x": ' + b'{"a": ' * 2000 + b"1" + b"}" * 2001,
                     "nested too deeply"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("path", [PREDICT, ROUTE])
@pytest.mark.parametrize("where", list(DEEP_BODIES))
async def test_deeply_nested_json_is_a_400(make_client, writer, where, path):
    await writer.store("pod-a", tokens_of(16))
    client = await make_client(engine_urls={MODEL: "http://127.0.0.1:9"})  # never reached
    body, needle = DEEP_BODIES[where]
    r = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:500]
    assert needle in r.json()["error"], r.json()
    stats = (await client.get("/stats")).json()
    assert "internal" not in stats["process"]["errors"]


# ---------------------------------------------------------------- 1c: errors echo at most ECHO_LIMIT characters


@pytest.mark.anyio
async def test_a_5mb_model_name_is_not_echoed_whole(make_client):
    client = await make_client(engine_urls={"known": "http://127.0.0.1:9"})  # a model known: "unknown" is a 400
    name = "m" * (5 * 1024 * 1024)
    r = await client.post(PREDICT, json={"model": name, "token_ids": [1, 2, 3]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.startswith("unknown model 'mmm") and len(error) < ERROR_BOUND, len(error)
    assert f"{len(name) + 2} characters, cut to {ECHO_LIMIT}" in error  # says it was cut (repr adds 2 quotes)
    r = await client.post(PREDICT, json={"model": name, "prompt": "hello"})
    assert r.status_code == 400 and len(r.json()["error"]) < ERROR_BOUND


@pytest.mark.anyio
async def test_inputs_echoed_anywhere_are_clipped(make_client, valkey_url):
    long = "x" * 100_000
    in_url = "x" * 20_000  # httpx refuses URLs over 64 KiB
    with EchoEngine() as engine:
        client = await make_client(engine_urls={MODEL: engine.url})
        cases = [
            lambda: client.post(PREDICT, json={"model": MODEL, "prompt": long}),  # the engine quotes it back
            lambda: client.post(PREDICT, content=b"{}", headers={"content-type": "text/" + long}),
            lambda: client.get("/stats", params={"pod": in_url}),
            lambda: client.get("/stats", params={"pods_limit": in_url}),
            lambda: client.get("/stats", params={"pods_offset": "9" * 5000}),
        ]
        for request in cases:
            r = await request()
            assert 400 <= r.status_code < 500, r.text[:300]
            assert len(r.json()["error"]) < ERROR_BOUND, (r.status_code, r.json()["error"][:300])
            assert "x" * (ECHO_LIMIT + 1) not in r.json()["error"]


# ---------------------------------------------------------------- 1d: media types


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml", "text/json"])
async def test_a_non_json_content_type_is_a_415(make_client, writer, content_type):
    await writer.store("pod-a", tokens_of(16))
    client = await make_client()
    body = json.dumps({"model": MODEL, "token_ids": tokens_of(17)}).encode()
    r = await client.post(PREDICT, content=body, headers={"content-type": content_type})
    assert r.status_code == 415, r.text
    assert "is not JSON" in r.json()["error"] and r.headers["content-type"] == "application/json"


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", [None, "", "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.kvpf+json",
                                          "application/merge-patch+json; charset=UTF-8"])
async def test_json_content_types_and_none_are_read_as_json(make_client, writer, content_type):
    await writer.store("pod-a", tokens_of(16))
    client = await make_client()
    body = json.dumps({"model": MODEL, "token_ids": tokens_of(17)}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    r = await client.post(PREDICT, content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["predicted_cached_tokens"] == 16


# ---------------------------------------------------------------- 1e, 1f: real servers, raw sockets


class ThreadServer:
    """The predictor app under uvicorn in a thread, with the given HTTP protocol and read timeout."""

    def __init__(self, cfg: Config, http: str):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=self.port,
                                                    http=protocol_factory(http, cfg.request_read_timeout_s),
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "predictor did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)  # a guard against hanging the suite, far above any bound under test
    return s


def read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            return out
        out += chunk


def read_response(s: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_slow_headers_are_cut_off_while_other_requests_are_served(valkey_url, http):
    cfg = Config(valkey_url=valkey_url, request_read_timeout_s=2.0)
    with ThreadServer(cfg, http) as srv:
        half = raw(srv.port)
        half.sendall(b"POST /v1/cache/predict HTTP/1.1\r\nHost: predictor\r\nContent-Ty")
        silent = raw(srv.port)  # connects, sends nothing at all
        idle_then_slow = raw(srv.port)  # one full request, then half of the next one's headers
        idle_then_slow.sendall(b"GET /health HTTP/1.1\r\nHost: predictor\r\n\r\n")
        assert read_response(idle_then_slow).startswith(b"HTTP/1.1 200")
        idle_then_slow.sendall(b"GET /health HTTP/1.1\r\nHo")
        # meanwhile, everyone else is served
        for _ in range(3):
            assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10).status_code == 200
        for s in (half, silent, idle_then_slow):
            got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 408"), got
            assert b"request_read_timeout" in got
            s.close()
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_slow_body_is_a_408_and_the_connection_closes(valkey_url, http):
    cfg = Config(valkey_url=valkey_url, request_read_timeout_s=2.0)
    with ThreadServer(cfg, http) as srv:
        s = raw(srv.port)
        s.sendall(b"POST /v1/cache/predict HTTP/1.1\r\nHost: predictor\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        assert httpx.get(f"http://127.0.0.1:{srv.port}/health", timeout=10).status_code == 200
        got = read_until_closed(s)
        s.close()
        assert got.startswith(b"HTTP/1.1 408"), got
        assert b"request body did not arrive within 2s" in got
        stats = httpx.get(f"http://127.0.0.1:{srv.port}/stats", timeout=10).json()
        assert stats["process"]["errors"] == {"request_timeout": 1}


def spawn_serve(valkey_url: str, port: int, log_path, *extra: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "kv_preflight", "serve", "--valkey-url", valkey_url, "--port", str(port),
                             *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_serve_bounds_header_reads_in_every_worker(valkey_url, tmp_path):
    """The flag reaches the protocol of ``serve`` and of each of its ``--workers`` processes."""
    port = free_port()
    proc = spawn_serve(valkey_url, port, tmp_path / "serve.log", "--workers", "2", "--request-read-timeout", "1.5")
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        slow = [raw(port) for _ in range(6)]  # new connections: both workers get some
        for s in slow:
            s.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        for s in slow:
            got = read_until_closed(s)
            assert got.startswith(b"HTTP/1.1 408"), got
            s.close()
    finally:
        stop(proc)


def test_a_client_leaving_mid_body_is_counted_as_such_not_as_an_internal_error(valkey_url, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    proc = spawn_serve(valkey_url, port, log_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        for _ in range(2):
            s = raw(port)
            s.sendall(b"POST /v1/cache/predict HTTP/1.1\r\nHost: predictor\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{\"model\": \"m\", \"token_ids\": [1, 2,")
            s.close()
        deadline = time.monotonic() + 20
        while True:
            text = httpx.get(url + "/metrics", timeout=5).text
            if metric(text, "kvpf_predictor_client_disconnects_total") >= 2:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        assert metric(text, "kvpf_predictor_client_disconnects_total") == 2
        errors = httpx.get(url + "/stats", timeout=5).json()["process"]["errors"]
        assert errors == {"client_disconnect": 2}
    finally:
        stop(proc)
    log = log_path.read_text()
    lines = [line for line in log.splitlines() if "disconnected before sending the whole" in line]
    assert len(lines) == 2, log
    assert "Traceback" not in log and "internal error" not in log and "unexpected error" not in log, log


@pytest.mark.anyio
async def test_unknown_body_fields_are_refused_not_ignored(valkey_url):
    """A predict body with "pod" instead of "pods" was accepted and the filter silently dropped."""
    from httpx import ASGITransport

    from kv_preflight.predictor.http.app import create_app
    from kv_preflight.config import Config

    import redis

    from kv_preflight.index.layout import PODS_KEY

    redis.Redis.from_url(valkey_url).hset(PODS_KEY, "a", "m")  # a pod serving model m
    app = create_app(Config(valkey_url=valkey_url))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=ASGITransport(app), base_url="http://t") as client:
            for path in ("/v1/cache/predict", "/v1/cache/route"):
                r = await client.post(path, json={"model": "m", "token_ids": [1] * 32, "pod": ["a"]})
                assert r.status_code == 400, r.text
                assert "unknown field 'pod'" in r.json()["error"] and "did you mean 'pods'" in r.json()["error"]
            ok = await client.post("/v1/cache/predict", json={"model": "m", "token_ids": [1] * 32, "pods": ["a"]})
            assert ok.status_code == 200, ok.text
