"""Which pod to send a request to: the best cache overlap, unless that pod is overloaded. Pure.

The cache saves prefill only if the request is not left waiting in a queue behind
it, so overlap alone makes a hot spot of the pod holding a popular prefix. The rule
(docs/routing.md compares it with llm-d, SGLang and Dynamo):

1. Each candidate's overlap is its predicted cached tokens times the weight of the
   tier they sit on (gpu 1.0, cpu 0.8: CPU-offloaded blocks must be copied back).
2. Its load is ``running + waiting_weight * waiting`` from the engine's metrics. A pod
   whose load is not known (no fresh metrics) is assumed as loaded as the mean of the
   candidates whose load is known: unknown is neither idle nor busy, so such pods neither
   sort last (everything would go to the few scraped pods) nor first. Where gateways book
   their requests (``booked``: kv_preflight/index/routed.py), a pod's load is at least the
   requests booked there: the metrics lag a second behind, the bookings do not, so N
   gateways do not all send a burst to the pod the last scrape called idle; among equal
   loads, fewer booked tokens first. For the same reason a scrape that counted the
   gateways' requests is taken less those of them that have ended since
   (``booked_at_scrape``: how many were booked there when it was taken;
   predictor/scoring/routed.py ``load_now``), else a burst that has drained still reads
   as a queue until the next scrape and moves its prefix's next requests away.
3. A pod with known load is overloaded when its KV usage is at least ``max_kv_usage``
   (new requests there would evict or queue), or when its load exceeds the *reference*
   by at least ``overload_abs`` *and* by the factor ``overload_rel`` (both, as SGLang's
   balance thresholds, so small absolute numbers never trigger it). The reference is the
   fleet's mean load over every candidate, overlap or not, this pod included; each pod
   of unknown load counts as the mean of the known ones other than this pod, or as idle
   when there are none: a lone pod with known load is judged against idle peers, so it
   can be called overloaded (else everything would go to it).
4. The best-overlap pod wins unless overloaded. Then the least loaded of the *good
   matches* (not overloaded, overlap >= ``good_match`` x the best's) wins; with no
   good match, the least loaded pod at all.
5. With no overlap anywhere the prompt's prefix is new, and where it goes it stays (later
   requests follow the cache), so it is placed by cache room, not by this second's load: a
   prefix still *pending* (placed on a pod moments ago, not indexed yet) goes there again;
   else the non-overloaded pod with the fewest blocks of other recent prefixes homed on it
   (``footprints``, predictor/scoring/placement.py), then the least loaded, then a rendezvous hash of
   the prompt's first block, so one prefix keeps going to one pod and builds a cache there.
   Without footprints (none known yet) that is the least loaded pod. Gateways placing new prefixes at the same
   moment all see the same state (every pod empty and idle, before any of their homes or bookings land), so the
   hash would pile a burst of distinct new prefixes on the pods it happens to favour: where gateways share Valkey,
   the placement is claimed fleet-wide (kv_preflight/index/routed.py ``claim``): rule 5's order
   (``placement_order``), weighed with the placements of the last moment that the footprints read may not show
   yet (``placed_on``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import msgspec

from kv_preflight.index.routed import Booked
from kv_preflight.predictor.explain.findings import Finding
from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.freshness import Freshness
from kv_preflight.predictor.scoring.routed import load_now
from kv_preflight.predictor.scoring.score import Prediction
from kv_preflight.predictor.scoring.ttft import PrefillModel
from kv_preflight.config import Config

_DEFAULTS = Config()  # the documented defaults live in one place: kv_preflight/config.py


@dataclass(frozen=True)
class RoutingPolicy:
    tier_weights: Mapping[str, float] = field(default_factory=lambda: dict(_DEFAULTS.route_tier_weights))
    waiting_weight: float = _DEFAULTS.route_waiting_weight
    overload_abs: float = _DEFAULTS.route_overload_abs
    overload_rel: float = _DEFAULTS.route_overload_rel
    max_kv_usage: float = _DEFAULTS.route_max_kv_usage
    good_match: float = _DEFAULTS.route_good_match
    stale_s: float = _DEFAULTS.route_stale_s
    default_tier_weight: float = 0.8  # a tier not in tier_weights (disk, remote): at most a CPU hit

    def tier_weight(self, tier: str) -> float:
        return self.tier_weights.get(tier, self.default_tier_weight)

    def load_score(self, load: PodLoad) -> float:
        return load.running + self.waiting_weight * load.waiting


class RouteCandidate(msgspec.Struct, frozen=True, omit_defaults=True):
    pod_id: str
    cached_tokens: int
    weighted_overlap: float
    estimated_ttft_ms: float
    overloaded: bool = False
    device_tier: str | None = None
    # running + waiting_weight * waiting (less the gateways' requests ended since the scrape; at least those booked
    # here); None: no fresh metrics. ``running`` and ``waiting`` are the engine's, as scraped
    load: float | None = None
    assumed_load: float | None = None  # no fresh metrics: the load assumed (the known candidates' mean)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    recent_prefix_blocks: int | None = None  # blocks of other recent prefixes homed here (placement hint)
    dp_rank: int | None = None  # the pod's data-parallel rank, each a cache of its own (predictor/scoring/ranks.py)
    booked_requests: int | None = None  # requests the gateways have in flight here (None: bookings not read)
    booked_tokens: int | None = None  # their summed cost: uncached prefill + decode tokens


class RouteDecision(msgspec.Struct, frozen=True):
    pod_id: str | None
    # best_overlap | least_loaded_good_match | least_loaded | no_overlap | all_overloaded | no_candidates |
    # stale_index (max_staleness_ms: the index was older than allowed, routed by load alone)
    reason: str
    detail: str
    total_prompt_tokens: int
    cached_tokens: int
    estimated_ttft_ms: float
    best_overlap_pod: str | None
    candidates: list[RouteCandidate]
    warnings: list[Finding] = msgspec.field(default_factory=list)  # predictor/explain/warnings.py
    freshness: Freshness | None = None  # the prediction's, and each candidate's (predictor/scoring/freshness.py)
    # The chosen pod's data-parallel rank (None: a pod without ranks), and the headers a request needs to reach
    # it there ({"X-data-parallel-rank": "<r>"}: vLLM's engine pins the request to that rank); ranks.py
    dp_rank: int | None = None
    headers: dict[str, str] | None = None
    best_overlap_dp_rank: int | None = None


def rendezvous(affinity_key: int, pod_id: str) -> int:
    """Highest-random-weight hashing: stable per (prefix, pod), spread evenly over pods."""
    digest = hashlib.blake2b(f"{affinity_key}:{pod_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def decide(
    prediction: Prediction,
    candidates: Collection[str],
    loads: Mapping[str, PodLoad | None],
    *,
    policy: RoutingPolicy,
    ttft: PrefillModel,
    affinity_key: int = 0,
    footprints: Mapping[str, int] | None = None,
    pending: str | None = None,
    booked: Mapping[str, Booked] | None = None,
    booked_at_scrape: Mapping[str, int] | None = None,
) -> RouteDecision:
    n = prediction.total_prompt_tokens
    by_pod = {a.pod_id: a for a in prediction.pod_affinities}
    pods = sorted(set(candidates))
    booked = booked or {}
    then = booked_at_scrape or {}
    scores = {}
    for p in pods:
        if (ld := loads.get(p)) is None:
            continue
        if (b := booked.get(p)) is not None and (t := then.get(p)) is not None:
            ld = load_now(ld, t, b.requests)  # the scrape less the gateways' requests that ended since it
        scores[p] = policy.load_score(ld)
    for p in pods:  # at least what the gateways have in flight there (the scrape counts them a second late)
        if (b := booked.get(p)) is not None:
            scores[p] = max(scores.get(p, 0.0), float(b.requests))
    known_mean = sum(scores.values()) / len(scores) if scores else None

    def effective(pod: str) -> float:
        """Known load, else the known candidates' mean (0 when none is known: all tie)."""
        s = scores.get(pod, known_mean)
        return 0.0 if s is None else s

    refs = load_references(scores, len(pods)) if len(pods) > 1 else {}

    def overloaded(pod: str) -> bool:
        ld = loads.get(pod)
        if ld is not None and ld.kv_usage >= policy.max_kv_usage:
            return True
        if pod not in refs:
            return False
        s, ref = scores[pod], refs[pod]
        return s - ref >= policy.overload_abs and s >= policy.overload_rel * max(ref, 1.0)

    cands = []
    ttft_at: dict[int, float] = {}  # cached tokens -> the estimate (most candidates hold nothing: one estimate)
    for pod in pods:
        a = by_pod.get(pod)
        cached = a.cached_tokens if a else 0
        ld = loads.get(pod)
        if (estimate := ttft_at.get(cached)) is None:
            estimate = ttft_at[cached] = ttft.estimate_ms(n, cached)
        cands.append(RouteCandidate(
            pod_id=pod, cached_tokens=cached,
            weighted_overlap=round(cached * policy.tier_weight(a.device_tier), 3) if a else 0.0,
            estimated_ttft_ms=estimate, overloaded=overloaded(pod),
            device_tier=a.device_tier if a else None,
            load=scores.get(pod),
            assumed_load=round(known_mean, 3) if pod not in scores and known_mean is not None else None,
            running=ld.running if ld else None, waiting=ld.waiting if ld else None,
            kv_usage=round(ld.kv_usage, 4) if ld else None,
            recent_prefix_blocks=footprints.get(pod) if footprints else None,
            booked_requests=b.requests if (b := booked.get(pod)) is not None else None,
            booked_tokens=b.tokens if b is not None else None,
        ))
    cands.sort(key=lambda c: (-c.weighted_overlap, c.pod_id))

    def least_loaded(pool: list[RouteCandidate]) -> RouteCandidate:
        # lower (known or assumed) load, then more overlap, then the prefix's rendezvous order
        return min(pool, key=lambda c: (effective(c.pod_id), c.booked_tokens or 0, -c.weighted_overlap,
                                        -rendezvous(affinity_key, c.pod_id)))

    def decision(chosen: RouteCandidate | None, reason: str, detail: str, best: RouteCandidate | None) -> RouteDecision:
        return RouteDecision(
            pod_id=chosen.pod_id if chosen else None, reason=reason, detail=detail, total_prompt_tokens=n,
            cached_tokens=chosen.cached_tokens if chosen else 0,
            estimated_ttft_ms=chosen.estimated_ttft_ms if chosen else ttft.estimate_ms(n, 0),
            best_overlap_pod=best.pod_id if best and best.weighted_overlap > 0 else None, candidates=cands,
        )

    if not cands:
        return decision(None, "no_candidates", "no pod is known to serve this model (no index entries, fleet "
                        "records, metrics targets or engine model lists name it)", None)
    top = cands[0].weighted_overlap
    best = least_loaded([c for c in cands if c.weighted_overlap == top])
    if top <= 0:
        pool = _placement_pool(cands)
        held = next((c for c in pool if c.pod_id == pending), None)
        if held is not None:
            return decision(held, "no_overlap", f"no pod holds a prefix of this prompt yet; it was just placed on "
                            f"{held.pod_id} (pending: not indexed yet), so it goes there again", None)
        room = footprints or {}
        chosen = min(pool, key=lambda c: _placement_key(c, effective(c.pod_id), affinity_key))
        if any(room.get(c.pod_id, 0) for c in pool):
            how = f"the pod with the fewest blocks of other recent prefixes ({room.get(chosen.pod_id, 0)})"
            how += ", then least loaded" if scores else ", then by prefix hash"
        else:
            how = "least loaded" if scores else "no load data, spread by prefix hash"
        return decision(chosen, "no_overlap", f"no pod holds a prefix of this prompt: {how}", None)
    if not best.overloaded:
        return decision(best, "best_overlap", f"{best.pod_id} holds the most of this prompt "
                        f"({best.cached_tokens} tokens) and is not overloaded", best)
    why = _overload_reason(best, policy, refs.get(best.pod_id, 0.0))
    good = [c for c in cands if not c.overloaded and c.weighted_overlap > 0
            and c.weighted_overlap >= policy.good_match * best.weighted_overlap]
    if good:
        chosen = least_loaded(good)
        return decision(chosen, "least_loaded_good_match", f"{best.pod_id} has the best overlap but is overloaded "
                        f"({why}); {chosen.pod_id} is the least loaded pod holding at least "
                        f"{policy.good_match:.0%} of that overlap ({chosen.cached_tokens} tokens)", best)
    rest = [c for c in cands if not c.overloaded]
    if rest:
        chosen = least_loaded(rest)
        return decision(chosen, "least_loaded", f"{best.pod_id} has the best overlap but is overloaded ({why}) and "
                        f"no other pod holds {policy.good_match:.0%} of it; {chosen.pod_id} is the least loaded", best)
    return decision(best, "all_overloaded", "every candidate is overloaded: the best overlap saves the most work", best)


def load_references(scores: Mapping[str, float], n_pods: int) -> dict[str, float]:
    """Per pod with a known load, the fleet's mean load it is compared with: over all ``n_pods`` candidates, this
    pod included, each unknown one counted as the mean of the known ones other than this pod, or as idle when there
    are none (this pod's load says nothing of theirs). From one sum, not a pass over the fleet per pod (a thousand
    pods made that a million steps per decision)."""
    total, known = sum(scores.values()), len(scores)
    out = {}
    for pod, s in scores.items():
        fill = (total - s) / (known - 1) if known > 1 else 0.0
        out[pod] = (total + (n_pods - known) * fill) / n_pods
    return out


def _overload_reason(c: RouteCandidate, policy: RoutingPolicy, reference: float) -> str:
    if c.kv_usage is not None and c.kv_usage >= policy.max_kv_usage:
        return f"KV usage {c.kv_usage:.0%} >= {policy.max_kv_usage:.0%}"
    return f"load {c.load:g} vs the fleet's mean {reference:g}"


def placement_order(decision: RouteDecision, affinity_key: int) -> list[tuple[str, int]]:
    """For a new prefix placed by rule 5 (``no_overlap``), the pods it was chosen from in rule 5's order (fewest
    blocks of other prefixes, least loaded, fewer booked tokens, the prefix's rendezvous order: the chosen pod
    first), each with its footprint: what a claim weighs with the placements other gateways made a moment ago.
    [] for any other decision."""
    if decision.reason != "no_overlap" or decision.pod_id is None:
        return []
    pool = sorted(_placement_pool(decision.candidates), key=lambda c: _placement_key(
        c, c.load if c.load is not None else (c.assumed_load or 0.0), affinity_key))
    return [(c.pod_id, c.recent_prefix_blocks or 0) for c in pool]


def _placement_pool(cands: list[RouteCandidate]) -> list[RouteCandidate]:
    """Rule 5's pool: the candidates not overloaded, or all of them when every one is."""
    return [c for c in cands if not c.overloaded] or cands


def _placement_key(c: RouteCandidate, load: float, affinity_key: int) -> tuple[int, float, int, int]:
    """Rule 5's order: fewest blocks of other recent prefixes, least (known or assumed) ``load``, fewer booked
    tokens, the prefix's rendezvous order."""
    return c.recent_prefix_blocks or 0, load, c.booked_tokens or 0, -rendezvous(affinity_key, c.pod_id)


def placed_on(decision: RouteDecision, pod: str) -> RouteDecision:
    """``decision`` (a new prefix's) sent to ``pod`` instead: the claim's pod (the fewest blocks once the placements
    other gateways made a moment ago count, or where one of them placed this prefix moments ago)."""
    chosen = next(c for c in decision.candidates if c.pod_id == pod)
    return msgspec.structs.replace(
        decision, pod_id=pod, cached_tokens=chosen.cached_tokens, estimated_ttft_ms=chosen.estimated_ttft_ms,
        detail=f"no pod holds a prefix of this prompt: {pod} has the fewest blocks of other prefixes once the new "
               "prefixes the gateways placed a moment ago count too (or a gateway placed this prefix there moments "
               "ago)")
