"""Every engine fixture end to end: a publisher sends the engine's own frames over real ZMQ (half of them
only through its replay socket, answered in that engine's reply form), a real ``kv-preflight ingest``
process decodes them with the engine's adapter into a real Valkey, and a real predictor answers.

The publishers use their engines' defaults: an empty topic (named on the source with pod=/model=),
except the vLLM file, whose frames carry kv@POD@MODEL and a source with no names.
"""
from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import msgspec
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.engines import ENGINES
from kv_preflight.predictor.scoring.score import engine_cached_tokens
from kv_preflight.index.index import Index
from kv_preflight.keys.chain import request_keys
from tests.conftest import fixture_path
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.engine_stub import EngineStub
from tests.prom import metric

pytestmark = [pytest.mark.integration]

CASES = {
    "sglang-array-frames.jsonl": "sgl-arr",
    "sglang-map-frames.jsonl": "sgl-map",
    "sglang-map-page24-eagle-frames.jsonl": "sgl-eagle",
    "sglang-map-page1-frames.jsonl": "sgl-page1",
    "trtllm-frames.jsonl": "trt-0",
    "vllm-offload-storage-frames.jsonl": "vllm-off",  # named by its topic
}


@pytest.fixture(scope="module")
def predictor(valkey_server, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("engines-e2e") / "predictor.log"
    proc = spawn(["serve", "--valkey-url", valkey_server.url, "--port", str(port)], str(log))
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def _fixture(name: str) -> tuple[dict, list[bytes]]:
    lines = [json.loads(line) for line in fixture_path(name).read_text().splitlines() if line.strip()]
    return lines[0]["header"], [base64.b64decode(m["payload_b64"]) for m in lines[1:]]


async def _wait_seq(ix: Index, pod: str, seq: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = await ix.meta.pod_info(pod)
        if info.seqs.get("0", -1) >= seq:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{pod} did not reach seq {seq}: {info.seqs}")


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(CASES))
async def test_engine_frames_are_ingested_and_predicted(name, valkey_url, predictor, tmp_path):
    header, payloads = _fixture(name)
    adapter = ENGINES[header["engine"]]
    pod = CASES[name]
    zport, rport, mport = free_port(), free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", header["topic"], bind=True,
                        replay_topic=adapter.replay_topic)
    source = f"tcp://127.0.0.1:{zport},replay=tcp://127.0.0.1:{rport},engine={adapter.name}"
    if not header["topic"].startswith("kv@"):
        source += f",pod={pod},model={header['model']}"
    loras = sorted({e["lora"] for e in header["expect"] if "lora" in e})
    # The first half is only in the replay buffer (a restart's blind spot, or frames lost on the wire).
    half = len(payloads) // 2
    for p in payloads[:half]:
        engine.publish_payload(p, send=False)
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--source", source, "--metrics-port", str(mport),
                  *[a for lora in loras for a in ("--lora-name", lora)]], str(tmp_path / "ingester.log"))
    ix = Index.from_url(valkey_url)
    try:
        wait_http(f"http://127.0.0.1:{mport}/metrics")
        for p in payloads[half:]:
            engine.publish_payload(p)
        # then empty batches until one lands: a live frame lost to ZMQ's slow joiner is a gap, replayed
        heartbeat = msgspec.msgpack.encode([time.time(), [], 0])
        deadline = time.monotonic() + 30
        while True:
            last = engine.publish_payload(heartbeat)
            try:
                await _wait_seq(ix, pod, last, timeout_s=0.5)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        info = await ix.meta.pod_info(pod)
        assert not info.incomplete, info  # placeholders, signed hashes, pairs: none may flag the pod
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text
        assert metric(text, "kvpf_ingest_decode_errors_total") == 0
        assert metric(text, "kvpf_ingest_placeholder_events_total") == header.get("placeholders", 0)
        with httpx.Client(base_url=predictor, timeout=10) as client:
            for exp in header["expect"]:
                if "lora" in exp:
                    # The index holds its blocks under the mapped adapter name, and the predictor knows the adapter
                    # from the index alone (kvpf:adapters), with no engine URL or tokenizer naming it.
                    keys = request_keys(exp["tokens"], model=exp["model"])
                    (match,) = await ix.lookup(keys, [pod])
                    page = header["page_size"]
                    assert engine_cached_tokens(match.blocks, 16, page, len(exp["tokens"])) == exp["cached"] > 0
                    assert not await ix.lookup(request_keys(exp["tokens"], model=header["model"]), [pod])
                    resp = client.post("/v1/cache/predict", json={"model": exp["model"], "token_ids": exp["tokens"],
                                                                  "pods": [pod]})
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["predicted_cached_tokens"] == exp["cached"], resp.text
                    continue
                body = {"model": exp.get("model", header["model"]), "token_ids": exp["tokens"], "pods": [pod]}
                resp = client.post("/v1/cache/predict", json=body)
                assert resp.status_code == 200, resp.text
                answer = resp.json()
                assert answer["predicted_cached_tokens"] == exp["cached"], (exp["prompt"], answer)
                assert exp["cached"] > 0 and answer["best_pod"] == pod
                if "pod_tier" in exp:
                    assert answer["pod_affinities"][0]["device_tier"] == exp["pod_tier"], (exp["prompt"], answer)
                assert not answer["pod_affinities"][0].get("incomplete")
    finally:
        stop(proc)
        engine.close()
        await ix.close()


def _frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


@pytest.mark.anyio
async def test_a_bound_socket_named_with_pod_is_trusted_only_while_one_publisher_connects(valkey_url, tmp_path):
    """``--bind ...,pod=P,model=M``: frames carry no pod of their own, so a second publisher on the socket
    makes its frames unattributable; they are refused (counted) until only one publisher is left."""
    import zmq

    port, mport = free_port(), free_port()
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--bind", f"tcp://127.0.0.1:{port},pod=b-0,model=tiny,engine=trtllm",
                  "--metrics-port", str(mport)], str(tmp_path / "ingester.log"))
    ctx = zmq.Context()
    one, two = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
    ix = Index.from_url(valkey_url)
    try:
        wait_http(f"http://127.0.0.1:{mport}/metrics")
        one.connect(f"tcp://127.0.0.1:{port}")
        seq, deadline = 0, time.monotonic() + 30
        while True:  # until the first publisher's batches land (slow joiner)
            one.send_multipart(_frames(seq, msgspec.msgpack.encode([1000.0 + seq, [], 0])))
            try:
                await _wait_seq(ix, "b-0", seq, timeout_s=0.3)
                break
            except TimeoutError:
                seq += 1
                assert time.monotonic() < deadline
        two.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.5)  # the ingester sees the second connection
        refused, deadline = 0.0, time.monotonic() + 20
        while refused < 3 and time.monotonic() < deadline:
            seq += 1
            two.send_multipart(_frames(seq, msgspec.msgpack.encode([1000.0 + seq, [], 0])))
            time.sleep(0.1)
            refused = metric(httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=5).text,
                             "kvpf_ingest_frames_refused_total", endpoint=f"tcp://127.0.0.1:{port}")
        assert refused >= 3
        assert (await ix.meta.pod_info("b-0")).seqs["0"] < seq  # nothing of the crowded socket was written
        two.close(0)
        time.sleep(0.5)
        deadline = time.monotonic() + 20
        while True:  # alone again: the first publisher's frames are accepted (its seq gap replayed or flagged)
            seq += 1
            one.send_multipart(_frames(seq, msgspec.msgpack.encode([1000.0 + seq, [], 0])))
            try:
                await _wait_seq(ix, "b-0", seq, timeout_s=0.3)
                break
            except TimeoutError:
                assert time.monotonic() < deadline
    finally:
        stop(proc)
        one.close(0)
        two.close(0)
        ctx.term()
        await ix.close()


@pytest.mark.anyio
async def test_an_sglang_url_is_discovered_from_server_info_and_replayed_before_it_publishes(
        valkey_url, predictor, tmp_path):
    """``ingest --engine URL`` on an SGLang server: /kv_event_sources is 404, /server_info gives the publisher
    (kv_events_config), the page size and the served model; the pod is named by the serving address. Its
    replay replies carry no topic, yet its history is read at start, before it publishes anything."""
    import threading

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    header, payloads = _fixture("sglang-map-frames.jsonl")
    zport, rport, hport = free_port(), free_port(), free_port()
    info = {"page_size": header["page_size"], "served_model_name": header["model"], "dp_size": 1,
            "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{zport}",
                                            "replay_endpoint": f"tcp://*:{rport}"})}

    async def server_info(request):
        return JSONResponse(info)

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/server_info", server_info)]), host="127.0.0.1",
                                           port=hport, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    engine = EngineStub(f"tcp://127.0.0.1:{zport}", f"tcp://127.0.0.1:{rport}", "", bind=True, replay_topic=False)
    for p in payloads:
        engine.publish_payload(p, send=False)  # all of it only in the replay buffer
    pod = f"127.0.0.1:{hport}"
    mport = free_port()
    proc = spawn(["ingest", "--valkey-url", valkey_url, "--engine", f"http://{pod}", "--metrics-port", str(mport),
                  "--lora-name", "7=sql-lora"], str(tmp_path / "ingester.log"))
    ix = Index.from_url(valkey_url)
    try:
        await _wait_seq(ix, pod, len(payloads) - 1, timeout_s=60)
        assert "page size 64" in (tmp_path / "ingester.log").read_text()
        assert not (await ix.meta.pod_info(pod)).incomplete
        with httpx.Client(base_url=predictor, timeout=10) as client:
            for exp in header["expect"]:
                if "lora" in exp:
                    continue
                answer = client.post("/v1/cache/predict", json={"model": header["model"], "token_ids": exp["tokens"],
                                                                "pods": [pod]}).json()
                assert answer["predicted_cached_tokens"] == exp["cached"] > 0 and answer["best_pod"] == pod, answer
    finally:
        stop(proc)
        engine.close()
        server.should_exit = True
        thread.join(timeout=5)
        await ix.close()
