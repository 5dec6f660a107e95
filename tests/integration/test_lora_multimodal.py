"""LoRA adapters and multimodal prompts end to end, with no flag naming either: frames vLLM 0.32's own code
published (tests/fixtures/build_extra_keys_frames.py: images starting, ending and sitting inside engine blocks of
8, 16, 24, 32 and 48 tokens, adapters, salts, the tagged extra keys of vllm PR #44706) and frames a real vLLM
sent with two adapters loaded, over real ZMQ into a real ``kv-preflight ingest --source`` (the topic names pod
and model), a real Valkey, and a real ``kv-preflight serve`` given nothing but the Valkey URL."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.index.index import Index
from kv_preflight.predictor.scoring.score import engine_cached_tokens
from tests.conftest import fixture_path
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.engine_stub import EngineStub

pytestmark = [pytest.mark.integration]

C = 16
FRAMES = "vllm-0.32-extra-keys-frames.jsonl"
LIVE = "vllm-0.32-lora-live-frames.jsonl"


def _read(name: str) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in fixture_path(name).read_text().splitlines() if line.strip()]
    return lines[0]["header"], lines[1:]


HEADER, MESSAGES = _read(FRAMES)
CASES = {c["name"]: c for c in HEADER["cases"]}
PROMPT = HEADER["cases"][0]["tokens"]
ITEMS = CASES["mm-e32"]["items"]


def cached(engine_block: int, tokens: list[int] = PROMPT) -> int:
    """What vLLM reuses of a prompt whose every full engine block is cached."""
    return engine_cached_tokens(len(tokens) // C, C, engine_block, len(tokens))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One publisher for every pod of both fixtures, one ingester, one predictor (with the Dynamo port), on a
    Valkey of the module's own (the session's is flushed by other modules' tests between these)."""
    logs = tmp_path_factory.mktemp("lora-mm")
    valkey = ValkeyServer(logs / "valkey", appendonly=False).start()
    valkey_url = valkey.url
    port, mport, pport, dport = free_port(), free_port(), free_port(), free_port()
    engine = EngineStub(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}", "kv@unused@m", bind=True)
    ingester = spawn(["ingest", "--valkey-url", valkey_url, "--source", f"tcp://127.0.0.1:{port}",
                      "--metrics-port", str(mport)], str(logs / "ingester.log"))
    predictor = spawn(["serve", "--valkey-url", valkey_url, "--port", str(pport), "--dynamo-port", str(dport)],
                      str(logs / "predictor.log"))
    try:
        wait_http(f"http://127.0.0.1:{pport}/health")
        wait_http(f"http://127.0.0.1:{dport}/health")
        asyncio.run(_publish(engine, valkey_url, MESSAGES + _read(LIVE)[1]))
        yield f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{dport}", valkey_url
    finally:
        stop(ingester)
        stop(predictor)
        engine.close()
        valkey.stop()


async def _publish(engine: EngineStub, valkey_url: str, messages: list[dict]) -> None:
    await engine.subscribed()
    last: dict[str, int] = {}
    for m in messages:
        engine.send_raw([m["topic"].encode(), m["seq"].to_bytes(8, "big"), base64.b64decode(m["payload_b64"])])
        last[m["topic"].split("@")[1]] = m["seq"]
    ix = Index.from_url(valkey_url)
    try:
        deadline = time.monotonic() + 60
        for pod, seq in last.items():
            while (await ix.meta.pod_info(pod)).seqs.get("0", -1) < seq:
                assert time.monotonic() < deadline, f"{pod} never reached seq {seq}"
                await asyncio.sleep(0.05)
            assert not (await ix.meta.pod_info(pod)).incomplete, pod
        # and until the ingester's lease vouches for each (a pod no lease covers reads "unknown": routes do not
        # weigh its blocks, issue 40)
        while not set(last) <= {p for lease in (await ix.fleet.fleet_view()).live_ingesters().values()
                                for p in lease.pods}:
            assert time.monotonic() < deadline, "the ingester's lease never listed the pods"
            await asyncio.sleep(0.1)
    finally:
        await ix.close()


def predict(url: str, body: dict, path: str = "/v1/cache/predict") -> dict:
    resp = httpx.post(url + path, json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def by_pod(answer: dict) -> dict[str, int]:
    return {a["pod_id"]: a["cached_tokens"] for a in answer["pod_affinities"]}


def test_an_image_prompt_is_predicted_exactly_on_every_engine_block_size(stack):
    """One request, every pod read under the chain of its own engine block size: each exactly what vLLM reuses."""
    url, _, _ = stack
    got = by_pod(predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": ITEMS}))
    want = {pod: cached(e) for pod, e in (("mm-e32", 32), ("mm-e16", 16), ("mm-e48", 48), ("mm-e24", 24),
                                           ("mm-e8", 8))}
    assert got == want
    # the items in any order, modality given: the same
    shuffled = [dict(i, modality="image") for i in reversed(ITEMS)]
    assert by_pod(predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": shuffled})) == want


def test_another_image_or_none_is_a_miss_from_the_block_it_taints(stack):
    url, _, _ = stack
    assert by_pod(predict(url, {"model": "vis", "token_ids": PROMPT})) == {}  # img-a starts at token 5
    other = [dict(i, identifier="img-zz") if i["identifier"] == "img-c" else i for i in ITEMS]
    got = by_pod(predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": other, "pods": ["mm-e32", "mm-e16"]}))
    assert got == {"mm-e32": 96, "mm-e16": 96}  # img-c starts at token 100: blocks from 96 (E=32), 96 (E=16) on
    # the second request on mm-e32 (another image at token 64) cached its own blocks after the shared 64 tokens
    second = CASES["mm-e32-other-b"]["items"]
    assert by_pod(predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": second,
                                "pods": ["mm-e32"]})) == {"mm-e32": cached(32)}


def test_route_and_explain_take_the_items(stack):
    url, _, _ = stack
    d = predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": ITEMS}, "/v1/cache/route")
    assert d["pod_id"] == "mm-e8" and d["cached_tokens"] == cached(8)  # the most cached
    e = predict(url, {"model": "vis", "token_ids": PROMPT, "mm_items": ITEMS, "pods": ["mm-e32"]},
                "/v1/cache/explain")
    assert e["predicted_cached_tokens"] == cached(32)


def test_bad_items_are_refused_with_the_reason(stack):
    url, _, _ = stack
    for items, said in (([{"identifier": "x", "offset": 150, "length": 20}], "runs past"),
                        ([{"identifier": "x", "offset": 0, "length": 9}, {"identifier": "y", "offset": 4, "length": 2}],
                         "overlaps"),
                        ([{"identifier": "x", "offset": -1, "length": 2}], "mm_items must be"),
                        ([{"identifier": "x", "offset": 0, "length": 2, "where": 1}], "mm_items must be")):
        resp = httpx.post(url + "/v1/cache/predict", json={"model": "vis", "token_ids": PROMPT, "mm_items": items})
        assert resp.status_code == 400 and said in resp.json()["error"], resp.text


def test_adapters_are_known_from_the_events_alone(stack):
    """No --engine-url, no /v1/models: the adapter names come from the events' lora_name."""
    url, _, _ = stack
    assert by_pod(predict(url, {"model": "adapter-x", "token_ids": PROMPT})) == {"lora-e32": cached(32)}
    salted = {"model": "adapter-x", "token_ids": PROMPT, "mm_items": ITEMS, "cache_salt": "tenant-a"}
    assert by_pod(predict(url, salted)) == {"lora-e32": cached(32), "tagged-e32": cached(32)}
    assert by_pod(predict(url, {"model": "adapter-y", "token_ids": PROMPT, "cache_salt": "tenant-b"})) == \
        {"lora-e32": cached(32)}
    assert by_pod(predict(url, {"model": "adapter-y", "token_ids": PROMPT})) == {}  # its blocks are salted
    # the real vLLM's adapters
    live = list(range(1000, 1070))
    assert by_pod(predict(url, {"model": "a", "token_ids": live})) == {"lora-0": 64}
    assert by_pod(predict(url, {"model": "a", "token_ids": live, "cache_salt": "s1"})) == {"lora-0": 64}
    assert by_pod(predict(url, {"model": "b", "token_ids": live})) == {"lora-0": 64}
    resp = httpx.post(url + "/v1/cache/predict", json={"model": "adapter-zz", "token_ids": PROMPT})
    assert resp.status_code == 400 and "'adapter-x'" in resp.json()["error"], resp.text


def test_route_keeps_to_the_pods_that_serve_the_adapter(stack):
    url, _, _ = stack
    d = predict(url, {"model": "adapter-x", "token_ids": list(range(50, 150))}, "/v1/cache/route")
    assert d["reason"] == "no_overlap" and {c["pod_id"] for c in d["candidates"]} == {"lora-e32", "tagged-e32"}
    d = predict(url, {"model": "adapter-x", "token_ids": PROMPT}, "/v1/cache/route")
    assert (d["pod_id"], d["cached_tokens"]) == ("lora-e32", cached(32))


def test_explain_names_the_base_model_or_the_other_adapter(stack):
    url, _, _ = stack
    live = list(range(1000, 1070))
    e = predict(url, {"model": "vis", "token_ids": PROMPT, "pods": ["lora-e32"]}, "/v1/cache/explain")
    (f,) = [f for f in e["findings"] if f["kind"] == "other_model"]
    assert "LoRA adapter 'adapter-x' of this base model" in f["detail"], f
    e = predict(url, {"model": "adapter-y", "token_ids": PROMPT, "pods": ["lora-e32"]}, "/v1/cache/explain")
    (f,) = [f for f in e["findings"] if f["kind"] == "other_model"]
    assert "another LoRA adapter, 'adapter-x', of the same base model 'vis'" in f["detail"], f
    e = predict(url, {"model": "a", "token_ids": live[:40] + [9] * 30}, "/v1/cache/explain")
    assert not [f for f in e["findings"] if f["kind"] == "other_model"]  # nothing longer elsewhere
    e = predict(url, {"model": "a", "token_ids": live, "cache_salt": "s2"}, "/v1/cache/explain")
    details = [f["detail"] for f in e["findings"] if f["kind"] == "other_model"]
    assert details == [], details  # another salt: no root holds it
    e = predict(url, {"model": "tiny", "token_ids": live, "cache_salt": "s1"}, "/v1/cache/explain")
    (f,) = [f for f in e["findings"] if f["kind"] == "other_model"]
    assert "LoRA adapter 'a' of this base model" in f["detail"], f


def test_dynamo_query_takes_the_adapter_and_the_items(stack):
    _, dynamo, _ = stack
    q = {"model_name": "vis", "lora_name": "adapter-x", "token_ids": PROMPT, "mm_items": ITEMS,
         "cache_salt": "tenant-a"}
    got = httpx.post(dynamo + "/query", json=q, timeout=30).json()
    assert sorted(i["gpu"] for i in got["instances"].values() if i["gpu"]) == [160, 160], got
    got = httpx.post(dynamo + "/query", json={"model_name": "vis", "token_ids": PROMPT, "mm_items": ITEMS},
                     timeout=30).json()
    assert sorted(i["gpu"] for i in got["instances"].values() if i["gpu"]) == [144, 144, 160, 160, 160], got
    bad = httpx.post(dynamo + "/query", json={"model_name": "vis", "token_ids": PROMPT,
                                              "mm_items": [{"identifier": "x", "offset": 158, "length": 9}]})
    assert bad.status_code == 422, bad.text


def test_the_simulator_serves_adapters_as_vllm_publishes_them(valkey_url, tmp_path):
    """``simulate --lora a --lora b``: adapters' requests cache their own blocks, published with lora_name, lora_id
    and the name in each block's extra keys (as vLLM 0.32); ingested by URL, predicted exactly with no flag,
    and /v1/models lists them after their base, so the fleet record names them."""
    port, zport, rport, pport = free_port(), free_port(), free_port(), free_port()
    sim = spawn(["simulate", "--pod", "sim-lora", "--model", "m", "--port", str(port), "--zmq", f"tcp://*:{zport}",
                 "--replay", f"tcp://*:{rport}", "--block-size", "16", "--blocks", "64", "--lora", "a", "--lora", "b",
                 "--lora", "z"],
                str(tmp_path / "sim.log"))
    url = f"http://127.0.0.1:{port}"
    procs = [sim]
    try:
        wait_http(url + "/v1/models")
        cards = httpx.get(url + "/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("m", None), ("a", "m"), ("b", "m"), ("z", "m")]
        procs.append(spawn(["ingest", "--valkey-url", valkey_url, "--engine", url], str(tmp_path / "ingest.log")))
        procs.append(spawn(["serve", "--valkey-url", valkey_url, "--port", str(pport)], str(tmp_path / "serve.log")))
        purl = f"http://127.0.0.1:{pport}"
        wait_http(purl + "/health")
        prompt = list(range(300, 370))
        for model in ("a", "a", "b"):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}, timeout=30)
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        assert httpx.post(url + "/v1/completions", json={"model": "c", "prompt": prompt}).status_code == 404
        deadline = time.monotonic() + 30
        while True:
            got = httpx.post(purl + "/v1/cache/predict", json={"model": "b", "token_ids": prompt}, timeout=10)
            if got.status_code == 200 and got.json()["predicted_cached_tokens"]:
                break
            assert time.monotonic() < deadline, got.text
            time.sleep(0.2)
        assert by_pod(got.json()) == {"sim-lora": 64}
        assert by_pod(predict(purl, {"model": "a", "token_ids": prompt})) == {"sim-lora": 64}
        assert by_pod(predict(purl, {"model": "m", "token_ids": prompt})) == {}  # the base never served it
        # z has no block anywhere: known, and its base, from the fleet record (the engine's /v1/models) alone
        deadline = time.monotonic() + 30
        while httpx.post(purl + "/v1/cache/predict", json={"model": "z", "token_ids": prompt}).status_code != 200:
            assert time.monotonic() < deadline, "the fleet record never listed z"
            time.sleep(0.2)
        e = predict(purl, {"model": "z", "token_ids": prompt}, "/v1/cache/explain")
        assert any("another LoRA adapter, 'a', of the same base model 'm'" in f["detail"] or
                   "another LoRA adapter, 'b', of the same base model 'm'" in f["detail"]
                   for f in e["findings"] if f["kind"] == "other_model"), e["findings"]
    finally:
        for p in reversed(procs):
            stop(p)


@pytest.mark.anyio
async def test_a_pods_adapters_are_recorded_with_its_batches_and_dropped_with_it(valkey_url):
    """kvpf:adapters: written before the batch that stores an adapter's blocks (as the registry row), read back
    per pod with the pod's model; a forgotten pod's rows go with it, another pod's stay."""
    from kv_preflight.index.entries import StoreBlock

    ix = Index.from_url(valkey_url)
    try:
        for pod in ("p-1", "p-2"):
            await ix.apply_batch(pod_id=pod, rank=0, seq=0, ts=1.0, model="base", engine_block_size=16,
                                 mutations=[StoreBlock(1, "gpu", ix.entry_field(pod, "GPU", 0), (11,), 0, True, 0)],
                                 adapters={"sql", "chat"} if pod == "p-1" else {"sql"})
        assert await ix.meta.adapters() == {"p-1": {"sql": "base", "chat": "base"}, "p-2": {"sql": "base"}}
        await ix.clear_pod("p-1", forget=True)
        assert await ix.meta.adapters() == {"p-2": {"sql": "base"}}
    finally:
        await ix.close()
