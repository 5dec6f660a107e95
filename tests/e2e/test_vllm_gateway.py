"""``kv-preflight gateway`` in front of a real vLLM 0.32 (CPU, tiny model), given only the Valkey URL: the
engine found through the ingester's fleet record, prompts tokenized by vLLM's own /tokenize, answers passed
through (plain and streamed, usage included), and each prediction equal to the cached tokens vLLM reports."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import spawn, stop, wait_http

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-gateway", 64),)
MODEL = "tiny"


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def test_gateway_in_front_of_vllm(vllm, valkey_url, tmp_path):
    port = free_port()
    ingester = spawn(["ingest", "--valkey-url", valkey_url, "--engine", vllm.url], str(tmp_path / "ingest.log"))
    gateway = spawn(["gateway", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "gateway.log"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health")
        with httpx.Client(timeout=120) as c:
            deadline = time.monotonic() + 60
            while [m["id"] for m in c.get(url + "/v1/models").json()["data"]] != [MODEL]:
                assert time.monotonic() < deadline, "the fleet record of the vLLM never reached the gateway"
                time.sleep(0.3)
            prompt = "The quick brown fox jumps over the lazy dog, again and again, for a long while. " * 4
            first = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert first.status_code == 200, first.text
            assert first.headers["x-kvpf-pod"] == vllm.pod_id and int(first.headers["content-length"]) == len(first.content)
            seen = []
            while True:  # until the first request's events are in the index
                r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                seen.append((r.headers["x-kvpf-reason"], r.headers["x-kvpf-predicted-cached-tokens"], cached))
                if r.headers["x-kvpf-reason"] == "best_overlap":
                    break
                assert time.monotonic() < deadline, seen
                time.sleep(0.2)
            assert cached > 0 and r.headers["x-kvpf-predicted-cached-tokens"] == str(cached), seen
            # streamed chat, usage in the last event, [DONE] last: as vLLM sent it
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
                    "stream": True, "stream_options": {"include_usage": True}}
            with c.stream("POST", url + "/v1/chat/completions", json=body) as s:
                assert s.status_code == 200 and s.headers["x-kvpf-pod"] == vllm.pod_id
                raw = b"".join(s.iter_raw())
            events = [e for e in raw.split(b"\n\n") if e.strip()]
            assert events[-1].strip() == b"data: [DONE]"
            assert json.loads(events[-2][len(b"data: "):])["usage"]["prompt_tokens"] > 0
        print(f"\nthrough the gateway: {seen}")
    finally:
        stop(gateway)
        stop(ingester)
