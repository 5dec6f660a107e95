"""The ingester's Prometheus metrics, served on ``ingest --metrics-port``.

What an operator needs to trust the index: events applied (by type and pod),
batches by result, decode errors, gaps and replays, and lag (now minus the engine's
batch timestamp when the batch is applied; it includes clock skew between hosts).
Every per-pod metric goes through one ``PodSeries`` (kv_preflight/metrics.py): at most
``max_pod_series`` pods get series of their own, the rest are summed under
``pod="_other"`` and ``kvpf_ingest_pods_folded`` says how many that is, so a fleet of
thousands of pods cannot turn a scrape into megabytes.
"""
from __future__ import annotations

import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kv_preflight.config import Config
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.metrics import PodLabelled, PodSeries, exposition

EVENT_TYPES = {BlockStored: "BlockStored", BlockRemoved: "BlockRemoved", AllBlocksCleared: "AllBlocksCleared"}
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngesterMetrics:
    def __init__(self, max_pod_series: int = Config.max_pod_series) -> None:
        self.registry = r = CollectorRegistry()
        self.pods_folded = Gauge("kvpf_ingest_pods_folded", "Pods whose series are summed under pod=\"_other\" "
                                 "because more than --max-pod-series pods are being ingested.", registry=r)
        self.pod_series = pods = PodSeries(max_pod_series, on_fold=self.pods_folded.set)
        self.events = PodLabelled(Counter("kvpf_ingest_events", "KV events applied to the index, by type and pod.",
                                          ["type", "pod"], registry=r), pods, pod_at=1)
        self.batches = PodLabelled(Counter("kvpf_ingest_batches", "Event batches by result: applied, dup (another "
                                           "ingester applied it), restart (engine restarted), gap.", ["pod", "result"],
                                           registry=r), pods)
        self.decode_errors = Counter("kvpf_ingest_decode_errors", "Frames or events that could not be decoded.",
                                     registry=r)
        self.pod_conflicts = Counter("kvpf_ingest_pod_conflicts", "Engines refused because another live engine "
                                     "already publishes their pod id, and sockets refused a pod's rank another socket "
                                     "publishes (once per pod, rank and socket).", registry=r)
        self.pods_retired = Counter("kvpf_ingest_pods_retired", "Pods retired (left discovery, or unreachable "
                                    "for --retire-after): entries cleared.", registry=r)
        self.gaps = PodLabelled(Counter("kvpf_ingest_gaps", "Seq gaps seen, by pod.", ["pod"], registry=r), pods)
        self.gaps_unrecovered = PodLabelled(Counter("kvpf_ingest_gaps_unrecovered", "Gaps the replay socket could "
                                                    "not fill (the pod is marked incomplete).", ["pod"], registry=r),
                                            pods)
        self.replays = PodLabelled(Counter("kvpf_ingest_replays", "Replay requests sent to engines, by pod.", ["pod"],
                                           registry=r), pods)
        self.valkey_errors = Counter("kvpf_ingest_valkey_errors", "Valkey calls that failed (retried, except a counter "
                                     "write or a membership round's reads, done again later).", registry=r)
        # Labelled by socket endpoint (from the config), never by the refused pod: a forger picks those.
        self.frames_refused = Counter("kvpf_ingest_frames_refused", "Frames dropped unwritten because their pod is "
                                      "not in the socket's pods= allowlist, by socket.", ["endpoint"], registry=r)
        self.publishers_refused = Counter("kvpf_ingest_publishers_refused", "Connections to a --bind socket refused "
                                          "because the publisher's CURVE key is not in --curve-allow.", registry=r)
        self.corrupt_batches = Counter("kvpf_ingest_corrupt_batches", "Batches refused as corrupt (a seq more than "
                                       "2^32 past the persisted one, a pod key of a foreign type); the pod is "
                                       "flagged.", registry=r)
        self.foreign_writes = Counter("kvpf_ingest_foreign_writes", "Writes skipped because a key of a foreign type "
                                      "was in the way; the pod is flagged.", registry=r)
        self.placeholder_events = Counter("kvpf_ingest_placeholder_events", "Events skipped because they name no "
                                          "block to index (vLLM offloading placeholders: no tokens, block_size 0); "
                                          "never a decode error.", registry=r)
        self.apply_errors = Counter("kvpf_ingest_apply_errors", "Batches Valkey refused with a non-transient error "
                                    "(not retried; other pods go on).", registry=r)
        self.stream_drops = Counter("kvpf_ingest_stream_drops", "Event streams whose connection dropped after its "
                                    "handshake (a ZMTP heartbeat unanswered: a half-open connection or a partition; "
                                    "TCP keepalive; the engine gone): their pods count behind until a publisher is "
                                    "back and what they missed is replayed.", registry=r)
        self.streams_dead = Counter("kvpf_ingest_streams_dead", "Silent event streams found dead by a probe of the "
                                    "engine's replay socket (it held batches the stream never brought): connected "
                                    "again, their pods replayed.", registry=r)
        self.loop_stalls = Counter("kvpf_ingest_loop_stalls", "Times the ingester's loop made no progress for "
                                   "5 s (each logged once with the stack of what it awaited).", registry=r)
        self.engine_errors = Counter("kvpf_ingest_engine_errors", "Engines refused alone, by step: attach (its "
                                     "sockets could not be opened: an address in use, an endpoint libzmq refuses, "
                                     "the source cap), detach, registration (a kvpf:engines record no socket "
                                     "could use). Each retried with backoff.", ["step"], registry=r)
        self.round_overruns = Counter("kvpf_ingest_round_overruns", "Membership rounds that ran past their deadline "
                                      "(half the lease TTL), each logged with the step it was at.", registry=r)
        self.outbox_drains = Counter("kvpf_ingest_outbox_drains", "Times the chores ran a pod's outbox entries again "
                                     "(Valkey Cluster; one per pod and round, whatever the entries' count): a "
                                     "stopped writer's, left half applied, or this ingester's own after the slot "
                                     "map moved (a failover) before a replica confirmed them.", registry=r)
        self.unreplicated_runs = Counter("kvpf_ingest_unreplicated_runs", "Runs of batches whose changes no replica "
                                         "confirmed in time (Valkey Cluster): kept in the outbox until one does, "
                                         "and run again if a failover comes first; steady growth means a replica is "
                                         "down or far behind.", registry=r)
        self.outbox_confirmed_late = Counter("kvpf_ingest_outbox_confirmed_late", "Outbox entries of this ingester "
                                             "deleted when a replica confirmed them after their run (Valkey "
                                             "Cluster): the end of a replica's outage, or of its lag.", registry=r)
        self.late_runs = Counter("kvpf_ingest_late_runs", "Runs of batches' changes this ingester left in the "
                                 "outbox for a drain (Valkey Cluster): it came to send them past their window (the "
                                 "takeover time less a quarter, from before the pod step), when another ingester "
                                 "may have run them and cleared the pod since. It stalled (a pause, a starved "
                                 "machine), or the pod step itself took that long (a failover's timeouts); a clearing of a large pod "
                                 "(hundreds of thousands of blocks) does too, by the length of its run. Also drains "
                                 "stopped because their lease on the pod's outbox lapsed.",
                                 registry=r)
        self.data_losses = Counter("kvpf_ingest_data_losses", "Times this ingester found that Valkey lost the "
                                   "index's data (its epoch gone or changed, or a cluster shard back without its "
                                   "data): its pods flagged and rebuilt.", registry=r)
        self.markers_rewritten = Counter("kvpf_ingest_markers_rewritten", "Slot markers (Valkey Cluster) found gone "
                                         "from a primary that ran all along, and written again: evicted under an "
                                         "allkeys-* maxmemory policy, which loses index data unseen, or deleted "
                                         "by hand. No data loss is assumed.", registry=r)
        self.lag = Histogram("kvpf_ingest_lag_seconds", "Now minus the batch timestamp when a batch is applied.",
                             buckets=LAG_BUCKETS, registry=r)
        self.last_lag = PodLabelled(Gauge("kvpf_ingest_last_lag_seconds", "Lag of the last batch applied, by pod "
                                          "(for pod=\"_other\": of the last folded pod's).", ["pod"], registry=r), pods)

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
