"""Prometheus exposition for every kv-preflight process, per process or across uvicorn workers.

Each process owns its registry (no module-level metric objects), so tests and several
apps in one process never collide. ``serve --workers N`` runs N processes behind one
port, and a scrape lands on any one of them: there, prometheus-client's multiprocess
mode keeps each worker's values in files under ``PROMETHEUS_MULTIPROC_DIR`` and a
scrape sums them, so every scrape sees the whole server. The directory must be set
before a worker imports prometheus_client, which ``use_multiprocess_dir`` does in the
parent before uvicorn starts the workers.

A ``pod`` label is the one label whose values nobody configures: a fleet of 20K pods
made a 7 MB scrape. ``PodSeries`` gives at most ``max_pod_series`` pods a label value
of their own and sums the rest under ``pod="_other"``; ``PodLabelled`` wraps a metric
so every ``labels(...)`` call goes through it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

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


OTHER_POD = "_other"
# A pod whose series saw no update for this long gives its place to a new pod (engines are
# replaced under new names, e.g. Kubernetes pods): its series are removed, the new pod's start at zero.
POD_SERIES_IDLE_S = 600.0


class PodSeries:
    """Which pods get a ``pod`` label value of their own: at most ``limit`` at a time, first come.

    Past the limit a new pod is folded into ``OTHER_POD``, unless the least recently updated pod
    has been idle ``idle_s`` or more: that one's series are removed from every ``PodLabelled`` metric
    and the new pod takes its place. ``folded`` counts the distinct pods summed under ``OTHER_POD`` now (pods idle
    that long are forgotten there too, so memory follows the live fleet, not its history).
    """

    def __init__(self, limit: int, *, idle_s: float = POD_SERIES_IDLE_S,
                 clock: Callable[[], float] = time.monotonic, on_fold: Callable[[int], None] | None = None):
        if limit <= 0:
            raise ValueError("the pod series limit must be positive")
        self.limit = limit
        self.idle_s = idle_s
        self.clock = clock
        self.on_fold = on_fold  # told the new folded count whenever it changes
        self._own: OrderedDict[str, float] = OrderedDict()  # pod -> last update, least recent first
        self._folded: OrderedDict[str, float] = OrderedDict()
        self._metrics: list[PodLabelled] = []

    def track(self, metric: "PodLabelled") -> None:
        """A metric whose series of an evicted pod must go with it."""
        self._metrics.append(metric)

    @property
    def folded(self) -> int:
        return len(self._folded)

    def label(self, pod: str) -> str:
        """The label value to record ``pod`` under, now."""
        now = self.clock()
        if pod in self._own:
            self._own[pod] = now
            self._own.move_to_end(pod)
            return pod
        if len(self._own) >= self.limit:
            oldest, seen = next(iter(self._own.items()))
            if now - seen < self.idle_s:
                return self._fold(pod, now)
            del self._own[oldest]
            for m in self._metrics:
                m.forget(oldest)
        self._own[pod] = now
        before = len(self._folded)
        self._folded.pop(pod, None)
        self._forget_idle_folded(now, before)
        return pod

    def _fold(self, pod: str, now: float) -> str:
        before = len(self._folded)
        self._folded[pod] = now
        self._folded.move_to_end(pod)
        self._forget_idle_folded(now, before)
        return OTHER_POD

    def _forget_idle_folded(self, now: float, before: int) -> None:
        """Drop folded pods idle ``idle_s`` (only on a new or folded pod: never on the hot path of a known one)."""
        while self._folded:
            name, seen = next(iter(self._folded.items()))
            if now - seen < self.idle_s:
                break
            del self._folded[name]
        if len(self._folded) != before and self.on_fold is not None:
            self.on_fold(len(self._folded))


class PodLabelled:
    """A labelled prometheus-client metric whose ``pod`` label goes through a ``PodSeries``.

    ``labels(...)`` takes the same values as the metric's own and returns its child, so callers
    do not change; the pod's children are remembered so an evicted pod's series can be removed.
    """

    def __init__(self, metric: Any, series: PodSeries, *, pod_at: int = 0):
        self.metric = metric
        self.series = series
        self.pod_at = pod_at  # position of the pod among the metric's label names
        self._children: dict[str, set[tuple[str, ...]]] = {}
        series.track(self)

    def labels(self, *values: str) -> Any:
        label = self.series.label(values[self.pod_at])
        key = (*values[:self.pod_at], label, *values[self.pod_at + 1:])
        if label != OTHER_POD:
            self._children.setdefault(label, set()).add(key)
        return self.metric.labels(*key)

    def forget(self, pod: str) -> None:
        for key in self._children.pop(pod, ()):
            try:
                self.metric.remove(*key)
            except KeyError:  # already gone
                pass
