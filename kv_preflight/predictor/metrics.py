"""The predictor's Prometheus metrics: latency, outcomes, answers by freshness, tokenization source, Valkey
errors, routes, the engines' failed scrapes and tokenize failovers; and, read at each scrape, the fleet and the
index in numbers (predictor/index_gauges.py).

The request path only touches pre-resolved label children (a dict hit and an add,
about a microsecond), never ``labels()`` formatting. Label values come from closed
sets (endpoints, outcomes, reasons) or from configured models, so cardinality stays
bounded whatever clients send; no metric here has a ``pod`` label, so the number of
pods in the index (or in a request's ``pods`` filter) never adds a series here (the index's series per pod
are on ``/metrics/pods``, capped at index_gauges.py's ``MAX_POD_SERIES``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kv_preflight.metrics import LATENCY_BUCKETS, exposition
from kv_preflight.predictor.index_gauges import GaugesCollector, IndexGauges


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
        self.answers = Counter("kvpf_answers", "Predict, route and explain answers by the freshness state of the "
                               "index behind them: exact, degraded (a pod behind, stalled or incomplete), partial "
                               "(a cluster shard did not answer).", ["endpoint", "freshness"], registry=r)
        self.unauthorized = Counter("kvpf_unauthorized_requests", "Requests refused for a missing or wrong API key.",
                                    registry=r)
        self.client_disconnects = Counter("kvpf_predictor_client_disconnects", "Requests whose client went away "
                                          "before its body had arrived (not a server error).", registry=r)
        self.gap_walks = Counter("kvpf_lookup_gap_walks", "Pods the default lookup walked key by key instead of "
                                 "bisecting (orphan keys, or a count not known: docs/architecture.md).", registry=r)
        self.foreign_keys = Counter("kvpf_lookup_foreign_keys", "Request keys of a foreign type (not a hash) a lookup "
                                    "read as misses.", registry=r)
        self.late_reads = Counter("kvpf_lookup_late_reads", "Cluster lookups that took a 4th round (a key moved or a "
                                  "shard failed mid-lookup: resharding, failover).", registry=r)
        self.engine_scrape_errors = Counter("kvpf_engine_scrape_errors", "Scrapes of an engine (its pod id, load "
                                            "or served models) that failed: unreachable, an error status, or no "
                                            "load series; /stats engine_load names the engine and the error.",
                                            registry=r)
        self.tokenize_failovers = Counter("kvpf_tokenize_failovers", "Prompts an engine of the model failed to "
                                          "tokenize (down, timeout, 5xx) and the next of its --engine-url was asked.",
                                          registry=r)
        self.connections_refused = Counter("kvpf_connections_refused", "Connections answered 503 and closed at once: "
                                           "a client address over --max-connections-per-client, or the process "
                                           "over its connection limit.", ["limit"], registry=r)
        self._refused_seen: dict[str, int] = {}
        self._index_seen = (0, 0, 0)
        self._engine_seen = (0, 0)
        self._children: dict[tuple, object] = {}

    def child(self, metric, *labels: str):
        """``metric``'s child for ``labels``, resolved once (the gateway's metrics use it too)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, endpoint: str, outcome: str, seconds: float) -> None:
        self.child(self.latency, endpoint).observe(seconds)
        self.child(self.outcomes, endpoint, outcome).inc()

    def index_counts(self, gap_walks: int, foreign_keys: int, late_reads: int) -> None:
        """The index's own lookup counters (``Index.gap_walks`` ...), added as they grew since the last call:
        counters kept in Prometheus' multiprocess files, so ``serve --workers N`` sums its workers'."""
        self._index_seen = _grown((self.gap_walks, self.foreign_keys, self.late_reads), self._index_seen,
                                  (gap_walks, foreign_keys, late_reads))

    def engine_counts(self, scrape_errors: int, tokenize_failovers: int) -> None:
        """The load monitor's failed scrapes and the engine tokenizer's failovers, added as ``index_counts`` adds."""
        self._engine_seen = _grown((self.engine_scrape_errors, self.tokenize_failovers), self._engine_seen,
                                   (scrape_errors, tokenize_failovers))

    def answered(self, endpoint: str, freshness: str) -> None:
        self.child(self.answers, endpoint, freshness).inc()

    def tokenized(self, model: str, source: str) -> None:
        self.child(self.tokenizations, model, source).inc()

    def route(self, reason: str) -> None:
        self.child(self.routes, reason).inc()

    def exposition(self, gauges: IndexGauges | None = None) -> bytes:
        """The counters (every worker's, summed), then this scrape's reading of the fleet and the index (no series
        per pod: those are ``pods_exposition``'s)."""
        from kv_preflight.predictor.http.protocols import REFUSED  # this process's connections refused so far
        for limit, n in REFUSED.items():
            was = self._refused_seen.get(limit, 0)
            if n > was:
                self.child(self.connections_refused, limit).inc(n - was)
                self._refused_seen[limit] = n
        out = exposition(self.registry)
        if gauges is not None:
            once = CollectorRegistry(auto_describe=False)
            once.register(GaugesCollector(gauges))
            out += generate_latest(once)
        return out

    @staticmethod
    def pods_exposition(gauges: IndexGauges) -> bytes:
        """``/metrics/pods``: the index's series per pod (blocks, memory), bounded (predictor/index_gauges.py)."""
        once = CollectorRegistry(auto_describe=False)
        once.register(GaugesCollector(gauges, per_pod=True))
        return generate_latest(once)


def _grown(metrics: tuple, was: tuple[int, ...], now: tuple[int, ...]) -> tuple[int, ...]:
    """Each metric increased by what its count grew since ``was``; returns ``now``, the next call's ``was``."""
    if now != was:
        for metric, before, after in zip(metrics, was, now):
            if after > before:
                metric.inc(after - before)
    return now
