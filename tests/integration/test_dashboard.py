"""The Grafana dashboard (compose/observability/grafana/kv-preflight.json) reads what the processes export.

A query naming a metric no process exports draws an empty panel that nobody notices. Here `kv-preflight up
--demo` runs the whole stack with traffic (predictions, routes, engines caching and evicting), every
/metrics URL its banner lists is scraped, and every metric each dashboard query names must be among the
series those real processes export (a family with no sample yet counts through its TYPE line); the labels a
query groups by must be labels of the metric it reads. The local stack's Prometheus file uses the jobs of
the compose stack's, so the dashboard's `instance`/`job` grouping means the same on both.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "compose" / "observability" / "grafana" / "kv-preflight.json"
METRIC = re.compile(r"\b(kvpf_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
BY = re.compile(r"\bby \(([^)]*)\)")
SCRAPER_LABELS = {"le", "instance", "job"}  # added by Prometheus, or a histogram's own


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]


def exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Series names a scrape offers (a histogram's _bucket/_sum/_count from its TYPE line) and, per name, the
    labels its samples carry."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            elif kind == "counter" and not name.endswith("_total"):
                names.add(name + "_total")
        elif line and not line.startswith("#"):
            name = re.match(r"[^{ ]+", line).group(0)
            names.add(name)
            labels.setdefault(name, set()).update(re.findall(r'(\w+)="', line.split("}")[0]) if "{" in line else ())
    return names, labels


def test_every_dashboard_query_reads_metrics_the_processes_export(tmp_path):
    assert dashboard_queries(), "no query in the dashboard"
    port = free_port()
    log = tmp_path / "up.out"
    with reaped(tmp_path) as env:
        with open(log, "w") as fh:
            up = subprocess.Popen([sys.executable, "-m", "kv_preflight", "up", "--data-dir", str(tmp_path / ".data"),
                                   "--port", str(port), "--workers", "1", "--demo"], cwd=tmp_path, stdout=fh,
                                  stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            deadline = time.monotonic() + 240
            while "Ctrl-C stops everything" not in log.read_text():
                assert up.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            text = log.read_text()
            urls = re.findall(r"(http://127\.0\.0\.1:\d+/metrics(?:/pods)?)\s+\(\S+\)", text)
            assert len(urls) == 7, text  # the predictor (and its /metrics/pods), the gateway, 2 ingesters, 2 engines
            names: set[str] = set()
            labels: dict[str, set[str]] = {}
            for url in urls:
                got_names, got_labels = exported(httpx.get(url, timeout=10).text)
                names |= got_names
                for k, v in got_labels.items():
                    labels.setdefault(k, set()).update(v)
            local = yaml.safe_load((tmp_path / ".data" / "prometheus.yml").read_text())
        finally:
            up.terminate()
            up.wait(timeout=120)
    missing = {}
    for expr in dashboard_queries():
        used = set(METRIC.findall(expr))
        if used - names:
            missing[expr] = sorted(used - names)
        for group in BY.findall(expr):
            wanted = {g.strip() for g in group.split(",")} - SCRAPER_LABELS
            known = set().union(*(labels[m] for m in used if m in labels)) if any(m in labels for m in used) else None
            if known is not None:  # a family with samples: its labels are known
                assert wanted <= known, (expr, wanted - known)
    assert not missing, f"dashboard queries naming metrics no process exports: {missing}"
    compose = yaml.safe_load((REPO / "compose" / "observability" / "prometheus.yml").read_text())
    assert {j["job_name"] for j in local["scrape_configs"]} <= {j["job_name"] for j in compose["scrape_configs"]}
