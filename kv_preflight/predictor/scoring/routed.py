"""What was routed, merged into what the index says: pure.

A pod holds, for a prompt, the longest of: its prefix in the index (the engine's events), its speculative
prefix (a prompt sent there moments ago, whose events have not landed: kv_preflight/index/routed.py), and for
an engine that publishes no events its approximate prefix (what the gateways sent there, to its KV capacity).
An answer says how many of a pod's blocks stood on routing alone (``speculative_blocks``): those beyond its
prefix in the index; an approximate pod's freshness says ``approximate`` instead (predictor/scoring/freshness.py).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import msgspec

from kv_preflight.index.entries import DEFAULT_TIER, PodMatch
from kv_preflight.index.routed import PodRouted
from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.score import Prediction


def with_routed(matches: Sequence[PodMatch], routed: Mapping[str, PodRouted], *, approximate: Collection[str] = (),
                skip: Collection[str] = ()) -> tuple[list[PodMatch], dict[str, int]]:
    """(the matches, each pod's prefix the longest of index, speculative and, for the ``approximate`` pods,
    approximate; per pod, the blocks beyond its index prefix that stood on speculative entries). ``skip``: pods
    whose match is the index's alone (a hybrid model's, whose groups' rules the index's bits decide)."""
    out: list[PodMatch] = []
    speculative: dict[str, int] = {}
    seen = set()
    for m in matches:
        seen.add(m.pod_id)
        r = routed.get(m.pod_id)
        if r is None or m.pod_id in skip:
            out.append(m)
            continue
        longest = max(r.speculative, r.approximate if m.pod_id in approximate else 0)
        if longest > m.blocks:
            if r.speculative > m.blocks:
                speculative[m.pod_id] = r.speculative - m.blocks
            out.append(PodMatch(m.pod_id, longest, m.tier))
        else:
            out.append(m)
    for pod, r in routed.items():
        if pod in seen or pod in skip:
            continue
        longest = max(r.speculative, r.approximate if pod in approximate else 0)
        if longest > 0:
            if r.speculative > 0:
                speculative[pod] = r.speculative
            out.append(PodMatch(pod, longest, DEFAULT_TIER))
    return out, speculative


def mark_speculative(prediction: Prediction, speculative: Mapping[str, int]) -> Prediction:
    """Each affinity's ``speculative_blocks``: of its cached blocks, those that stood on speculative entries."""
    if not speculative:
        return prediction
    affinities = [msgspec.structs.replace(a, speculative_blocks=min(speculative[a.pod_id], a.cached_blocks))
                  if a.pod_id in speculative else a for a in prediction.pod_affinities]
    return msgspec.structs.replace(prediction, pod_affinities=affinities)


def load_now(scraped: PodLoad, booked_then: int, booked_now: int) -> PodLoad:
    """A pod's scraped load as it stands now, by the gateways' bookings: ``booked_then`` requests were in flight
    there through the gateways when the engine was scraped, ``booked_now`` are now. What the scrape counted beyond
    them (other clients' requests) is taken to be there still; of the gateways' requests it counted, those that
    ended since are not: a burst that has ended would read for a scrape interval or two as a queue, and move its
    tenant's next requests off the pod holding their prefix. Only ever lowers the scrape, waiting first (an ended
    request lets a waiting one run); what grew since is the bookings' to say (route.py counts a pod's load as at
    least its booked requests)."""
    counted = scraped.running + scraped.waiting
    gone = counted - (booked_now + max(0.0, counted - booked_then))
    if gone <= 0:
        return scraped
    return PodLoad(running=max(0.0, scraped.running - max(0.0, gone - scraped.waiting)),
                   waiting=max(0.0, scraped.waiting - gone), kv_usage=scraped.kv_usage, at=scraped.at)
