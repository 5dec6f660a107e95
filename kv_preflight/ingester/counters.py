"""One call per counted event, feeding every place that counts it: the ingester's own tally (``counts``,
logged when it stops), its Prometheus series (ingester/metrics.py) and, for the events the index keeps
counters of (``kv-preflight index stats``, the predictor's ``/stats``), the Valkey counter.

``COUNTED`` lists every event and where it goes, so a new counter is one line there (and, if it has a
series of its own, its metric in ingester/metrics.py).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kv_preflight.index.index import VALKEY_ERRORS
from kv_preflight.index.write_side import WriteSide
from kv_preflight.ingester.metrics import IngesterMetrics

POD, ENDPOINT = "{pod}", "{endpoint}"  # label values filled in from the call


@dataclass(frozen=True)
class Counted:
    """Where one event is counted besides the tally: Prometheus series, each an IngesterMetrics attribute
    followed by its label values; the Valkey counter (PodMeta.count), the index-wide one or, ``by_pod``, the
    pod's; ``retried``: that write is retried until Valkey answers (else a failure is only counted)."""

    series: tuple[tuple[str, ...], ...] = ()
    valkey: str | None = None
    by_pod: bool = False
    retried: bool = False


COUNTED: dict[str, Counted] = {
    # the apply script's answer to a batch (ingester/apply.py)
    "batches_applied": Counted((("batches", POD, "applied"),)),
    "duplicates_skipped": Counted((("batches", POD, "dup"),)),  # another ingester applied it first
    "batches_gap": Counted((("batches", POD, "gap"),)),
    "batches_restart": Counted((("batches", POD, "restart"),)),
    "corrupt_batches": Counted((("batches", POD, "corrupt"), ("corrupt_batches",)), valkey="corrupt_batches"),
    # what applied batches did
    "blocks_stored": Counted(),
    "blocks_removed": Counted(),
    "orphan_blocks": Counted(valkey="orphans", by_pod=True, retried=True),
    "foreign_writes": Counted((("foreign_writes",),), valkey="foreign_keys"),
    # recovery (ingester/apply.py, ingester/resume.py)
    "gaps": Counted((("gaps", POD),)),
    "replays": Counted((("replays", POD),), valkey="replays", by_pod=True),
    "gaps_unrecovered": Counted((("gaps_unrecovered", POD),)),
    "engine_restarts": Counted(),
    "plan_errors": Counted(),
    "apply_errors": Counted((("apply_errors",),), valkey="apply_errors"),
    # frames (ingester/accept.py) and sockets
    "decode_errors": Counted((("decode_errors",),), valkey="decode_errors"),
    "placeholder_events": Counted((("placeholder_events",),), valkey="placeholder_events"),
    "frames_refused": Counted((("frames_refused", ENDPOINT),), valkey="frames_refused"),
    "publishers_refused": Counted((("publishers_refused",),)),
    "stream_drops": Counted((("stream_drops",),)),  # a stream's connection lost (ingester/subscriber.py)
    "streams_dead": Counted((("streams_dead",),)),  # a silent stream proven dead (ingester/liveness.py)
    # the fleet membership (ingester/fleet_member.py)
    "pod_conflicts": Counted((("pod_conflicts",),), valkey="pod_conflicts"),  # also a source's (ingester/accept.py)
    "pods_retired": Counted((("pods_retired",),)),
    "attach_errors": Counted((("engine_errors", "attach"),)),  # an engine's sources refused: that engine alone
    "detach_errors": Counted((("engine_errors", "detach"),)),
    "registrations_skipped": Counted((("engine_errors", "registration"),)),  # a kvpf:engines record unusable
    "round_overruns": Counted((("round_overruns",),)),  # a membership round past its deadline (watchdog)
    "data_losses": Counted((("data_losses",),), valkey="data_losses"),  # the index's epoch gone or changed
    # a cluster's slot marker gone from a primary that ran all along (evicted or deleted; written again)
    "markers_rewritten": Counted((("markers_rewritten",),)),
    # the process
    "valkey_errors": Counted((("valkey_errors",),)),
    "outbox_drains": Counted((("outbox_drains",),)),
    "loop_stalls": Counted((("loop_stalls",),)),
}


class Counters:
    def __init__(self, metrics: IngesterMetrics, index: WriteSide, retry: Callable[..., Awaitable[Any]]) -> None:
        self.counts: Counter[str] = Counter()
        self.metrics = metrics
        self.index = index
        self.retry = retry  # for ``retried`` Valkey counters: ValkeyRetry.call
        # each event's series, looked up once: (metric, its label values)
        self._series = {name: [(getattr(metrics, metric), tuple(labels)) for metric, *labels in counted.series]
                        for name, counted in COUNTED.items()}

    def tally(self, name: str, n: int = 1, *, pod: str | None = None, endpoint: str | None = None) -> Counted:
        """The tally and the Prometheus series, at once (a thread or a callback may call this); the Valkey
        counter is ``count``'s."""
        self.counts[name] += n
        for series, labels in self._series[name]:
            if labels:
                series = series.labels(*[pod if v is POD else endpoint if v is ENDPOINT else v for v in labels])
            series.inc(n)
        return COUNTED[name]

    async def count(self, name: str, n: int = 1, *, pod: str | None = None, endpoint: str | None = None) -> None:
        """Everywhere the event is counted: the tally, Prometheus and its Valkey counter."""
        counted = self.tally(name, n, pod=pod, endpoint=endpoint)
        if counted.valkey is None:
            return
        pod_id = pod if counted.by_pod else None
        if counted.retried:
            await self.retry(self.index.meta.count, counted.valkey, n, pod_id=pod_id)
            return
        try:
            await self.index.meta.count(counted.valkey, n, pod_id=pod_id)
        except VALKEY_ERRORS:
            self.tally("valkey_errors")
