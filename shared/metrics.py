"""Prometheus exposition for every kv-preflight process, per process or across uvicorn workers.

Each process owns its registry (no module-level metric objects), so tests and several
apps in one process never collide. ``serve --workers N`` runs N processes behind one
port, and a scrape lands on any one of them: there, prometheus-client's multiprocess
mode keeps each worker's values in files under ``PROMETHEUS_MULTIPROC_DIR`` and a
scrape sums them, so every scrape sees the whole server. The directory must be set
before a worker imports prometheus_client, which ``use_multiprocess_dir`` does in the
parent before uvicorn starts the workers.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client import multiprocess

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds; predictions take ~0.1-2 ms, tokenizing through an engine tens of ms.
LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def use_multiprocess_dir() -> str:
    """A fresh, empty directory for this server's workers (values of an earlier run must not add up)."""
    path = tempfile.mkdtemp(prefix="kvpf-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path


def remove_multiprocess_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def exposition(registry: CollectorRegistry) -> bytes:
    """The text format: this registry, or in multiprocess mode every worker's values summed."""
    if multiprocess_dir():
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        return generate_latest(merged)
    return generate_latest(registry)
