"""How fresh an answer is: per pod, whether its ingestion is current, and the answer's overall state.

Pure. The input is the fleet view the predictor re-reads every second (``kvpf:ingesters``: each live
ingester's lease says which pods it ingests, whether it is current, behind or stalled, when it was last
current, and each pod's newest applied batch's engine timestamp; ingester/fleet_member.py writes it).

Per pod:

* ``current``: a live ingester ingests it and is caught up (no backlog, no replay under way, Valkey taking
  its writes);
* ``behind``: the ingester has a backlog, a replay of the pod under way, or Valkey failing for less than
  the stall time;
* ``stalled``: the ingester's Valkey writes or its loop have been stuck for the stall time (5 s), or the
  only lease that listed the pod has expired (an ingester that cannot renew its lease cannot write either:
  Valkey out of memory under ``noeviction``, a dead process);
* ``unknown``: no lease lists it (an ingester started with ``--source`` only takes no lease).
* ``approximate``: no ingester feeds it (an engine that publishes no KV events, named to a gateway): what it
  holds is a guess from the requests the gateways sent there (docs/gateway.md); set by the gateway's predictor.

``staleness_ms``: how long ago its ingester was last known current (0-1 s while current), the bound on what
the index may be missing for it; ``index_lag_ms``: now minus the engine timestamp of the pod's newest applied
batch (it grows while the engine is idle, which is not staleness: read it with the state).

The answer's state: ``partial`` when a Valkey Cluster shard did not answer (counts are lower bounds),
``degraded`` (with reasons) when a pod it names is behind, stalled, approximate or flagged incomplete, else
``exact``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import msgspec

from kv_preflight.fleet.records import FleetView, IngesterLease

CURRENT, BEHIND, STALLED, UNKNOWN, APPROXIMATE = "current", "behind", "stalled", "unknown", "approximate"
_RANK = {CURRENT: 0, BEHIND: 1, STALLED: 2, UNKNOWN: 3, APPROXIMATE: 4}


class PodFreshness(msgspec.Struct, frozen=True, omit_defaults=True):
    state: str
    staleness_ms: int | None = None
    index_lag_ms: int | None = None


UNKNOWN_POD = PodFreshness(UNKNOWN)
APPROXIMATE_POD = PodFreshness(APPROXIMATE)
MAX_LISTED = 64  # pods an answer's freshness lists (the ones not current first); its state counts them all


class Freshness(msgspec.Struct, frozen=True, omit_defaults=True):
    state: str  # exact | degraded | partial
    reasons: list[str] = msgspec.field(default_factory=list)
    pods: dict[str, PodFreshness] = msgspec.field(default_factory=dict)
    pods_truncated: bool = False  # more pods than MAX_LISTED were named: the others are current or unknown


def _lease_state(lease: IngesterLease, pod: str, live: bool) -> str:
    if not live:
        return STALLED
    if lease.state == STALLED:
        return STALLED
    if lease.state == BEHIND and (pod in lease.behind or not lease.behind):
        return BEHIND
    if lease.state in (CURRENT, BEHIND):
        return BEHIND if pod in lease.behind else CURRENT
    return UNKNOWN  # an ingester that predates freshness


Listing = dict[str, list[tuple[IngesterLease, bool]]]


def leases_by_pod(view: FleetView) -> Listing:
    """pod -> the leases that list it, each with whether it is live (built once per fleet view read)."""
    listing: Listing = {}
    for lease in view.ingesters.values():
        live = lease.expires_ms > view.now_ms
        for pod in {*lease.pods, *lease.batch_ts}:
            listing.setdefault(pod, []).append((lease, live))
    return listing


def pod_freshness(view: FleetView | None, pods: Iterable[str], now_ms: int, wall_now_s: float,
                  listing: Listing | None = None) -> dict[str, PodFreshness]:
    """Each pod's freshness from the leases (the best account among the ingesters that list it)."""
    out: dict[str, PodFreshness] = {}
    wanted = list(dict.fromkeys(pods))
    if view is None:
        return {p: PodFreshness(UNKNOWN) for p in wanted}
    if listing is None:
        listing = leases_by_pod(view)
    for pod in wanted:
        best: PodFreshness | None = None
        for lease, live in listing.get(pod, ()):
            state = _lease_state(lease, pod, live)
            staleness = max(0, now_ms - lease.current_ms) if lease.current_ms else None
            ts = lease.batch_ts.get(pod)
            lag = max(0, int((wall_now_s - ts) * 1000)) if ts else None
            here = PodFreshness(state, staleness, lag)
            if best is None or (_RANK[state], staleness if staleness is not None else 1 << 62) < \
                    (_RANK[best.state], best.staleness_ms if best.staleness_ms is not None else 1 << 62):
                best = here
        out[pod] = best or PodFreshness(UNKNOWN)
    return out


def answer_freshness(pods: Mapping[str, PodFreshness], *, partial: bool = False, incomplete: Iterable[str] = (),
                     aged: Callable[[PodFreshness], PodFreshness] | None = None) -> Freshness:
    """The answer's state and its reasons, from the freshness of the pods it names."""
    reasons = []
    if partial:
        reasons.append("a Valkey Cluster shard did not answer: counts are lower bounds")
    for state in (STALLED, BEHIND):
        named = sorted(p for p, f in pods.items() if f.state == state)
        if named:
            reasons.append(f"ingestion {state} for {', '.join(named[:10])}{' ...' if len(named) > 10 else ''}")
    guessed = sorted(p for p, f in pods.items() if f.state == APPROXIMATE)
    if guessed:
        reasons.append(f"index approximate for {', '.join(guessed[:10])}{' ...' if len(guessed) > 10 else ''} (no KV "
                       "events: what the gateways sent there)")
    flagged = sorted(set(incomplete))
    if flagged:
        reasons.append(f"index incomplete for {', '.join(flagged[:10])}{' ...' if len(flagged) > 10 else ''}")
    state = "partial" if partial else "degraded" if reasons else "exact"
    listed = pods
    if len(pods) > MAX_LISTED:  # an answer naming a thousand pods lists those that need reading first
        order = sorted(pods, key=lambda p: -_RANK[pods[p].state] if pods[p].state != UNKNOWN else 0)
        listed = {p: pods[p] for p in order[:MAX_LISTED]}
    if aged is not None:
        listed = {p: aged(f) for p, f in listed.items()}
    return Freshness(state=state, reasons=reasons, pods=dict(listed), pods_truncated=len(listed) < len(pods))


def fleet_health(view: FleetView | None) -> list[str]:
    """Why the whole index may be stale (for /health): every ingester stalled, pods behind."""
    if view is None or not view.ingesters:
        return []
    reasons = []
    live = {i: lease for i, lease in view.ingesters.items() if lease.expires_ms > view.now_ms}
    stalled = {i for i, lease in live.items() if lease.state == STALLED}
    if not live:
        reasons.append(f"no live ingester: {len(view.ingesters)} lease(s), all expired (ingestion stalled)")
    elif len(stalled) == len(live):
        reasons.append(f"every ingester stalled ({len(live)})")
    elif stalled:
        reasons.append(f"ingester(s) stalled: {', '.join(sorted(stalled)[:10])}")
    behind = sorted({p for lease in live.values() if lease.state == BEHIND for p in (lease.behind or lease.pods)})
    if behind:
        reasons.append(f"{len(behind)} pod(s) behind")
    return reasons


def stale_for_route(pods: Mapping[str, PodFreshness], max_staleness_ms: int) -> list[str]:
    """The pods an answer relies on whose index may be older than ``max_staleness_ms`` (or not known)."""
    return sorted(p for p, f in pods.items()
                  if f.state != CURRENT or f.staleness_ms is None or f.staleness_ms > max_staleness_ms)
