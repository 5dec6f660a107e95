"""The predictor's Prometheus metrics: latency, outcomes, tokenization source, Valkey errors, routes.

The request path only touches pre-resolved label children (a dict hit and an add,
about a microsecond), never ``labels()`` formatting. Label values come from closed
sets (endpoints, outcomes, reasons) or from configured models, so cardinality stays
bounded whatever clients send; no metric here has a ``pod`` label, so the number of
pods in the index (or in a request's ``pods`` filter) never adds a series.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kv_preflight.shared.metrics import LATENCY_BUCKETS, exposition


class PredictorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram("kvpf_request_duration_seconds", "Time to answer a predict or route request.",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.outcomes = Counter("kvpf_predictions", "Predict and route requests by outcome: hit (some cache), "
                                "miss (none), or the error kind.", ["endpoint", "outcome"], registry=r)
        self.tokenizations = Counter("kvpf_tokenizations", "Prompts and messages tokenized, by model and source "
                                     "(local tokenizer or the engine's /tokenize).", ["model", "source"], registry=r)
        self.valkey_errors = Counter("kvpf_valkey_errors", "Valkey calls that failed or timed out.", registry=r)
        self.partial_answers = Counter("kvpf_partial_answers", "Predictions answered while a Valkey Cluster shard "
                                       "did not answer (counts are lower bounds).", registry=r)
        self.routes = Counter("kvpf_route_decisions", "Route decisions by reason.", ["reason"], registry=r)
        self.unauthorized = Counter("kvpf_unauthorized_requests", "Requests refused for a missing or wrong API key.",
                                    registry=r)
        self.client_disconnects = Counter("kvpf_predictor_client_disconnects", "Requests whose client went away "
                                          "before its body had arrived (not a server error).", registry=r)
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, endpoint: str, outcome: str, seconds: float) -> None:
        self._child(self.latency, endpoint).observe(seconds)
        self._child(self.outcomes, endpoint, outcome).inc()

    def tokenized(self, model: str, source: str) -> None:
        self._child(self.tokenizations, model, source).inc()

    def route(self, reason: str) -> None:
        self._child(self.routes, reason).inc()

    def exposition(self) -> bytes:
        return exposition(self.registry)
