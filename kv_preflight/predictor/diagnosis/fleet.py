"""Is the fleet losing cache hits to fragmentation? Pure: from two readings of counters to numbers and a verdict.

With N replicas and requests spread round robin, a prefix is cached where it first ran and a later
request for it lands there with probability about 1/N: the hit rate falls from ``p`` (what affinity
gets) to about ``p / N``, a loss near ``p (1 - 1/N)``. The readings (taken by ``kv-preflight diagnose
fleet``, cli/diagnose.py) are: each engine's own prefix-cache counters (queries and hits, in tokens, as
its adapter names them: ``Engine.prefix_cache_metrics``), the predictor's traffic totals (predictor/diagnosis/traffic.py: ``p`` = best-pod cached
tokens / prompt tokens of the predictions made), and, from the index, which pods hold each prefix
family's first block (its duplication). Window rates are the difference of two readings; a window of 0
uses the totals since the counters started.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from kv_preflight.engines import PrefixCacheMetrics
from kv_preflight.engines.load_metrics import sum_series

MAX_FAMILIES_KEPT = 20  # in the stored summary (served by /stats, so bounded)
MAX_PODS_KEPT = 64


class EngineCounters(msgspec.Struct, frozen=True):
    queries: float  # prompt tokens the engine looked up in its prefix cache
    hits: float  # of which it found cached


def parse_prefix_counters(text: str, names: PrefixCacheMetrics) -> EngineCounters | None:
    """The engine's prefix-cache counters summed over its label sets (DP ranks); None if it exposes none."""
    sums, counts = sum_series(text, {names.queries, names.hits}, names.prefix)
    seen = bool(counts[names.queries] or counts[names.hits])
    return EngineCounters(sums[names.queries], sums[names.hits]) if seen else None


class PodReport(msgspec.Struct, frozen=True):
    pod_id: str
    model: str
    blocks: int  # engine blocks the index holds for it
    queries: float | None  # prompt tokens over the window (None: its metrics could not be read)
    hits: float | None
    hit_rate: float | None
    error: str = ""


class FamilyReport(msgspec.Struct, frozen=True):
    first_key: str
    model: str
    predictions: int  # in the window
    pods: list[str]  # pods holding its first block now
    duplication: int


class FleetDiagnosis(msgspec.Struct, frozen=True):
    window_s: float  # 0: totals since the counters started
    pods: list[PodReport]
    families: list[FamilyReport]
    n_pods: int
    observed_hit_rate: float | None  # engines' hits / queries, all pods
    predictions: int
    p: float | None  # best-pod cached / prompt tokens over the predictions (the affinity ceiling)
    round_robin_bound: float | None  # p / N
    fragmentation_gap: float | None  # p (1 - 1/N)
    duplication_factor: float | None  # pods per family, weighted by predictions
    verdict: str  # affinity | fragmented | between | no_traffic
    detail: str
    at_ms: int = 0  # Valkey time of the diagnosis


def _delta(after: float, before: float | None) -> float:
    # A counter that went down means the engine restarted: count from zero.
    return after if before is None or after < before else after - before


def diagnose_fleet(*, pods: Mapping[str, tuple[str, int]], engines_before: Mapping[str, EngineCounters],
                   engines_after: Mapping[str, EngineCounters], engine_errors: Mapping[str, str],
                   traffic_before: Mapping[str, Any] | None, traffic_after: Mapping[str, Any] | None,
                   holders: Mapping[str, Sequence[str]], window_s: float, at_ms: int = 0) -> FleetDiagnosis:
    """``pods``: pod -> (model, blocks in the index); ``engines_*``: counters per pod (``before`` empty for a
    window of 0); ``traffic_*``: the predictor's /stats ``traffic``; ``holders``: first key -> pods holding it."""
    reports = []
    total_q = total_h = 0.0
    for pod in sorted(set(pods) | set(engines_after) | set(engine_errors)):
        model, blocks = pods.get(pod, ("", 0))
        after = engines_after.get(pod)
        if after is None:
            reports.append(PodReport(pod, model, blocks, None, None, None, engine_errors.get(pod, "no metrics URL")))
            continue
        before = engines_before.get(pod)
        q = _delta(after.queries, before.queries if before else None)
        h = _delta(after.hits, before.hits if before else None)
        total_q += q
        total_h += h
        reports.append(PodReport(pod, model, blocks, q, h, round(h / q, 4) if q else None))
    n = len(pods) or len(engines_after)
    observed = round(total_h / total_q, 4) if total_q else None

    after_t = traffic_after or {}
    before_t = traffic_before or {}
    preds = int(after_t.get("predictions", 0)) - int(before_t.get("predictions", 0))
    prompt = int(after_t.get("prompt_tokens", 0)) - int(before_t.get("prompt_tokens", 0))
    cached = int(after_t.get("best_cached_tokens", 0)) - int(before_t.get("best_cached_tokens", 0))
    if preds < 0 or prompt < 0:  # the predictor restarted within the window
        preds, prompt, cached = (int(after_t.get(k, 0)) for k in ("predictions", "prompt_tokens", "best_cached_tokens"))
    p = round(cached / prompt, 4) if prompt > 0 else None

    before_fam = {f["first_key"]: f["predictions"] for f in before_t.get("families", [])}
    families = []
    for f in after_t.get("families", []):
        count = f["predictions"] - before_fam.get(f["first_key"], 0)
        if count < 0:  # the predictor restarted
            count = f["predictions"]
        if count == 0:
            continue
        held = sorted(holders.get(f["first_key"], ()))
        families.append(FamilyReport(f["first_key"], f.get("model", ""), count, held, len(held)))
    families.sort(key=lambda f: (-f.predictions, f.first_key))
    weight = sum(f.predictions for f in families if f.duplication)
    dup = round(sum(f.duplication * f.predictions for f in families if f.duplication) / weight, 3) if weight else None

    rr = round(p / n, 4) if p is not None and n else None
    gap = round(p * (1 - 1 / n), 4) if p is not None and n else None
    verdict, detail = _verdict(observed, p, rr, n, dup)
    return FleetDiagnosis(window_s=window_s, pods=reports, families=families, n_pods=n, observed_hit_rate=observed,
                          predictions=preds, p=p, round_robin_bound=rr, fragmentation_gap=gap,
                          duplication_factor=dup, verdict=verdict, detail=detail, at_ms=at_ms)


def _verdict(observed: float | None, p: float | None, rr: float | None, n: int,
             dup: float | None) -> tuple[str, str]:
    if observed is None or p is None or rr is None:
        what = "no engine prefix-cache traffic" if observed is None else "no predictions"
        return "no_traffic", f"{what} in the window: nothing to compare (send traffic, or a longer --window)"
    dup_text = f"; each prefix family's first block sits on {dup:g} pod(s) on average" if dup is not None else ""
    nums = (f"the fleet hit {observed:.1%} of prompt tokens; affinity would reach p = {p:.1%}; round robin over "
            f"{n} pod(s) is bounded near p/N = {rr:.1%}{dup_text}")
    if n <= 1:
        return "affinity", f"{nums}: one pod, nothing to fragment"
    if observed >= p - (p - rr) / 4:
        return "affinity", f"{nums}: requests reach the pods holding their prefix"
    if observed <= rr + (p - rr) / 4 or (dup is not None and dup >= n - 0.5 and observed < p):
        return "fragmented", (f"{nums}: round-robin fragmentation costs about {p - observed:.1%} of prompt tokens; "
                              "route with /v1/cache/route (or sticky sessions) so a prefix meets its cache")
    return "between", f"{nums}: some requests miss the pod holding their prefix; check the router's affinity"


def bounded(d: FleetDiagnosis) -> FleetDiagnosis:
    """The summary /stats serves: at most MAX_PODS_KEPT pods and MAX_FAMILIES_KEPT families."""
    return msgspec.structs.replace(d, pods=d.pods[:MAX_PODS_KEPT], families=d.families[:MAX_FAMILIES_KEPT])


def stats_view(raw: bytes | None, at_ms: int, now_ms: int) -> dict[str, Any] | None:
    """The stored summary as /stats shows it: the diagnosis and its age in seconds (None: never run)."""
    if not raw:
        return None
    try:
        summary = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return {"error": "the stored fleet diagnosis does not decode"}
    return {"age_s": round(max(0, now_ms - at_ms) / 1000, 3), "summary": summary}
