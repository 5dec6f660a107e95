"""``kv-preflight simulate`` as a process: its ZMQ frames, replay socket and HTTP surface.

Every frame must decode with ``kv_preflight.events.decode_frames`` and look like the
vLLM 0.32 frames in tests/fixtures byte for byte where content allows.
"""
from __future__ import annotations

import base64
import concurrent.futures
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import msgspec
import pytest
import zmq

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.events import AllBlocksCleared, BlockStored
from kv_preflight.simulator.publisher import encode_payload
from tests.conftest import fixture_path, load_jsonl
from tests.e2e.harness import spawn, stop, wait_http

pytestmark = pytest.mark.integration

MODEL = "sim-model"
END = b"\xff" * 8


@dataclass
class Sim:
    url: str
    pub: str  # where a subscriber connects (bind mode) or binds (connect mode)
    replay: str
    topic: str


@pytest.fixture
def start_sim(tmp_path) -> Iterator:
    procs = []

    def start(*extra: str, pod: str = "sim-0", connect_to: str | None = None) -> Sim:
        port, zmq_port, replay_port = free_port(), free_port(), free_port()
        zmq_arg = connect_to or f"tcp://*:{zmq_port}"
        args = ["simulate", "--pod", pod, "--model", MODEL, "--port", str(port), "--zmq", zmq_arg,
                "--replay", f"tcp://*:{replay_port}", "--block-size", "16", "--blocks", "32", *extra]
        procs.append(spawn(args, str(tmp_path / f"sim-{len(procs)}.log")))
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/v1/models")
        return Sim(url, connect_to or f"tcp://127.0.0.1:{zmq_port}", f"tcp://127.0.0.1:{replay_port}",
                   f"kv@{pod}@{MODEL}")

    yield start
    for p in procs:
        stop(p)


def complete(url: str, prompt, max_tokens: int = 1, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                     **extra}, timeout=30)


def dealer_replay(endpoint: str, start_seq: int) -> list[list[bytes]]:
    """Raw replies, end marker included."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        replies = []
        while sock.poll(5000):
            frames = sock.recv_multipart()
            replies.append(frames)
            if frames[2] == END:
                return replies
        raise TimeoutError("no replay end marker")
    finally:
        sock.close(0)
        ctx.term()


def receive(sock: zmq.Socket, quiet_ms: int = 500) -> list[list[bytes]]:
    out = []
    while sock.poll(quiet_ms):
        out.append(sock.recv_multipart())
    return out


# ---------------------------------------------------------------- frames


def test_live_frames_decode_with_vllm_layout(start_sim):
    sim = start_sim()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sim.pub)
    time.sleep(0.5)  # PUB/SUB slow joiner
    try:
        shared_prefix = list(range(100, 148))
        for i in range(6):
            assert complete(sim.url, shared_prefix + [1000 + i] * 20, max_tokens=20).status_code == 200
        frames = receive(sub)
    finally:
        sub.close(0)
        ctx.term()
    decoded = [VLLM.decode_frames(f) for f in frames]
    assert [d.seq for d in decoded] == list(range(len(decoded))) and len(decoded) >= 6
    for d in decoded:
        assert d.errors == [] and d.topic.pod_id == "sim-0" and d.topic.model == MODEL
        assert d.batch.data_parallel_rank == 0
    first = decoded[0].batch.events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None and first.block_size == 16
    assert first.token_ids[:48] == shared_prefix and len(first.token_ids) == 64  # 68 tokens: 4 full blocks
    # Later requests reuse the 3 shared blocks: stored events continue from them.
    assert decoded[2].batch.events[0].parent_block_hash == first.block_hashes[2]


def test_event_maps_have_vllms_keys_in_vllms_order(start_sim):
    sim = start_sim()
    assert complete(sim.url, list(range(10, 60)), max_tokens=1).status_code == 200
    [frames, _end] = dealer_replay(sim.replay, 0)
    ours = msgspec.msgpack.decode(frames[3])
    theirs = [msgspec.msgpack.decode(base64.b64decode(o["payload_b64"])) for o in load_jsonl("vllm-0.32-live-frames.jsonl")]
    vllm_stored = next(e for b in theirs for e in b[1] if e["type"] == "BlockStored")
    vllm_removed = next(e for b in theirs for e in b[1] if e["type"] == "BlockRemoved")
    assert list(ours[1][0]) == list(vllm_stored)
    assert len(ours) == 3 and isinstance(ours[0], float) and ours[2] == 0
    assert list(vllm_removed) == ["type", "block_hashes", "medium", "group_idx"]


def test_payload_encoding_is_byte_identical_to_vllm():
    with open(fixture_path("vllm-0.32-live-frames.jsonl")) as f:
        for line in f:
            o = json.loads(line)
            payload = base64.b64decode(o["payload_b64"])
            d = VLLM.decode_frames([o["topic"].encode(), int(o["seq"]).to_bytes(8, "big"), payload])
            assert encode_payload(d.batch.ts, d.batch.events, d.batch.data_parallel_rank) == payload


# ---------------------------------------------------------------- replay


def test_replay_answers_like_vllm(start_sim):
    sim = start_sim()
    for i in range(5):
        assert complete(sim.url, [i + 5] * 40, max_tokens=1).status_code == 200
    replies = dealer_replay(sim.replay, 0)
    assert replies[-1] == [b"", b"", END, b""]
    body = replies[:-1]
    assert [int.from_bytes(r[2], "big") for r in body] == [0, 1, 2, 3, 4]
    for r in body:
        assert len(r) == 4 and r[0] == b"" and r[1] == sim.topic.encode()
        d = VLLM.decode_frames(r)
        assert d.errors == [] and d.topic.pod_id == "sim-0" and d.batch is not None
    assert VLLM.decode_frames(replies[-1]).seq == -1
    assert [int.from_bytes(r[2], "big") for r in dealer_replay(sim.replay, 3)[:-1]] == [3, 4]
    assert dealer_replay(sim.replay, 99) == [[b"", b"", END, b""]]


def test_connect_mode_publishes_to_a_binding_subscriber(start_sim):
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(f"tcp://127.0.0.1:{port}")
    try:
        sim = start_sim(connect_to=f"tcp://127.0.0.1:{port}", pod="sim-c")
        frames: list[list[bytes]] = []
        for i in range(20):  # the first frames can go out before the connection is up
            complete(sim.url, [7 + i] * 20)
            frames += receive(sub, quiet_ms=200)
            if frames:
                break
        assert frames, "no frame reached the binding subscriber"
        d = VLLM.decode_frames(frames[0])
        assert d.errors == [] and d.topic.pod_id == "sim-c"
        sources = httpx.get(sim.url + "/kv_event_sources").json()
        assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        sub.close(0)
        ctx.term()


# ---------------------------------------------------------------- HTTP


def test_http_surface(start_sim):
    sim = start_sim("--max-model-len", "256")
    sources = httpx.get(sim.url + "/kv_event_sources").json()
    assert sources == {"0": {"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": sources["0"]["endpoint"], "replay_endpoint": sources["0"]["replay_endpoint"],
                             "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": sim.topic}}
    assert sources["0"]["endpoint"].startswith("tcp://*:")
    assert httpx.get(sim.url + "/v1/models").json()["data"][0]["id"] == MODEL

    tok = httpx.post(sim.url + "/tokenize", json={"prompt": "hello"}).json()
    assert tok == {"count": 6, "max_model_len": 256, "tokens": tok["tokens"], "token_strs": None}
    assert tok["tokens"][0] == 0
    chat_tok = httpx.post(sim.url + "/tokenize", json={"messages": [{"role": "user", "content": "hello " * 10}],
                                                      "add_generation_prompt": True}).json()
    chat = httpx.post(sim.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello " * 10}], "max_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == chat_tok["count"] and chat["usage"]["completion_tokens"] == 3
    again = httpx.post(sim.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello " * 10}], "max_tokens": 3}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (chat_tok["count"] - 1) // 16 * 16

    text = complete(sim.url, "a string prompt that is long enough for blocks").json()
    assert text["usage"]["completion_tokens"] == 1 and text["choices"][0]["finish_reason"] == "length"
    assert complete(sim.url, "default max tokens", max_tokens=None).json()["usage"]["completion_tokens"] == 16
    clamped = complete(sim.url, list(range(5, 250)), max_tokens=100).json()
    assert clamped["usage"]["completion_tokens"] == 256 - 245  # clamped to the context, as vLLM does

    assert httpx.post(sim.url + "/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    too_long = complete(sim.url, list(range(5, 300)))
    assert too_long.status_code == 400 and "maximum context length" in too_long.json()["error"]["message"]
    assert complete(sim.url, "x", max_tokens=0).status_code == 400
    assert complete(sim.url, []).status_code == 400

    metrics = httpx.get(sim.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{engine="0",model_name="{MODEL}"}} 0.0' in metrics


def test_reset_prefix_cache_emits_all_blocks_cleared_with_the_next_step(start_sim):
    sim = start_sim()
    prompt = list(range(20, 60))
    complete(sim.url, prompt)
    assert complete(sim.url, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert httpx.post(sim.url + "/reset_prefix_cache").json() == {"success": True}
    assert complete(sim.url, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    batches = [VLLM.decode_frames(r).batch for r in dealer_replay(sim.replay, 0)[:-1]]
    assert isinstance(batches[-1].events[0], AllBlocksCleared)
    assert isinstance(batches[-1].events[1], BlockStored)


def test_requests_run_one_at_a_time(start_sim):
    # 20 steps of 50 ms per request: long enough that all three have arrived while the first still runs,
    # even on a loaded machine (at 15 x 20 ms the third could arrive after the first finished).
    sim = start_sim("--step-ms", "50")
    seen_running, seen_waiting = set(), set()

    def poll() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            text = httpx.get(sim.url + "/metrics").text
            for line in text.splitlines():
                if line.startswith("vllm:num_requests_running{"):
                    seen_running.add(float(line.split()[-1]))
                if line.startswith("vllm:num_requests_waiting{"):
                    seen_waiting.add(float(line.split()[-1]))
            if 2.0 in seen_waiting:
                return
            time.sleep(0.01)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, sim.url, [30 + i] * 40, 15) for i in range(3)]
        poll()
        results = [f.result().json() for f in futures]
    assert all(r["usage"]["completion_tokens"] == 15 for r in results)
    assert seen_running <= {0.0, 1.0} and 1.0 in seen_running
    assert 2.0 in seen_waiting
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.0' in httpx.get(sim.url + "/metrics").text


def listening_addresses(port: int) -> set[str]:
    """The local addresses a TCP socket listens on ``port`` with (Linux /proc/net/tcp{,6}): "127.0.0.1",
    "0.0.0.0", "::" ..."""
    import ipaddress
    from pathlib import Path

    out = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            addr, _, hexport = cols[1].partition(":")
            if cols[3] != "0A" or int(hexport, 16) != port:
                continue
            raw = bytes.fromhex(addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add(str(ipaddress.ip_address(raw) if width == 4 else ipaddress.IPv6Address(raw)))
    return out


def test_the_event_sockets_listen_where_http_does(tmp_path):
    """`simulate` (as `up` starts it) binds its wildcard event and replay endpoints on --host, loopback by
    default, like every other process of the local stack, not on every interface (issue 42, item 8: they
    listened on 0.0.0.0); /kv_event_sources still names the endpoints as vLLM's answer does."""
    port, zmq_port, replay_port = free_port(), free_port(), free_port()
    proc = spawn(["simulate", "--pod", "sim-lo", "--model", MODEL, "--port", str(port), "--zmq", f"tcp://*:{zmq_port}",
                  "--replay", f"tcp://*:{replay_port}", "--blocks", "32"], str(tmp_path / "sim.log"))
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models")
        assert listening_addresses(port) == {"127.0.0.1"}
        assert listening_addresses(zmq_port) == {"127.0.0.1"}
        assert listening_addresses(replay_port) == {"127.0.0.1"}
        sources = httpx.get(f"http://127.0.0.1:{port}/kv_event_sources", timeout=5).json()
        assert sources["0"]["endpoint"] == f"tcp://*:{zmq_port}"
    finally:
        stop(proc)
