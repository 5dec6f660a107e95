"""Every counted event (ingester/counters.py): each name feeds the tally and the Prometheus series it names."""
from __future__ import annotations

import pytest

from kv_preflight.ingester.counters import COUNTED, ENDPOINT, POD, Counters
from kv_preflight.ingester.metrics import IngesterMetrics


def counted(metric, values: list[str]) -> float:
    """The value of ``metric``'s series whose label values are ``values`` (0 when it has none yet)."""
    family = (metric.metric if hasattr(metric, "metric") else metric).collect()[0]  # PodLabelled wraps one
    return sum(s.value for s in family.samples
               if s.name == family.name + "_total" and sorted(s.labels.values()) == sorted(values))


@pytest.mark.parametrize("name", sorted(COUNTED))
def test_each_event_feeds_the_tally_and_its_series(name):
    metrics = IngesterMetrics()
    counters = Counters(metrics, index=None, retry=None)  # the tally touches neither
    counters.tally(name, 3, pod="pod-a", endpoint="tcp://e:1")
    assert counters.counts[name] == 3
    for metric, *labels in COUNTED[name].series:
        values = ["pod-a" if v == POD else "tcp://e:1" if v == ENDPOINT else v for v in labels]
        assert counted(getattr(metrics, metric), values) == 3, (name, metric)


def test_one_event_can_feed_two_series():
    metrics = IngesterMetrics()
    Counters(metrics, index=None, retry=None).tally("corrupt_batches", pod="pod-a")
    assert counted(metrics.batches, ["pod-a", "corrupt"]) == 1
    assert counted(metrics.corrupt_batches, []) == 1
