"""Python's cycle collector, tuned for the long-running processes' heaps (the ingester, the predictor, the gateway).

The ingester holds large, long-lived state (each pod's blocks and ref counts, the chain LRU) and allocates
many short-lived containers per batch (decoded events, plans, command arguments) that reference counting
frees on its own: they form no cycles. With the default thresholds (a young collection every 700
allocations, a full one whenever a quarter of the heap is new) the collector kept walking that state: with
the defaults one ingester applied about 50K engine blocks per CPU-second on scripts/bench's steady workload,
with these about 75-85K (2026-12-02, single node; the cluster ingester gains likewise). The long-lived
objects that matter most are not tracked at all (``gc=False`` Structs: pod_state._Block, bridge.ChainPoint);
what the process imported is frozen out of every pass; the thresholds make passes rarer. Cycles are still
collected, later.

A predictor or gateway worker is the same shape: what it imported and built at start (Starlette, redis-py,
prometheus-client, the tokenizers) never changes, and each request's objects (its body, keys, futures)
are freed by reference counting; a pass over that start-up heap is time a request waits. Measured on the gateway
at concurrency 32 (``scripts/bench --only gateway``'s setting, 12 interleaved pairs each, 2026-12-07): the added
latency's p50 unchanged (+1.36 ms both), its p99 +1.87 -> +1.73 ms (medians over the pairs).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLDS = (100_000, 20, 20)  # young collection every 100K net allocations (default 700, 10, 10)


@contextmanager
def tuned_collector() -> Iterator[None]:
    """The ingester's collector settings for the body (the process's modules frozen, rarer passes); the
    previous settings afterwards (``scripts/bench`` runs an ingester in its own process beside other rows)."""
    before = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


__all__ = ["THRESHOLDS", "tuned_collector"]
