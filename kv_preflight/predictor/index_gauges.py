"""The fleet and the index in numbers, for the predictor's ``/metrics``: read at each scrape, beside its counters.

Pods by fleet state (the ingesters' records: live, unreachable, retired), pods by ingestion state (current,
behind, stalled, unknown: predictor/scoring/freshness.py), the worst pod's index lag and staleness, pods
flagged incomplete, request keys, engine blocks and Valkey's memory, in total and per pod. A dashboard graphs
these beside the ingesters' own series (compose/observability/).

They are read by the worker a scrape lands on (the fleet view it re-reads every second, and the few
pipelined Valkey reads ``/stats`` makes, behind the scrape: ``IndexReadings``, so ``/metrics`` never waits on
Valkey for long and a liveness probe on it does not follow Valkey), and exposed by a collector of their own,
not as prometheus-client gauges: under ``serve --workers N`` those live in per-worker files, where the worker a scrape missed would show
its last values and a pod that left would keep its series. ``/metrics`` has no series per pod (the number of
pods never adds one there); the per-pod ones (blocks, memory) are on ``/metrics/pods``, bounded: the
``MAX_POD_SERIES`` pods holding the most blocks have their own, the rest are summed under ``pod="_other"``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kv_preflight.metrics import OTHER_POD
from kv_preflight.predictor.scoring.freshness import BEHIND, CURRENT, STALLED, UNKNOWN

log = logging.getLogger("kvpf.predictor")

MAX_POD_SERIES = 100
READ_EVERY_S = 1.0  # a scrape starts a new reading of the index when the last is older than this
SCRAPE_WAITS_S = 0.5  # ... and waits this long for it, else it gets the last one
KEEP_S = 30.0  # a reading older than this is not shown: a gap in the graphs while Valkey does not answer
FLEET_STATES = ("live", "unreachable", "retired")
FRESHNESS_STATES = (CURRENT, BEHIND, STALLED, UNKNOWN)


@dataclass
class IndexGauges:
    """One scrape's reading. The Valkey part is None when Valkey did not answer in time (those series are
    then absent from the scrape, a gap in the graphs, rather than zeros that would read as an empty index)."""

    fleet_states: dict[str, int] = field(default_factory=dict)
    freshness_states: dict[str, int] = field(default_factory=dict)
    max_index_lag_s: float | None = None
    max_staleness_s: float | None = None
    index: "IndexNumbers | None" = None


@dataclass
class IndexNumbers:
    keys: int
    pods: int
    incomplete_pods: int
    blocks: int
    used_memory_bytes: int | None
    pod_blocks: dict[str, int]  # every pod in the index


def fleet_numbers(fleet) -> IndexGauges:
    """Pods by fleet and by ingestion state, the worst lag and staleness, from a FleetWatcher's last view
    (no I/O). Retired pods count only as retired: nothing is ingested for them any more."""
    out = IndexGauges(fleet_states=dict.fromkeys(FLEET_STATES, 0), freshness_states=dict.fromkeys(FRESHNESS_STATES, 0))
    if fleet is None or fleet.view is None:
        return out
    out.fleet_states.update(Counter(r.state for r in fleet.view.pods.values()))
    pods = fleet.known()
    lags, stale = [], []
    for fresh in fleet.freshness(sorted(pods)).values():
        out.freshness_states[fresh.state] = out.freshness_states.get(fresh.state, 0) + 1
        fresh = fleet.aged(fresh)
        if fresh.index_lag_ms is not None:
            lags.append(fresh.index_lag_ms / 1000)
        if fresh.staleness_ms is not None:
            stale.append(fresh.staleness_ms / 1000)
    out.max_index_lag_s = max(lags) if lags else None
    out.max_staleness_s = max(stale) if stale else None
    return out


def pod_series(pod_blocks: dict[str, int], limit: int = MAX_POD_SERIES) -> dict[str, int]:
    """The ``limit`` pods holding the most blocks (ties by name), the rest summed under ``_other`` (pure)."""
    ranked = sorted(pod_blocks.items(), key=lambda kv: (-kv[1], kv[0]))
    out = dict(ranked[:limit])
    if len(ranked) > limit:
        out[OTHER_POD] = sum(n for _, n in ranked[limit:])
    return out


def memory_share(used_memory: int | None, pod_blocks: dict[str, int]) -> dict[str, float]:
    """Each pod's estimated share of Valkey's memory: used_memory in proportion to the blocks it holds (every
    block costs about the same: its entries, presence bits and state), pure. Empty when Valkey did not say."""
    total = sum(pod_blocks.values())
    if used_memory is None or total <= 0:
        return {}
    return {pod: used_memory * n / total for pod, n in pod_blocks.items()}


async def read_index_numbers(index) -> IndexNumbers:
    """Keys, memory and each pod's blocks and flag: a few pipelined reads (``PodMeta.meta_fields``, 1,000 pods
    per round trip), as ``/stats`` makes for its summary."""
    pods = sorted(await index.meta.pod_ids())
    blocks: dict[str, int] = {}
    incomplete = 0
    for pod, values in zip(pods, await index.meta.meta_fields(pods, ("incomplete", "blocks"))):
        if values is None:  # a key of a foreign type
            continue
        if values[0] is not None and bytes(values[0]) == b"1":
            incomplete += 1
        raw = values[1]
        blocks[pod] = int(raw) if raw is not None and bytes(raw).isdigit() else 0
    return IndexNumbers(keys=await index.key_count(), pods=len(pods), incomplete_pods=incomplete,
                        blocks=sum(blocks.values()), used_memory_bytes=await index.memory_usage(), pod_blocks=blocks)


class IndexReadings:
    """The index's numbers for ``/metrics``, read behind the scrapes. A scrape starts a reading when the last is
    older than ``READ_EVERY_S`` and waits for it at most ``SCRAPE_WAITS_S``; otherwise (Valkey slow or down) it
    gets the last reading, or none once that is older than ``KEEP_S``. So the answer comes within half a second
    whatever Valkey does (a liveness probe on /metrics must not restart predictors during a Valkey outage), and
    one reading at a time runs per process, however often it is scraped."""

    def __init__(self, read: Callable[[], Awaitable[IndexNumbers]], timeout_s: float,
                 on_error: Callable[[], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.read = read
        self.timeout_s = timeout_s
        self.on_error = on_error  # told of each failed reading (not kvpf_valkey_errors: requests' calls only)
        self.clock = clock
        self.failing = False
        self.last: IndexNumbers | None = None
        self.last_at = float("-inf")
        self._task: asyncio.Task | None = None

    async def latest(self) -> IndexNumbers | None:
        if self._task is None and self.clock() - self.last_at >= READ_EVERY_S:
            self._task = asyncio.create_task(self._refresh())
        if self._task is not None:
            await asyncio.wait([self._task], timeout=SCRAPE_WAITS_S)
        return self.last if self.clock() - self.last_at < KEEP_S else None

    async def _refresh(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                numbers = await self.read()
            self.last, self.last_at = numbers, self.clock()
            self.failing = False
        except Exception as exc:  # noqa: BLE001 - Valkey down or slow: the last reading kept a while
            if self.on_error is not None:
                self.on_error()
            if not self.failing:  # once per outage
                log.warning("metrics: cannot read the index's numbers (%s: %s); /metrics shows the last reading "
                            "for %.0f s, then leaves them out", type(exc).__name__, exc, KEEP_S)
            self.failing = True
        finally:
            self._task = None

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class GaugesCollector(Collector):
    """One reading as metric families (registered in a registry of its own, for one scrape): the fleet and index
    totals for /metrics, or (``per_pod``) the series per pod for /metrics/pods."""

    def __init__(self, gauges: IndexGauges, *, per_pod: bool = False):
        self.gauges = gauges
        self.per_pod = per_pod

    def collect(self):
        if self.per_pod:
            yield from self._per_pod()
            return
        g = self.gauges
        fam = GaugeMetricFamily("kvpf_pods", "Pods by fleet state, as the ingesters' records say: live, unreachable "
                                "(failing health checks, not routed to), retired (entries cleared).", labels=["state"])
        for state, n in sorted(g.fleet_states.items()):
            fam.add_metric([state], n)
        yield fam
        fam = GaugeMetricFamily("kvpf_pods_freshness", "Pods not retired, by ingestion state: current, behind, "
                                "stalled, unknown (no live ingester lists it). docs/routing.md, Freshness.",
                                labels=["state"])
        for state, n in sorted(g.freshness_states.items()):
            fam.add_metric([state], n)
        yield fam
        if g.max_index_lag_s is not None:
            yield GaugeMetricFamily("kvpf_index_lag_seconds", "The largest index lag over the pods: now minus the "
                                    "engine timestamp of the pod's newest applied batch (it grows while an engine "
                                    "is idle; read it with kvpf_pods_freshness).", value=g.max_index_lag_s)
        if g.max_staleness_s is not None:
            yield GaugeMetricFamily("kvpf_index_staleness_seconds", "The largest staleness over the pods: time since "
                                    "the pod's ingester was last known current (0-1 s while current); the bound on "
                                    "what the index may be missing.", value=g.max_staleness_s)
        ix = g.index
        if ix is None:
            return
        yield GaugeMetricFamily("kvpf_index_keys", "Keys in Valkey (all of a cluster's primaries).", value=ix.keys)
        yield GaugeMetricFamily("kvpf_index_pods", "Pods in the index.", value=ix.pods)
        yield GaugeMetricFamily("kvpf_index_pods_incomplete", "Pods in the index flagged incomplete (a gap no replay "
                                "filled, a hand clear or import): their answers are lower bounds.",
                                value=ix.incomplete_pods)
        yield GaugeMetricFamily("kvpf_index_blocks", "Engine blocks the index holds, all pods.", value=ix.blocks)
        if ix.used_memory_bytes is not None:
            yield GaugeMetricFamily("kvpf_valkey_used_memory_bytes", "Valkey's used_memory (summed over a cluster's "
                                    "primaries).", value=ix.used_memory_bytes)

    def _per_pod(self):
        ix = self.gauges.index
        if ix is None:
            return
        shown = pod_series(ix.pod_blocks)
        fam = GaugeMetricFamily("kvpf_index_pod_blocks", f"Engine blocks the index holds, per pod (the "
                                f"{MAX_POD_SERIES} pods holding most; the rest summed under pod=\"_other\").",
                                labels=["pod"])
        for pod, n in shown.items():
            fam.add_metric([pod], n)
        yield fam
        if ix.used_memory_bytes is None:
            return
        fam = GaugeMetricFamily("kvpf_index_pod_memory_bytes", "Valkey memory per pod, estimated: used_memory in "
                                "proportion to the blocks each pod holds (pods as kvpf_index_pod_blocks).",
                                labels=["pod"])
        for pod, n in memory_share(ix.used_memory_bytes, shown).items():
            fam.add_metric([pod], n)
        yield fam


__all__ = ["GaugesCollector", "IndexGauges", "IndexNumbers", "IndexReadings", "fleet_numbers", "memory_share", "pod_series",
           "read_index_numbers"]
