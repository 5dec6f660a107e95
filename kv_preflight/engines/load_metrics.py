"""Engine load from an engine's Prometheus ``/metrics`` text: pure parsing, shared by the ingester
(which scrapes each pod it owns once for the whole fleet, ingester/fleet_member.py) and the predictor
(which scrapes its ``--pod-metrics`` overrides, predictor/load.py).

Which series to read is the engine adapter's (kv_preflight/engines/: ``LoadMetrics``): requests running,
requests waiting, and the fraction of KV blocks held by running requests.
"""
from __future__ import annotations

import math

from kv_preflight.engines.base import LoadMetrics


def sum_series(text: str, names: set[str] | frozenset[str], prefix: str) -> tuple[dict[str, float], dict[str, int]]:
    """Each named series summed over its label sets (an engine's DP ranks), and how many samples each had.
    Lines not starting with ``prefix`` are skipped unread; a sample that is not a finite number is ignored."""
    sums = dict.fromkeys(names, 0.0)
    counts = dict.fromkeys(names, 0)
    for line in text.splitlines():
        if not line.startswith(prefix):
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
    return sums, counts


def parse_load(text: str, names: LoadMetrics) -> tuple[float, float, float] | None:
    """(running, waiting, kv usage) summed over the engine's DP ranks (kv usage: their mean, from the first
    of ``names.kv_usage`` present); None if the engine exports neither running nor waiting."""
    sums, counts = sum_series(text, {names.running, names.waiting, *names.kv_usage}, names.prefix)
    if not counts[names.running] and not counts[names.waiting]:
        return None
    usage = next((sums[n] / counts[n] for n in names.kv_usage if counts[n]), 0.0)
    return sums[names.running], sums[names.waiting], min(max(usage, 0.0), 1.0)


def parse_rank_loads(text: str, names: LoadMetrics, label: str = "engine") -> dict[int, tuple[float, float, float]]:
    """(running, waiting, kv usage) of each data-parallel rank, from the series' ``engine="<rank>"`` label (vLLM
    0.32 labels every series of an engine core with its index, the rank); {} when no sample carries the label."""
    marker = f'{label}="'
    by_rank: dict[int, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith(names.prefix):
            continue
        at = line.find(marker)
        if at < 0:
            continue
        end = line.find('"', at + len(marker))
        value = line[at + len(marker):end] if end > 0 else ""
        if value.isdigit() and len(value) <= 4:
            by_rank.setdefault(int(value), []).append(line)
    out = {}
    for rank, lines in by_rank.items():
        load = parse_load("\n".join(lines), names)
        if load is not None:
            out[rank] = load
    return out
