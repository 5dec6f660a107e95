"""Engine load from an engine's Prometheus ``/metrics`` text: pure parsing, shared by the ingester
(which scrapes each pod it owns once for the whole fleet, ingester/fleet.py) and the predictor
(which scrapes its ``--pod-metrics`` overrides, predictor/load.py).

vLLM exports the signals routing needs (0.32): requests running, requests waiting, and the fraction
of KV blocks held by running requests (``vllm:kv_cache_usage_perc``; cached-but-free blocks do not
count).
"""
from __future__ import annotations

import math

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before the v1 engine


def parse_vllm_metrics(text: str) -> tuple[float, float, float] | None:
    """(running, waiting, kv usage) summed over the engine's DP ranks (kv usage: their mean); None if absent."""
    sums = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0, KV_USAGE_OLD: 0.0}
    counts = dict.fromkeys(sums, 0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        name = line[:name_end]
        if name not in sums:
            continue
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            sums[name] += value
            counts[name] += 1
    if not counts[RUNNING] and not counts[WAITING]:
        return None
    usage_name = KV_USAGE if counts[KV_USAGE] else KV_USAGE_OLD
    usage = sums[usage_name] / counts[usage_name] if counts[usage_name] else 0.0
    return sums[RUNNING], sums[WAITING], min(max(usage, 0.0), 1.0)
