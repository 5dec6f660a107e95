"""Turn per-pod prefix matches into the numbers the predictor answers: pure, no I/O.

The index counts canonical blocks (``C`` tokens each), but an engine only reuses
whole blocks of its own size ``E`` and always recomputes at least the last prompt
token, so a match of ``b`` canonical blocks is worth
``min(floor(b*C/E)*E, floor((N-1)/E)*E)`` tokens for a prompt of ``N`` tokens.
Predicting more would tell a scheduler a pod is warmer than the engine will find it.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from operator import attrgetter
from typing import Protocol

import msgspec

from kv_preflight.index.rank_pods import base_pod
from kv_preflight.predictor.explain.findings import Finding
from kv_preflight.predictor.scoring.freshness import Freshness
from kv_preflight.predictor.scoring.ttft import PrefillModel

try:  # the per-pod loop in C (kv_preflight/_speedups.c); the Python loop below is the reference and the fallback
    from kv_preflight._speedups import affinities as _c_affinities
except ImportError:  # pragma: no cover - a source checkout without the extension built
    _c_affinities = None


class Match(Protocol):
    """What scoring needs of a lookup result (``kv_preflight.index.index.PodMatch`` fits)."""

    pod_id: str
    blocks: int
    tier: str


class PodInfo(Protocol):
    """What scoring needs of a pod's metadata (``kv_preflight.index.pod_meta.ScoringInfo`` fits)."""

    engine_block_size: int | None
    incomplete: bool


class PodAffinity(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):  # scalars only: see PodMatch
    pod_id: str
    cached_blocks: int  # canonical blocks matched, before engine-block rounding
    cached_tokens: int  # what the engine would actually reuse
    device_tier: str
    estimated_ttft_ms: float | None = None  # prefill model: this pod's TTFT given its cached tokens
    incomplete: bool = False  # the pod's index may be missing blocks (gap, lost events)
    # the pod's data-parallel rank, each rank a cache of its own (predictor/scoring/ranks.py); none without ranks
    dp_rank: int | None = None
    # its engine fails its health checks (its fleet record says unreachable): listed with what the index holds
    # for it, never the best pod (a stopped engine holds nothing; a route never sends there)
    unreachable: bool = False
    # of cached_blocks, those counted on a gateway's speculative entries alone (a prompt just sent there, its
    # events not in yet: predictor/scoring/routed.py); 0 (omitted): all the index's
    speculative_blocks: int = 0


class Prediction(msgspec.Struct, frozen=True, omit_defaults=True):
    predicted_cached_tokens: int
    total_prompt_tokens: int
    blocks_total: int
    blocks_cached: int
    cache_hit_ratio: float
    best_pod: str | None
    pod_affinities: list[PodAffinity]
    estimated_ttft_ms: float | None = None  # on the best pod (no pod: nothing cached)
    # Valkey Cluster with a shard down (and no replica to take over): the counts are lower bounds,
    # and this is the first request-key block (0-based) whose shard did not answer.
    partial: bool = False
    partial_from_block: int | None = None
    # Cache-breaking problems seen without a lookup (predictor/explain/warnings.py): the predictor always
    # sets a list, so answers always carry it (None is only the default of structs built elsewhere).
    warnings: list[Finding] | None = None
    # How fresh the answer is (predictor/scoring/freshness.py): exact, degraded with reasons, or partial, and
    # per pod named in the answer its ingestion state, staleness and index lag. Set by the predictor.
    freshness: Freshness | None = None
    best_dp_rank: int | None = None  # best_pod's data-parallel rank (a pod with ranks: predictor/scoring/ranks.py)


_POD_ID = attrgetter("pod_id")
_CACHED_TOKENS = attrgetter("cached_tokens")


def engine_cached_tokens(blocks: int, canonical_block: int, engine_block: int | None, prompt_len: int) -> int:
    """Tokens an engine with ``engine_block``-sized blocks reuses from ``blocks`` matched canonical blocks."""
    if blocks <= 0 or prompt_len <= 1:
        return 0
    e = engine_block if engine_block and engine_block > 0 else canonical_block
    by_match = (blocks * canonical_block) // e * e
    by_last_token = (prompt_len - 1) // e * e
    return max(0, min(by_match, by_last_token))


def score(
    matches: Iterable[Match],
    *,
    prompt_len: int,
    canonical_block: int,
    engine_blocks: Mapping[str, int | None] | None = None,
    incomplete: Collection[str] = (),
    pods: Collection[str] | None = None,
    ttft: PrefillModel | None = None,
    infos: Mapping[str, PodInfo] | None = None,
    unreachable: Collection[str] = (),
) -> Prediction:
    """Rank pods by the tokens their engine would reuse; ties go to the smaller pod id.

    ``engine_blocks`` maps pod -> engine block size (missing or None: canonical);
    ``pods``, when given, keeps only those pods (the lookup filters too; this keeps
    scoring correct for any match source). Pods that would reuse nothing are left out.
    ``ttft``, when given, adds each pod's estimated time to first token. ``infos`` (pod -> its metadata),
    when given, says a pod's engine block size and incompleteness instead (a pod it lacks: the two above),
    so a caller holding the metadata builds no per-pod maps for this. Pods in ``unreachable`` (their engine
    fails its health checks) are listed, marked, and never the best pod.
    """
    wanted = set(pods) if pods is not None else None
    estimate = ttft.estimates_for(prompt_len) if ttft else None
    if _c_affinities is not None and not engine_blocks and not incomplete and canonical_block > 0:
        # the predictor's case (metadata only): the same loop in C, faster where many pods match (CHANGELOG)
        info_map = (infos if isinstance(infos, dict) else dict(infos)) if infos else None
        affinities = _c_affinities(matches, prompt_len, canonical_block, info_map, wanted, estimate, PodAffinity)
    else:
        affinities = _affinities(matches, prompt_len, canonical_block, engine_blocks, incomplete, wanted, estimate,
                                 infos)
    return ranked(affinities, prompt_len, canonical_block, ttft, unreachable)


def _affinities(matches: Iterable[Match], prompt_len: int, canonical_block: int,
                engine_blocks: Mapping[str, int | None] | None, incomplete: Collection[str],
                wanted: set[str] | None, estimate, infos: Mapping[str, PodInfo] | None) -> list[PodAffinity]:
    """The per-pod loop, unsorted: the reference for ``_speedups.affinities`` (tests hold the two equal)."""
    eb_of = (engine_blocks or {}).get
    info_of = infos.get if infos else None
    affinities: list[PodAffinity] = []
    add = affinities.append
    # A fleet-wide prefix gives 1,000 pods: engine_cached_tokens inline, its last-token cap computed once
    # per engine block size, each distinct estimate once (a function call per pod was a third of the
    # prediction's Python time there).
    estimates: dict[int, float | None] = {}
    caps: dict[int, int] = {}  # engine block size -> the most it reuses of this prompt (the last token recomputed)
    for m in matches:
        pod = m.pod_id
        if wanted is not None and pod not in wanted:
            continue
        blocks = m.blocks
        info = info_of(pod) if info_of is not None else None
        if info is not None:
            e, partial = info.engine_block_size, info.incomplete
        else:
            e, partial = eb_of(pod), pod in incomplete
        if not e or e <= 0:
            e = canonical_block
        cap = caps.get(e)
        if cap is None:
            cap = caps[e] = (prompt_len - 1) // e * e if prompt_len > 1 else 0
        tokens = blocks * canonical_block // e * e
        if tokens > cap:
            tokens = cap
        if tokens <= 0:
            continue
        est = estimates.get(tokens)
        if est is None and estimate is not None:
            est = estimates[tokens] = estimate(tokens)
        add(PodAffinity(pod, blocks, tokens, m.tier, est, partial))
    return affinities


def ranked(affinities: list[PodAffinity], prompt_len: int, canonical_block: int,
           ttft: PrefillModel | None, unreachable: Collection[str] = ()) -> Prediction:
    """The prediction from the pods' affinities: best first, ties by pod id; the best is the first whose
    engine is not ``unreachable`` (those are marked)."""
    # by tokens (most first), ties by pod id: two passes with C keys (sorting is stable, reverse too),
    # half the time of one pass with a tuple per pod
    affinities.sort(key=_POD_ID)
    affinities.sort(key=_CACHED_TOKENS, reverse=True)
    best = affinities[0] if affinities else None
    if unreachable and best is not None:
        down = set(unreachable)  # pods: an index pod of a data-parallel rank, <pod>@dp<r>, is down with its pod
        if any(base_pod(a.pod_id) in down for a in affinities):
            affinities[:] = [msgspec.structs.replace(a, unreachable=True) if base_pod(a.pod_id) in down else a
                             for a in affinities]
            best = next((a for a in affinities if not a.unreachable), None)
    predicted = best.cached_tokens if best else 0
    return Prediction(
        predicted_cached_tokens=predicted,
        total_prompt_tokens=prompt_len,
        blocks_total=prompt_len // canonical_block,
        blocks_cached=best.cached_blocks if best else 0,
        cache_hit_ratio=predicted / prompt_len if prompt_len > 0 else 0.0,
        best_pod=best.pod_id if best else None,
        pod_affinities=affinities,
        estimated_ttft_ms=ttft.estimate_ms(prompt_len, predicted) if ttft else None,
    )
