"""What ``GET /stats`` reports: the index as ingesters left it, plus this process's own counts.

Each worker process counts only its own requests (no shared state between
workers), so the process block carries the pid to tell them apart.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from shared.index import PodInfo

EVENT_COUNTERS = ("batches", "stored", "removed", "cleared")


@dataclass
class ProcessCounters:
    predictions: int = 0
    errors: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "predictions": self.predictions, "errors": dict(self.errors)}


def pod_stats(info: PodInfo, now: float) -> dict[str, Any]:
    """One pod's line: freshness (last seq per DP rank, seconds since its last event) and what was applied."""
    counters = {name: 0 for name in EVENT_COUNTERS}
    counters.update(info.counters)
    return {
        "pod_id": info.pod_id,
        "model": info.model,
        "engine_block_size": info.engine_block_size,
        "last_seq": dict(sorted(info.seqs.items())),
        "last_event_age_s": None if info.last_event_time is None else round(now - info.last_event_time, 3),
        "blocks": info.blocks,
        "incomplete": info.incomplete,
        "incomplete_reason": info.incomplete_reason,
        "counters": counters,
    }


def build_stats(
    *, key_count: int, pods: list[PodInfo], index_counters: dict[str, int], process: ProcessCounters, now: float,
) -> dict[str, Any]:
    return {
        "index_keys": key_count,
        "pods": [pod_stats(p, now) for p in pods],
        "index_counters": index_counters,
        "process": process.as_dict(),
    }
