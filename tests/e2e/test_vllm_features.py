"""Against a real vLLM 0.32 (CPU, tiny model, 24 KV blocks so it evicts): local tokenization is
token-for-token the engine's, the accuracy CLI on examples/workload.jsonl is exact, routing and
/metrics read the real engine, and calibrate fits TTFT measured on it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.scoring.ttft import TtftModels
from tests.e2e.conftest import VllmSpec, launcher
from tests.e2e.harness import kvpf_stack, wait_http
from tests.prom import metric

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-feat", 24),)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def tiny_model_dir() -> Path:
    """The launcher's model directory: tiny-model/ beside the script KVPF_VLLM_UP names."""
    return Path(os.path.realpath(launcher())).parent / "tiny-model"


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def reset_cache(engine) -> None:
    httpx.post(engine.url + "/reset_prefix_cache", timeout=30).raise_for_status()


def test_tokenizer_check_cli_finds_parity(vllm):
    out = cli("tokenizer", "check", "--model", "tiny", "--engine-url", vllm.url, "--tokenizer-dir",
              str(tiny_model_dir()), "--samples", str(EXAMPLES / "tokenizer-samples.jsonl"), "--json")
    print(out.stdout[-3000:], out.stderr[-2000:])
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and len(report["samples"]) >= 18
    assert {s["kind"] for s in report["samples"]} == {"prompt", "messages"}
    print(f"\ntokenizer parity against vLLM 0.32: {report['summary']}")


def test_tokenizer_check_cli_reports_drift(vllm, tmp_path):
    """A template that trims content differs from the engine's: the check says where, decoded."""
    drift = tmp_path / "drift"
    drift.mkdir()
    (drift / "tokenizer.json").write_bytes((tiny_model_dir() / "tokenizer.json").read_bytes())
    config = json.loads((tiny_model_dir() / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    (drift / "tokenizer_config.json").write_text(json.dumps(config))
    out = cli("tokenizer", "check", "--model", "tiny", "--engine-url", vllm.url, "--tokenizer-dir", str(drift))
    print(out.stdout)
    assert out.returncode == 1
    assert re.search(r"DIFFERENT chat-whitespace +at token \d+", out.stdout)
    assert "local:" in out.stdout and "engine:" in out.stdout and "template drift" in out.stdout


def test_accuracy_cli_with_local_tokenizer_routing_and_metrics(vllm, valkey_url):
    """The README's accuracy figure: `kv-preflight accuracy` on examples/workload.jsonl, the predictor
    tokenizing prompt and messages locally (after its start-up check passed)."""
    reset_cache(vllm)
    ingest_metrics = free_port()
    serve = ["--engine-url", f"tiny={vllm.url}", "--tokenizer", f"tiny={tiny_model_dir()}",
             "--metrics-interval", "0.2"]
    with kvpf_stack(valkey_url, ["--engine", vllm.url, "--metrics-port", str(ingest_metrics)], serve,
                    "e2e-feat") as stack:
        tok = httpx.get(stack.predictor_url + "/stats", timeout=5).json()["tokenization"]["tiny"]
        assert (tok["source"], tok["check"]) == ("local", "passed"), tok
        out = cli("accuracy", "--engine-url", vllm.url, "--predictor-url", stack.predictor_url, "--model", "tiny",
                  "--workload", str(EXAMPLES / "workload.jsonl"))
        print("\n" + out.stdout + out.stderr[-2000:])
        assert out.returncode == 0
        m = re.search(r"exact: (\d+)/(\d+)", out.stdout)
        assert m, out.stdout
        assert m.group(1) == m.group(2) == "44", out.stdout
        hits = [line for line in out.stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+[1-9]\d*\s+[1-9]", line)]
        assert len(hits) >= 10, "the workload must hit the cache"
        stats = httpx.get(stack.predictor_url + "/stats", timeout=5).json()
        pod = next(p for p in stats["pods"] if p["pod_id"] == vllm.pod_id)
        assert pod["counters"]["removed"] > 0, "24 blocks must force eviction"

        # routing reads the real engine's /metrics (pod id discovered from its /kv_event_sources)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            load = httpx.get(stack.predictor_url + "/stats", timeout=5).json()["engine_load"].get(vllm.pod_id)
            if load and load["running"] is not None:
                break
            time.sleep(0.1)
        assert load and load["models"] == ["tiny"] and load["error"] is None, load
        msgs = json.loads((EXAMPLES / "workload.jsonl").read_text().splitlines()[0])["messages"]
        r = httpx.post(stack.predictor_url + "/v1/cache/route", json={"model": "tiny", "messages": msgs}, timeout=10)
        assert r.status_code == 200, r.text
        decision = r.json()
        assert decision["pod_id"] == vllm.pod_id and decision["candidates"][0]["running"] is not None
        print("route:", decision["reason"], decision["detail"])

        text = httpx.get(stack.predictor_url + "/metrics", timeout=5).text
        assert metric(text, "kvpf_tokenizations_total", model="tiny", source="local") > 0
        assert "kvpf_request_duration_seconds_bucket" in text
        text = httpx.get(f"http://127.0.0.1:{ingest_metrics}/metrics", timeout=5).text
        assert metric(text, "kvpf_ingest_events_total", type="BlockRemoved", pod=vllm.pod_id) > 0, text
        assert "kvpf_ingest_lag_seconds_count" in text


def measure_ttft(engine_url: str, n: int = 36, seed: int = 5) -> list[dict]:
    """Requests with varied length and cached share; latency of a 1-token completion stands for TTFT."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 8000) for _ in range(rng.choice([64, 160, 288]))] for _ in range(3)]
    rows = []
    with httpx.Client(timeout=60) as c:
        c.post(engine_url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})  # warm
        for i in range(n):
            if i % 2:
                tokens = rng.choice(prefixes) + [rng.randrange(10, 8000) for _ in range(rng.randrange(1, 120))]
            else:
                tokens = [rng.randrange(10, 8000) for _ in range(rng.randrange(16, 460))]
            started = time.perf_counter()
            r = c.post(engine_url + "/v1/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 1})
            ms = (time.perf_counter() - started) * 1000
            usage = r.json()["usage"]
            rows.append({"model": "tiny", "prompt_tokens": usage["prompt_tokens"],
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                         "ttft_ms": round(ms, 3)})
    return rows


def test_calibrate_fits_ttft_measured_on_the_engine(vllm, tmp_path):
    reset_cache(vllm)
    rows = measure_ttft(vllm.url)
    assert sum(r["cached_tokens"] > 0 for r in rows) >= 5
    observed = tmp_path / "observed.jsonl"
    observed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_file = tmp_path / "ttft.json"
    out = cli("calibrate", "--input", str(observed), "-o", str(model_file))
    print("\n" + out.stdout + out.stderr)
    assert out.returncode == 0 and "fit error: MAE" in out.stdout
    models = TtftModels.load(model_file)
    assert "tiny" in models.models
    # the served estimate uses it: serve --ttft-model
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", "serve", "--valkey-url", f"redis://127.0.0.1:{free_port()}/0",
                             "--port", str(port), "--ttft-model", str(model_file), "--tokenizer",
                             f"tiny={tiny_model_dir()}", "--no-tokenizer-check"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/metrics")  # /health is 503 here: no Valkey
        r = httpx.post(f"http://127.0.0.1:{port}/v1/cache/route", json={"model": "tiny", "prompt": "hello"}, timeout=5)
        # Valkey is not there: the route fails fast and clearly, the model file having loaded
        assert r.status_code == 503 and "valkey" in r.json()["error"]
    finally:
        proc.terminate()
        proc.wait(10)
