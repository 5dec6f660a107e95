"""Data-parallel ranks in answers: the index names a rank ``<pod>@dp<r>`` (kv_preflight/index/rank_pods.py); an
answer names the pod and the rank. Pure.

Each rank of a data-parallel engine has its own prefix cache, so each is a candidate of its own: one
``pod_affinities`` entry per rank with ``dp_rank``, ``best_pod`` with ``best_dp_rank``, a route decision with
``dp_rank`` and the header that pins it. A pod without ranks gets no ``dp_rank`` field (``dp_pods``: the pods
known to have ranks, so rank 0 of one shows ``dp_rank: 0`` even when rank 0 alone holds the prompt).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable

import msgspec

from kv_preflight.index.rank_pods import RANK_SEPARATOR, base_pod, split_rank_pod
from kv_preflight.predictor.scoring.route import RouteCandidate, RouteDecision
from kv_preflight.predictor.scoring.score import Prediction

DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM 0.32 (entrypoints/openai/*/serving.py): pins a request's rank


def dp_pods_of(names: Iterable[str]) -> frozenset[str]:
    """The pods among index pod names that have data-parallel ranks (a ``<pod>@dp<r>`` is listed)."""
    return frozenset(base_pod(n) for n in names if RANK_SEPARATOR in n)


def rank_of(name: str, dp_pods: Collection[str]) -> tuple[str, int | None]:
    """(pod, rank) of an index pod; rank None for a pod without ranks."""
    pod, rank = split_rank_pod(name)
    return pod, (rank if rank or pod in dp_pods else None)


def with_ranks(prediction: Prediction, dp_pods: Collection[str]) -> Prediction:
    """The prediction with each index pod named as its pod and rank (no change when no pod has ranks)."""
    ranked = dp_pods_of(a.pod_id for a in prediction.pod_affinities)
    if not dp_pods and not ranked:
        return prediction
    dp_pods = {*dp_pods, *ranked}  # a rank in the answer says its pod has ranks, whatever was read before
    affinities = []
    for a in prediction.pod_affinities:
        pod, rank = rank_of(a.pod_id, dp_pods)
        affinities.append(a if rank is None else msgspec.structs.replace(a, pod_id=pod, dp_rank=rank))
    best, best_rank = (rank_of(prediction.best_pod, dp_pods) if prediction.best_pod else (None, None))
    return msgspec.structs.replace(prediction, pod_affinities=affinities, best_pod=best, best_dp_rank=best_rank)


def decision_with_ranks(decision: RouteDecision, dp_pods: Collection[str]) -> RouteDecision:
    """The decision with the chosen pod's rank and the header that pins a request to it."""
    ranked = dp_pods_of(c.pod_id for c in decision.candidates)
    if not dp_pods and not ranked:
        return decision
    dp_pods = {*dp_pods, *ranked}
    candidates: list[RouteCandidate] = []
    for c in decision.candidates:
        pod, rank = rank_of(c.pod_id, dp_pods)
        candidates.append(c if rank is None else msgspec.structs.replace(c, pod_id=pod, dp_rank=rank))
    pod, rank = rank_of(decision.pod_id, dp_pods) if decision.pod_id else (None, None)
    best, best_rank = rank_of(decision.best_overlap_pod, dp_pods) if decision.best_overlap_pod else (None, None)
    return msgspec.structs.replace(
        decision, pod_id=pod, dp_rank=rank, best_overlap_pod=best, best_overlap_dp_rank=best_rank,
        candidates=candidates, headers={DP_RANK_HEADER: str(rank)} if rank is not None else None)


__all__ = ["DP_RANK_HEADER", "decision_with_ranks", "dp_pods_of", "rank_of", "with_ranks"]
