"""At most ``max_pod_series`` pods get Prometheus series of their own; the rest are summed under
pod="_other", a gauge says how many, and a pod idle long enough gives its place to a new one."""
from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kv_preflight.ingester.metrics import IngesterMetrics
from kv_preflight.events import BlockStored, EventBatch
from kv_preflight.metrics import OTHER_POD, PodLabelled, PodSeries
from tests.prom import metric


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pods_in(text: str, name: str) -> set[str]:
    return {m.group(1) for line in text.splitlines() if line.startswith(name + "{")
            for m in [re.search(r'pod="([^"]*)"', line)] if m}


def setup(limit: int, idle_s: float = 600.0):
    clock = Clock()
    r = CollectorRegistry()
    folded = Gauge("folded", "f", registry=r)
    series = PodSeries(limit, idle_s=idle_s, clock=clock, on_fold=folded.set)
    batches = PodLabelled(Counter("batches", "b", ["pod", "result"], registry=r), series)
    events = PodLabelled(Counter("events", "e", ["type", "pod"], registry=r), series, pod_at=1)
    return clock, r, series, batches, events


def test_first_pods_keep_their_names_later_ones_are_summed_under_other():
    _, r, series, batches, events = setup(3)
    for pod in ["a", "b", "c", "d", "e", "a", "d"]:
        batches.labels(pod, "applied").inc()
        events.labels("BlockStored", pod).inc(2)
    text = generate_latest(r).decode()
    assert pods_in(text, "batches_total") == pods_in(text, "events_total") == {"a", "b", "c", OTHER_POD}
    assert metric(text, "batches_total", pod="a", result="applied") == 2
    assert metric(text, "batches_total", pod=OTHER_POD, result="applied") == 3  # d, e, d: nothing is lost
    assert metric(text, "events_total", pod=OTHER_POD, type="BlockStored") == 6
    assert metric(text, "folded") == 2 and series.folded == 2  # d and e, each counted once


def test_an_idle_pod_gives_its_place_to_a_new_one():
    clock, r, series, batches, _ = setup(2, idle_s=10)
    batches.labels("a", "applied").inc()
    clock.now = 5
    batches.labels("b", "applied").inc()
    batches.labels("c", "applied").inc()  # nobody idle yet: folded
    assert series.folded == 1
    clock.now = 12  # a has been idle 12 s, b 7 s
    batches.labels("d", "applied").inc()
    text = generate_latest(r).decode()
    assert pods_in(text, "batches_total") == {"b", "d", OTHER_POD}  # a's series removed, d has its own
    clock.now = 30  # c, folded at 5, idle since: forgotten by the folded count
    batches.labels("e", "applied").inc()  # b idle 25 s: e takes its place
    assert pods_in(generate_latest(r).decode(), "batches_total") == {"d", "e", OTHER_POD}
    batches.labels("f", "applied").inc()  # d idle 18 s: f takes its place
    assert series.folded == 0 and metric(generate_latest(r).decode(), "folded") == 0


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        PodSeries(0)


def test_ingester_metrics_stay_small_with_20k_pods():
    m = IngesterMetrics(max_pod_series=100)
    batch = EventBatch(0.0, [BlockStored([1], None, list(range(16)), 16, medium="GPU")], 0)
    for i in range(20_000):
        pod = f"pod-{i:05d}"
        m.batches.labels(pod, "applied").inc()
        m.applied(pod, batch, now=1.0)
        m.gaps.labels(pod).inc()
        m.replays.labels(pod).inc()
        m.gaps_unrecovered.labels(pod).inc()
    text = m.exposition().decode()
    for name in ("kvpf_ingest_batches_total", "kvpf_ingest_events_total", "kvpf_ingest_gaps_total",
                 "kvpf_ingest_replays_total", "kvpf_ingest_gaps_unrecovered_total", "kvpf_ingest_last_lag_seconds"):
        assert len(pods_in(text, name)) == 101, name
    assert metric(text, "kvpf_ingest_pods_folded") == 19_900
    assert metric(text, "kvpf_ingest_batches_total", pod=OTHER_POD, result="applied") == 19_900
    assert len(text) < 200_000, len(text)  # the review measured 7.4 MB at 20K pods


def test_ingester_default_is_256_pods():
    m = IngesterMetrics()
    for i in range(1000):
        m.batches.labels(f"p{i}", "applied").inc()
    assert len(pods_in(m.exposition().decode(), "kvpf_ingest_batches_total")) == 257
