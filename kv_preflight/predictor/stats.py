"""What ``GET /stats`` reports: the index as ingesters left it, plus this process's own counts.

Each worker process counts only its own requests (no shared state between
workers), so the process block carries the pid to tell them apart.

A fleet can have tens of thousands of pods, so the answer is bounded whatever
their number: a summary over every pod (counts and totals, read with a few
pipelined round trips of ``PIPELINE_PODS`` pods each), then one page of pods
(``pods_offset``, ``pods_limit``, at most ``MAX_PODS_LIMIT``), or one pod by name.
"""
from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kv_preflight.predictor.errors import BadRequest, clip
from kv_preflight.index.read_side import ReadSide
from kv_preflight.index.pod_meta import PodInfo
from kv_preflight.keys.chain import HAS_C_EXTENSION

EVENT_COUNTERS = ("batches", "stored", "removed", "cleared")
DEFAULT_PODS_LIMIT = 100
MAX_PODS_LIMIT = 1000
# Pods per pipelined round trip (two commands each): large enough that 20K pods take ~40 round
# trips, small enough that one reply never holds Valkey or this process for long.
PIPELINE_PODS = 500


@dataclass
class ProcessCounters:
    predictions: int = 0
    errors: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "predictions": self.predictions, "errors": dict(self.errors)}


@dataclass(frozen=True)
class StatsQuery:
    """``/stats?pods_offset=&pods_limit=`` (a page of pods, in pod id order) or ``/stats?pod=NAME`` (one pod)."""

    pods_offset: int = 0
    pods_limit: int = DEFAULT_PODS_LIMIT
    pod: str | None = None

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> "StatsQuery":
        pod = params.get("pod")
        if pod is not None and not pod:
            raise BadRequest("pod must name a pod")
        return cls(
            pods_offset=_int_param(params, "pods_offset", 0, 0, None),
            pods_limit=_int_param(params, "pods_limit", DEFAULT_PODS_LIMIT, 0, MAX_PODS_LIMIT),
            pod=pod,
        )


def _int_param(params: Mapping[str, str], name: str, default: int, low: int, high: int | None) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw) if len(raw) <= 19 else None  # more digits than any offset: refuse, never parse
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise BadRequest(f"{name} must be an integer {bound}, got {clip(repr(raw))}")
    return value


def pod_stats(info: PodInfo, now: float) -> dict[str, Any]:
    """One pod's line: freshness (last seq per DP rank, seconds since its last event) and what was applied."""
    counters = {name: 0 for name in EVENT_COUNTERS}
    counters.update(info.counters)
    return {
        "pod_id": info.pod_id,
        "model": info.model,
        "engine_block_size": info.engine_block_size,
        "last_seq": dict(sorted(info.seqs.items())),
        "pending_effects": info.pending_effects,
        "last_event_age_s": None if info.last_event_time is None else round(now - info.last_event_time, 3),
        "blocks": info.blocks,
        "incomplete": info.incomplete,
        "incomplete_reason": info.incomplete_reason,
        "counters": counters,
    }


@dataclass
class PodsSummary:
    """Every pod at once, in numbers: how many, how many incomplete, and their blocks and events."""

    pods: int = 0
    incomplete_pods: int = 0
    models: int = 0
    blocks: int = 0
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_COUNTERS, 0))

    def as_dict(self) -> dict[str, Any]:
        return {"pods": self.pods, "incomplete_pods": self.incomplete_pods, "models": self.models,
                "blocks": self.blocks, "counters": dict(self.counters)}


def build_stats(
    *, key_count: int, pods: list[PodInfo], index_counters: dict[str, int], process: ProcessCounters, now: float,
    summary: PodsSummary | None = None, query: StatsQuery | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"index_keys": key_count}
    if summary is not None:
        q = query or StatsQuery()
        following = q.pods_offset + q.pods_limit
        out["summary"] = summary.as_dict()
        out["pods_offset"] = q.pods_offset
        out["pods_limit"] = q.pods_limit
        out["pods_next_offset"] = following if following < summary.pods else None
    out["pods"] = [pod_stats(p, now) for p in pods]
    out["index_counters"] = index_counters
    out["process"] = process.as_dict()
    out["c_extension"] = HAS_C_EXTENSION  # the C block-key routine is in (setup.py builds it where a compiler is)
    return out


# ---- Valkey reads


async def read_pods_summary(index: ReadSide, pod_models: Mapping[str, str]) -> PodsSummary:
    """Counts and totals over every pod, reading only the meta fields they need (PodMeta.meta_fields)."""
    fields = ("incomplete", "blocks", *EVENT_COUNTERS)
    summary = PodsSummary(pods=len(pod_models), models=len({m for m in pod_models.values() if m}))
    for values in await index.meta.meta_fields(sorted(pod_models), fields):
        if values is None:  # a key of a foreign type: skip it
            continue
        if values[0] is not None and bytes(values[0]) == b"1":
            summary.incomplete_pods += 1
        if values[1] is not None and bytes(values[1]).isdigit():
            summary.blocks += int(values[1])
        for name, value in zip(EVENT_COUNTERS, values[2:]):
            if value is not None:
                summary.counters[name] += int(value)
    return summary
