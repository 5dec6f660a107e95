"""The ingester's Prometheus metrics, served on ``ingest --metrics-port``.

What an operator needs to trust the index: events applied (by type and pod),
batches by result, decode errors, gaps and replays, and lag (now minus the engine's
batch timestamp when the batch is applied; it includes clock skew between hosts).
"""
from __future__ import annotations

import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from shared.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from shared.metrics import exposition

EVENT_TYPES = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngesterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.events = Counter("kvpf_ingest_events", "KV events applied to the index, by type and pod.",
                              ["type", "pod"], registry=r)
        self.batches = Counter("kvpf_ingest_batches", "Event batches by result: applied, dup (another ingester "
                               "applied it), restart (engine restarted), gap.", ["pod", "result"], registry=r)
        self.decode_errors = Counter("kvpf_ingest_decode_errors", "Frames or events that could not be decoded.",
                                     registry=r)
        self.gaps = Counter("kvpf_ingest_gaps", "Seq gaps seen, by pod.", ["pod"], registry=r)
        self.gaps_unrecovered = Counter("kvpf_ingest_gaps_unrecovered", "Gaps the replay socket could not fill "
                                        "(the pod is marked incomplete).", ["pod"], registry=r)
        self.replays = Counter("kvpf_ingest_replays", "Replay requests sent to engines, by pod.", ["pod"], registry=r)
        self.valkey_errors = Counter("kvpf_ingest_valkey_errors", "Valkey calls that failed (retried).", registry=r)
        self.lag = Histogram("kvpf_ingest_lag_seconds", "Now minus the batch timestamp when a batch is applied.",
                             buckets=LAG_BUCKETS, registry=r)
        self.last_lag = Gauge("kvpf_ingest_last_lag_seconds", "Lag of the last batch applied, by pod.", ["pod"],
                              registry=r)

    def applied(self, pod: str, batch: EventBatch, now: float | None = None) -> None:
        tally = Tally(EVENT_TYPES.get(type(e), "other") for e in batch.events)
        for kind, n in tally.items():
            self.events.labels(kind, pod).inc(n)
        lag = (time.time() if now is None else now) - batch.ts
        self.lag.observe(max(lag, 0.0))
        self.last_lag.labels(pod).set(lag)

    def exposition(self) -> bytes:
        return exposition(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1"):
        """A small HTTP server thread answering GET /metrics; returns the server (``shutdown()`` stops it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
