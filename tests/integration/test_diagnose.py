"""``kv-preflight diagnose sessions|fleet`` and ``kv-preflight explain`` as processes: a generated rolling-window
log with a real tokenizer and chat template, and a round-robin workload over two simulated engines with a
real ingester, predictor and valkey-server, whose hit rates, p and duplication are known in advance."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from kv_preflight.predictor.tokens.local import LocalTokenizer
from kv_preflight.index.index import Index
from kv_preflight.keys.chain import request_keys
from tests.e2e.harness import kvpf_stack
from tests.integration.sim import sim_engine
from tests.tokenizer_files import write_tokenizer

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=timeout)


def test_diagnose_sessions_finds_the_window_and_the_turn(tmp_path):
    tok_dir = write_tokenizer(tmp_path / "tok")
    tok = LocalTokenizer.load(tok_dir)
    system = {"role": "system", "content": "You are a helpful assistant. " * 3}
    window = 4  # the client keeps the system prompt and the last 4 messages
    lines, history, expected_cuts = [], [], {}
    for turn in range(1, 8):
        user = {"role": "user", "content": f"Question {turn}: what does the quick brown fox do?"}
        kept = history[-window:]
        if len(history) > window:
            expected_cuts[turn] = len(history) - window
        lines.append({"session": "s1", "turn": turn, "model": "m", "messages": [system, *kept, user]})
        # a session that never truncates, logged as token ids
        lines.append({"session": "s2", "turn": turn, "model": "m",
                      "token_ids": tok.encode_messages([system, *history, user])})
        history += [user, {"role": "assistant", "content": f"Answer {turn}: it jumps over the lazy dog."}]
    log = tmp_path / "sessions.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = cli("diagnose", "sessions", str(log), "--tokenizer", f"m={tok_dir}", "--json")
    assert out.returncode == 0, out.stderr
    s1, s2 = json.loads(out.stdout)
    assert s1["session"] == "s1" and s1["window_from_turn"] == min(expected_cuts) == 4
    assert [t["turn"] for t in s1["turns"] if t["window_cut"]] == sorted(expected_cuts)
    # each cut is the exchange (user + assistant) the window dropped since the turn before, in tokens as the
    # template renders them: exchange t-3 at turn t
    def exchange(k: int) -> int:
        return len(tok.encode_messages([system, *history[2 * k - 2:2 * k]])) - len(tok.encode_messages([system]))

    assert {t["turn"]: t["window_cut"] for t in s1["turns"] if t["window_cut"]} == \
        {turn: exchange(turn - 3) for turn in expected_cuts}
    assert s2["window_from_turn"] is None and s2["tokens_prefilled"] == s2["tokens_prefilled_if_stable"]
    text = cli("diagnose", "sessions", str(log), "--tokenizer", f"m={tok_dir}").stdout
    assert "window cuts from turn 4" in text and "sticky routing" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session": 1, "turn": 1, "model": "m"}\n')
    out = cli("diagnose", "sessions", str(bad))
    assert out.returncode == 1 and "bad.jsonl:1: needs exactly one of messages, token_ids" in out.stderr
    assert "Traceback" not in out.stderr


def wait_held(valkey_url: str, tokens: list[int], pod: str, blocks: int) -> None:
    """Until the ingester has written what the engine cached (read straight from Valkey, not via the predictor,
    whose traffic totals are under test)."""
    keys = request_keys(tokens, model="sim", block_size=16)

    async def held() -> int:
        index = Index.from_url(valkey_url)
        try:
            found = await index.lookup(keys)
        finally:
            await index.close()
        return next((m.blocks for m in found if m.pod_id == pod), 0)

    deadline = time.monotonic() + 30
    while asyncio.run(held()) < blocks:
        assert time.monotonic() < deadline, f"{pod} never held {blocks} blocks"
        time.sleep(0.05)


def test_diagnose_fleet_on_a_round_robin_workload_with_a_known_answer(valkey_url, tmp_path):
    a, b = sim_engine("pod-a", tmp_path).start(), sim_engine("pod-b", tmp_path).start()
    try:
        with kvpf_stack(valkey_url, ["--engine", a.url, "--engine", b.url],
                        ["--engine-url", f"sim={a.url}"], "diag-fleet") as stack:
            families, length, hit = 3, 69, 64  # 4 full blocks of 16 reused on a repeat; 5 tokens past them
            # token-id prompts starting with the simulator's BOS (0), as its tokenizer makes them
            prompts = [[0] + [4 + (f * 37 + i) % 250 for i in range(length - 1)] for f in range(families)]
            for rnd in range(4):  # round robin: A, B, A, B per family
                engine = (a, b)[rnd % 2]
                for prompt in prompts:
                    r = httpx.post(stack.predictor_url + "/v1/cache/predict", json={"model": "sim", "token_ids": prompt})
                    assert r.status_code == 200 and r.json()["warnings"] == []
                    assert r.json()["predicted_cached_tokens"] == (0 if rnd == 0 else hit)
                    httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": prompt,
                                                                     "max_tokens": 1}, timeout=30).raise_for_status()
                    wait_held(valkey_url, prompt, engine.pod, 4)
            html = tmp_path / "fleet.html"
            out = cli("diagnose", "fleet", "--valkey-url", valkey_url, "--predictor-url", stack.predictor_url,
                      "--engine-url", f"sim={a.url}", "--pod-metrics", f"pod-b={b.url}", "--window", "0",
                      "--json", "--html", str(html))
            assert out.returncode == 0, out.stderr
            d = json.loads(out.stdout)
            sends = 4 * families
            assert d["n_pods"] == 2 and d["predictions"] == sends
            assert d["observed_hit_rate"] == round(2 * families * hit / (sends * length), 4)
            for pod in d["pods"]:
                assert (pod["queries"], pod["hits"]) == (2 * families * length, families * hit), pod
            p = round(3 * families * hit / (sends * length), 4)
            assert d["p"] == p and d["round_robin_bound"] == round(p / 2, 4)
            assert d["duplication_factor"] == 2 and len(d["families"]) == families
            assert all(f["pods"] == ["pod-a", "pod-b"] and f["predictions"] == 4 for f in d["families"])
            assert d["verdict"] == "fragmented"
            page = html.read_text()
            assert "<table" in page and "fragmented" in page and "pod-b" in page
            assert "<script" not in page and "http" not in page.replace("http-equiv", "")  # opens offline
            stats = httpx.get(stack.predictor_url + "/stats").json()
            last = stats["fleet_diagnosis"]
            assert last["summary"]["verdict"] == "fragmented" and last["age_s"] >= 0
            assert stats["traffic"]["predictions"] == sends
            # a readable text report too, over a (short) window in which nothing happens
            text = cli("diagnose", "fleet", "--valkey-url", valkey_url, "--predictor-url", stack.predictor_url,
                       "--engine-url", f"sim={a.url}", "--pod-metrics", f"pod-b={b.url}", "--window", "0.2")
            assert text.returncode == 0 and "verdict: no_traffic" in text.stdout, text.stderr

            # kv-preflight explain against the same predictor: a front cut, decoded by the engine
            out = cli("explain", "--url", stack.predictor_url, "--model", "sim",
                      "--tokens", json.dumps(prompts[0][10:]), "--compare-tokens", json.dumps(prompts[0]))
            assert out.returncode == 0, out.stderr
            assert "rolling_context" in out.stdout and "10 token(s) cut" in out.stdout
            assert "pod-a: stops at block 0" in out.stdout
            out = cli("explain", "--url", stack.predictor_url, "--model", "sim", "--tokens", json.dumps(prompts[1]),
                      "--json")
            doc = json.loads(out.stdout)
            assert doc["findings"] == [] and doc["predicted_cached_tokens"] == hit
            assert {p["pod_id"]: p["reused_tokens"] for p in doc["pods"]} == {"pod-a": hit, "pod-b": hit}
            out = cli("explain", "--url", stack.predictor_url, "--model", "sim")
            assert out.returncode != 0 and "give one of --prompt" in out.stderr
    finally:
        a.stop()
        b.stop()
