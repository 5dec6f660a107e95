"""``kv-preflight tokenizer check`` against an engine stub on a real port, and ``kv-preflight calibrate``."""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from kv_preflight.cli.main import cli
from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.tokens.local import LocalTokenizer
from kv_preflight.predictor.scoring.ttft import PrefillModel, TtftModels
from tests.integration.http_engine import HttpEngine
from tests.tokenizer_files import write_tokenizer

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_check_exit_codes_and_report(tok_dir, tmp_path):
    tok = LocalTokenizer.load(tok_dir)
    same = HttpEngine("p", ["m"], tokenize_fn=lambda b: tok.encode(prompt=b.get("prompt"), messages=b.get("messages")))
    drift = HttpEngine("p", ["m"], tokenize_fn=lambda b: tok.encode(prompt=b.get("prompt"), messages=b.get("messages"))
                       + ([7] if b.get("prompt", "").endswith(" ") else []))
    same.start(), drift.start()
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"name": "mine", "prompt": "ends with a space "}\n')
    try:
        runner = CliRunner()
        ok = runner.invoke(cli, ["tokenizer", "check", "--model", "m", "--engine-url", same.url, "--tokenizer-dir",
                                 str(tok_dir), "--samples", str(samples)])
        assert ok.exit_code == 0, ok.output
        assert "15/15 samples identical" in ok.output
        bad = runner.invoke(cli, ["tokenizer", "check", "--model", "m", "--engine-url", drift.url, "--tokenizer-dir",
                                  str(tok_dir), "--samples", str(samples), "--json"])
        assert bad.exit_code == 1
        report = json.loads(bad.output)
        mine = next(s for s in report["samples"] if s["sample"] == "mine")
        assert mine["ok"] is False and mine["hint"].startswith("trailing whitespace")
        assert mine["engine_token"].startswith("7 ") and mine["local_token"] == "(end)"
        down = runner.invoke(cli, ["tokenizer", "check", "--model", "m", "--engine-url",
                                   f"http://127.0.0.1:{free_port()}", "--tokenizer-dir", str(tok_dir)])
        assert down.exit_code == 2 and "not checked" in down.output
        no_dir = runner.invoke(cli, ["tokenizer", "check", "--model", "m", "--engine-url", same.url])
        assert no_dir.exit_code == 2 and "--tokenizer-dir" in no_dir.output
    finally:
        same.stop(), drift.stop()


def test_calibrate_writes_and_merges_the_model_file(tmp_path):
    truth = PrefillModel(overhead_ms=12.0, prefill_tokens_per_s=6000.0, attention_ms_per_mpair=4.0)
    rng = random.Random(3)
    rows = []
    for _ in range(50):
        n = rng.randrange(32, 8000)
        k = rng.randrange(0, n) // 16 * 16
        rows.append({"model": "big", "prompt_tokens": n, "cached_tokens": k, "ttft_ms": truth.estimate_ms(n, k)})
    observed = tmp_path / "observed.jsonl"
    observed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_file = tmp_path / "ttft.json"
    out_file.write_text(json.dumps({"models": {"other": {"overhead_ms": 1, "prefill_tokens_per_s": 100}}}))
    res = CliRunner().invoke(cli, ["calibrate", "--input", str(observed), "--model", "big", "-o", str(out_file)])
    assert res.exit_code == 0, res.output
    assert "fit error: MAE" in res.output and "p90 relative error" in res.output
    models = TtftModels.load(out_file)
    assert set(models.models) == {"big", "other"}
    assert models.for_model("big").prefill_tokens_per_s == pytest.approx(6000, rel=1e-3)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_tokens": 5}\n')
    res = CliRunner().invoke(cli, ["calibrate", "--input", str(bad)])
    assert res.exit_code == 1 and "bad.jsonl:1" in res.output


@pytest.mark.parametrize("args, says", [
    (["keys", "--model", "m", "--tokens", "@/nonexistent"], "cannot read /nonexistent"),
    (["index", "inspect", "--valkey-url", "redis://127.0.0.1:1/0", "--model", "m", "--tokens", "@/nonexistent"],
     "cannot read /nonexistent"),
    (["index", "stats", "--valkey-url", "localhost:7800"], "needs a scheme"),
])
def test_bad_input_is_one_clear_line_not_a_traceback(args, says):
    """A missing @file and a URL with no scheme are one clear line, not a raw traceback."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "kv_preflight", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr + out.stdout
    assert says in out.stderr


def test_calibrate_says_how_many_rows_were_left_out_and_why(tmp_path):
    """A 40-row file printed "35 observations" without saying 5 were dropped (Operator experience, 8)."""
    rows = [{"prompt_tokens": 100 + 37 * i, "cached_tokens": 0, "ttft_ms": 5 + 0.01 * (100 + 37 * i)} for i in range(35)]
    rows += [{"prompt_tokens": 200 + 50 * i, "cached_tokens": 0, "ttft_ms": 900.0 + i} for i in range(5)]  # queued
    data = tmp_path / "obs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(cli, ["calibrate", "--input", str(data)])
    assert res.exit_code == 0, res.output
    assert "*: 40 observations, 5 slow outlier(s) left out (--no-robust keeps them), fitted on 35" in res.output
    kept = CliRunner().invoke(cli, ["calibrate", "--input", str(data), "--no-robust"])
    assert "*: 40 observations, fitted on 40" in kept.output


def test_index_stats_json_names_fields_as_get_stats_does(valkey_url):
    """`index stats --json` names its fields as `/stats` does (index_keys, last_seq; keys and seq kept too)."""
    import asyncio
    import time

    from kv_preflight.predictor.stats import build_stats
    from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry

    async def write():
        ix = Index.from_url(valkey_url)
        try:
            await ix.apply_batch(pod_id="pod-n", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                                 mutations=[StoreBlock(5, "gpu", encode_entry(make_entry("pod-n", "GPU", 0)), (50,))])
            return await ix.meta.pod_infos(["pod-n"])
        finally:
            await ix.close()

    pods = asyncio.run(write())
    res = CliRunner().invoke(cli, ["index", "stats", "--valkey-url", valkey_url, "--json"])
    cli_stats = json.loads(res.stdout)
    http_stats = build_stats(key_count=1, pods=pods, index_counters={}, process=_process(), now=time.time())
    assert {"index_keys", "pods", "index_counters"} <= set(cli_stats) & set(http_stats)
    assert set(http_stats["pods"][0]) <= set(cli_stats["pods"][0])
    assert cli_stats["pods"][0]["last_seq"] == {"0": 0} == cli_stats["pods"][0]["seq"]  # old name kept
    assert cli_stats["keys"] == cli_stats["index_keys"]


def _process():
    from kv_preflight.predictor.stats import ProcessCounters

    return ProcessCounters()
