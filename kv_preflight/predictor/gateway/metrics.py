"""The gateway's Prometheus metrics, in the predictor's registry (one scrape of ``/metrics`` has both).

Labels come from closed sets (endpoint, outcome, failure kind) and the pod label goes through ``PodSeries``
(at most ``--max-pod-series`` pods, the rest summed under ``_other``), so clients cannot add series.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kv_preflight.metrics import LATENCY_BUCKETS, PodLabelled, PodSeries
from kv_preflight.predictor.metrics import PredictorMetrics


class GatewayMetrics:
    def __init__(self, predictor: PredictorMetrics, max_pod_series: int) -> None:
        r = predictor.registry
        self._child = predictor.child
        self.requests = Counter("kvpf_gateway_requests", "Requests through the gateway by endpoint and outcome: "
                                "the engine's status class (2xx, 4xx, 5xx), or the gateway's own refusal or failure "
                                "(bad_request, unknown_model, not_ready, busy, no_pod, upstream_failed, "
                                "client_gone).", ["endpoint", "outcome"], registry=r)
        self.decision = Histogram("kvpf_gateway_decision_seconds", "Time from a request's body read to its upstream "
                                  "request sent: tokenizing and the route decision, what the gateway adds.",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_failures = Counter("kvpf_gateway_upstream_failures", "Upstream requests that gave no answer "
                                         "worth passing on, by kind (connect, tls, 5xx, protocol, timeout, "
                                         "pool, no_url, scheme, cut_short).", ["kind"], registry=r)
        self.retries = Counter("kvpf_gateway_retries", "Requests sent again to the next candidate after a failure.",
                               registry=r)
        self.fleet_told = Counter("kvpf_gateway_pods_marked_unreachable", "Pods this gateway marked unreachable "
                                  "in the fleet records after a refused connection.", registry=r)
        self.inflight = Gauge("kvpf_gateway_inflight", "Upstream requests in flight.", registry=r,
                              multiprocess_mode="livesum")
        self.unrouted = Counter("kvpf_gateway_unrouted", "Requests forwarded without the index's decision, by why "
                                "(index_unavailable, not_tokenized): by load and prompt hash instead.", ["why"],
                                registry=r)
        self.write_failures = Counter("kvpf_gateway_write_failures", "Writes of what was routed that Valkey did not "
                                      "take (speculative, approximate); the requests went on.", ["what"], registry=r)
        self.pods = PodSeries(max_pod_series)
        self.per_pod = PodLabelled(Counter("kvpf_gateway_pod_requests", "Requests forwarded, per pod (the spread "
                                           "of load).", ["pod"], registry=r), self.pods)

    def request(self, endpoint: str, outcome: str) -> None:
        self._child(self.requests, endpoint, outcome).inc()

    def failure(self, kind: str) -> None:
        self._child(self.upstream_failures, kind).inc()

    def sent(self, pod: str) -> None:
        self.per_pod.labels(pod).inc()

    def write_failed(self, what: str) -> None:
        self._child(self.write_failures, what).inc()

    def not_routed(self, why: str) -> None:
        self._child(self.unrouted, why).inc()
