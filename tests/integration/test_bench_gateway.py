"""``kv-preflight bench --only gateway`` runs, forwards every request it sends (its checks hold) and reports its
rows; the figures are the benchmark's business, not the tests' (docs/gateway.md lists them)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.serial(reason="drives a gateway at concurrency 32 for seconds: beside other tests, "
                                        "neither would measure or time out sensibly")]


def test_quick_gateway_rows_run(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "kv_preflight.cli.bench", "--quick", "--only", "gateway",
                          "--json-file", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {r["row"].split(",")[0]: r for r in doc["rows"]}
    assert {"gateway: added latency", "gateway: throughput", "gateway: the route decision"} <= set(rows)
    assert any(r["row"].endswith(", 64 pods") for r in doc["rows"]), [r["row"] for r in doc["rows"]]
    assert doc["gateway"]["decision_64_pods"]["p50_ms"] > 0
    assert doc["failed_checks"] == []
    runs = [*doc["gateway"]["latency"]["pairs"], doc["gateway"]["throughput"]]
    assert len(runs) == 4  # three pairs of latency runs (--quick), one throughput run
    for figures in runs:
        assert set(figures["gateway"]["statuses"]) == {"200"} and figures["gateway"]["requests"] > 0

