"""The CLI against a running `kv-preflight up` stack, with no flags: it mirrors the API and takes the stack's
URLs, model and engines from its env file, or from the fleet records (issue 42, items 1 and 2).

One stack for the module (two simulated engines, two ingesters, the predictor), started as `scripts/up` does,
in a data directory the commands find as ./.data (their working directory).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped

pytestmark = pytest.mark.integration

PROMPT = "You are a helpful assistant. Summarize the following report on cache-aware routing."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    where = tmp_path_factory.mktemp("stack")
    port = free_port()
    log = where / "up.out"
    with reaped(where) as env:
        env = {k: v for k, v in env.items() if not k.startswith("KVPF_") or k == "KVPF_TEST_STACK"}
        with open(log, "w") as fh:
            up = subprocess.Popen([sys.executable, "-m", "kv_preflight", "up", "--port", str(port), "--workers", "1"],
                                  cwd=where, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + 180
            while "Ctrl-C stops everything" not in log.read_text():
                assert up.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            engines = re.search(r"engines\s+(\S+) (\S+)", log.read_text()).groups()
            yield {"dir": where, "env": env, "predictor": f"http://127.0.0.1:{port}", "engines": engines}
        finally:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)


def kvpf(stack, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd or stack["dir"], env=env or stack["env"])


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout + out.stderr
    return out.stdout


def test_predict_and_route_mirror_the_api_with_no_flags(stack):
    """`predict` and `route` (text, messages or token ids, --pods, --json) send the API's body to the stack's
    predictor for the stack's model: --json is the API's answer; without it, lines for people."""
    engine = stack["engines"][0]
    httpx.post(engine + "/v1/completions", json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 1}, timeout=30)
    deadline = time.monotonic() + 30
    while True:  # until the ingester has applied what the engine cached
        doc = json.loads(ok(kvpf(stack, "predict", "--prompt", PROMPT, "--json")))
        if doc["predicted_cached_tokens"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert doc["predicted_cached_tokens"] > 0 and doc["best_pod"] == "sim-0", doc
    api = httpx.post(stack["predictor"] + "/v1/cache/predict", json={"model": "sim-model", "prompt": PROMPT}).json()
    timing = ("freshness", "estimated_ttft_ms")
    assert {k: v for k, v in doc.items() if k not in timing} == {k: v for k, v in api.items() if k not in timing}
    text = ok(kvpf(stack, "predict", "--prompt", PROMPT))
    assert f"model sim-model: {doc['predicted_cached_tokens']} of {doc['total_prompt_tokens']} tokens cached on sim-0" \
        in text and "freshness: exact" in text, text
    tokens = httpx.post(engine + "/tokenize", json={"model": "sim-model", "prompt": PROMPT}).json()["tokens"]
    by_ids = json.loads(ok(kvpf(stack, "predict", "--tokens", json.dumps(tokens), "--pods", "sim-1", "--json")))
    assert by_ids["predicted_cached_tokens"] == 0 and [a["pod_id"] for a in by_ids["pod_affinities"]] == []
    messages = json.dumps([{"role": "user", "content": PROMPT}])
    assert "tokens cached" in ok(kvpf(stack, "predict", "--messages", messages))
    routed = json.loads(ok(kvpf(stack, "route", "--prompt", PROMPT, "--json")))
    assert routed["pod_id"] == "sim-0" and routed["reason"], routed
    text = ok(kvpf(stack, "route", "--prompt", PROMPT, "--pods", "sim-0,sim-1"))
    assert text.startswith(f"route to sim-0: {routed['reason']}") and "candidate" in text, text
    bad = kvpf(stack, "route", "--prompt", PROMPT, "--pods", "nope")
    assert bad.returncode == 1 and "the predictor answered 400" in bad.stderr and "nope" in bad.stderr


def test_engine_and_model_come_from_the_stack_or_the_fleet_records(stack, tmp_path):
    """`demo`, `accuracy`, `index inspect --prompt`, `explain` and `tokenizer check` demanded --engine-url and
    --model although the stack `up` started knows both: they come from its env file, and with no env file
    (another directory) from the fleet records the predictor or Valkey holds."""
    out = ok(kvpf(stack, "demo"))
    assert "predictions exact" in out and "MISMATCH" not in out, out
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt": PROMPT + f" Part {i}."}) + "\n" for i in range(3)))
    assert "exact: 3/3" in ok(kvpf(stack, "accuracy", "--workload", str(workload)))
    # item 4: the example workload fits up's simulated engines (30 of its 44 prompts exceeded their 512 tokens)
    examples = Path(__file__).resolve().parents[2] / "examples" / "workload.jsonl"
    assert "exact: 44/44" in ok(kvpf(stack, "accuracy", "--workload", str(examples)))
    inspect = json.loads(ok(kvpf(stack, "index", "inspect", "--prompt", PROMPT, "--json")))
    assert inspect["model"] == "sim-model" and inspect["tokens"] > 16
    assert "model sim-model:" in ok(kvpf(stack, "explain", "--prompt", PROMPT))
    # elsewhere, with the stack's URLs alone (no env file there): the fleet records name the model and engines
    env_file = dict(line.split("=", 1) for line in
                    (l_.removeprefix("export ") for l_ in (stack["dir"] / ".data" / "env").read_text().splitlines())
                    if "=" in line and not line.startswith("#"))
    bare = dict(stack["env"], KVPF_PREDICTOR_URL=env_file["KVPF_PREDICTOR_URL"],
                KVPF_VALKEY_URL=env_file["KVPF_VALKEY_URL"])
    assert "KVPF_MODEL" not in bare
    out = ok(kvpf(stack, "predict", "--prompt", PROMPT, env=bare, cwd=tmp_path))
    assert out.startswith("model sim-model:"), out
    inspect = json.loads(ok(kvpf(stack, "index", "inspect", "--prompt", PROMPT, "--json", env=bare, cwd=tmp_path)))
    assert inspect["model"] == "sim-model"
    assert "predictions exact" in ok(kvpf(stack, "demo", env=bare, cwd=tmp_path))
    none = kvpf(stack, "demo", cwd=tmp_path, env=dict(stack["env"], KVPF_PREDICTOR_URL=f"http://127.0.0.1:{free_port()}"))
    assert none.returncode == 2 and "give --model" in none.stderr, none.stderr


def test_index_stats_names_what_it_counts_and_takes_a_pod(stack):
    """`index stats` said "index counters: none yet (counted as events are applied)" after hundreds of events,
    and gave per pod counters.stored beside blocks with no word on either; it had no --pod (GET /stats?pod=)."""
    engine = stack["engines"][1]
    httpx.post(engine + "/v1/completions", json={"model": "sim-model", "prompt": PROMPT * 3, "max_tokens": 1},
               timeout=30)
    deadline = time.monotonic() + 30
    while True:
        doc = json.loads(ok(kvpf(stack, "index", "stats", "--pod", "sim-1", "--json")))
        if doc["pods"][0]["blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [p["pod_id"] for p in doc["pods"]] == ["sim-1"] and doc["pods"][0]["counters"]["stored"] > 0, doc
    assert doc["summary"]["counters"]["stored"] >= doc["pods"][0]["counters"]["stored"]
    api = httpx.get(stack["predictor"] + "/stats", params={"pod": "sim-1"}).json()
    assert api["pods"][0]["counters"]["stored"] == doc["pods"][0]["counters"]["stored"]
    text = ok(kvpf(stack, "index", "stats"))
    assert "none yet" not in text and "events applied, all pods:" in text, text
    assert "blocks: engine blocks held now;" in text and "skipped or refused" in text, text
    # the footnote on stored and removed: two plain sentences (it was one, run on: "... so stored - removed exceeds
    # blocks, the engine blocks held now, by the copies and what clears and restarts dropped")
    assert ("Stored and removed count what a pod's events stored and removed since it was first indexed, so a block "
            "evicted and stored again counts twice. Stored minus removed can exceed blocks: a second copy of a held "
            "block counts as stored, and a clear or an engine restart drops blocks without counting them as "
            "removed.") in text, text
    bad = kvpf(stack, "index", "stats", "--pod", "nope")
    assert bad.returncode == 1 and "unknown pod nope" in bad.stderr
