"""The benchmark runs and its correctness checks hold (figures are its business, not the tests')."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kv_preflight.cli.bench import loadgen
from kv_preflight.cli.bench.workload import event_stream
from kv_preflight.engines.vllm import ENGINE as VLLM

pytestmark = pytest.mark.integration


def test_workload_is_vllm_032_frames_with_chained_parents():
    st = event_stream(pods=2, target_blocks=3000, capacity_blocks=500)
    seen = set()
    chained = 0
    for _, frames in st.frames:
        d = VLLM.decode_frames(frames)
        assert not d.errors and d.batch is not None
        for ev in d.batch.events:
            if type(ev).__name__ == "BlockStored":
                assert ev.block_size == 32 and len(ev.token_ids) == 32 * len(ev.block_hashes)
                chained += ev.parent_block_hash is not None
                seen.update(ev.block_hashes)
    assert st.removed_blocks > 0 and chained > 0 and st.prompts


def test_bodies_file_round_trip(tmp_path):
    bodies = [b"{}", b'{"a": 1}', b""]
    loadgen.write_bodies(str(tmp_path / "b"), bodies)
    assert loadgen.read_bodies(str(tmp_path / "b")) == bodies


def test_quick_bench_rows_and_checks(tmp_path):
    out, page = tmp_path / "bench.json", tmp_path / "bench.html"
    run = subprocess.run([sys.executable, "-m", "kv_preflight.cli.bench", "--quick", "--only", "keys,ingest", "--json-file", str(out),
                          "--html", str(page)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    # issue 42: --html writes the run's rows with charts, every row named on the page
    text = page.read_text()
    assert text.startswith("<!doctype html>") and "Speed-up over the baseline" in text
    assert all(r["row"] in text for r in doc["rows"]) and 'class="bar ' in text
    rows = {r["row"].split(",")[0]: r for r in doc["rows"]}
    assert {"request keys", "ingestion", "Valkey memory per (block", "ingestion over ZMQ"} <= set(rows)
    ingest = next(r for r in doc["rows"] if r["row"].startswith("ingestion, in process"))
    assert ingest["equal_content"] is True  # the seed path and ours leave the same llm-d keys
    agree = doc["lookup_agreement"]
    assert agree["bitmaps_equal_linear"] == agree["prompts"] > 0
    zmq_row = next(r for r in doc["rows"] if r["row"].startswith("ingestion over ZMQ"))
    assert zmq_row["pods_incomplete"] == []


def test_prediction_parts_run():
    """cli/bench/parts.py (docs/benchmarks.md cites it) runs against its own Valkey and reports every part."""
    run = subprocess.run([sys.executable, "-m", "kv_preflight.cli.bench.parts", "--pods", "20", "--repeat", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    for part in ("lookup", "of which Valkey's script", "per-pod loop, C", "per-pod loop, Python", "whole prediction"):
        assert part in run.stdout, run.stdout
    assert "pods answered" in run.stdout and " 20\n" in run.stdout, run.stdout


def test_floor_bench_writers_leave_the_same_entries(tmp_path):
    """The write-path rows (cli/bench/floor.py): the floor writer and the ingester, taking turns on their own
    Valkeys, single node and cluster, leave the same (request key, pod) entries (the bench's own check, which
    fails the run), and every row is reported."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kv_preflight.cli.bench", "--quick", "--only", "floor", "--json-file", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["failed_checks"] == []
    rows = {r["row"] for r in doc["rows"]}
    assert {"Valkey CPU per engine block, single node", "memory per live (request key, pod) entry",
            "one ingester, single node", "Valkey CPU per engine block, cluster (sum of 3 masters)",
            "one ingester, cluster"} <= rows
    floor = doc["floor"]
    assert floor["entries"] > 0 and floor["turn_frames"] > 0
    assert floor["measured_batches"] > floor["turn_frames"]  # several turns each


def test_outage_bench_keeps_the_entries_it_measures(tmp_path):
    """The replica-outage row (cli/bench/outage.py): every replica held, the outbox keeps the entries the row
    says it measured (few, then many per pod; the bench's own check fails the run otherwise), and the row is
    reported with both costs."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kv_preflight.cli.bench", "--quick", "--only", "outage", "--json-file",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["failed_checks"] == []
    assert {r["row"] for r in doc["rows"]} == {"Valkey CPU during a replica outage"}
    outage = doc["outage"]
    assert 64 <= outage["kept_few"] < outage["kept_many"] and outage["kept_many"] >= 256
    assert all(x > 0 for x in outage["batch_us"] + outage["round_ms"])
