"""How fresh an answer is: per pod, whether its ingestion is current, and the answer's overall state.

Pure. The input is the fleet view the predictor re-reads every second: ``kvpf:ingesters`` (each live
ingester's lease says which pods it ingests, whether it is current, behind or stalled, when it was last
current, when it renewed the lease and how often it renews it, and each pod's newest applied batch's engine
timestamp; ingester/fleet_member.py writes it) and ``kvpf:fleet`` (each pod's record: live, unreachable or
retired, from the health checks of its engine). Every account is judged at a given Valkey time, ``now_ms``,
which a predictor brings forward by its own clock between reads: a lease nobody renews ages, whether its
ingester froze or the predictor can no longer read it.

Per pod:

* ``current``: a live ingester ingests it and is caught up (no backlog, no replay under way, Valkey taking
  its writes) and renews its lease on time;
* ``behind``: the ingester has a backlog, a replay of the pod under way, Valkey failing for less than the stall
  time, or it missed two renewals of its lease (a frozen process, a host that stopped: it says nothing, so
  its last account is not taken as current any longer);
* ``stalled``: the ingester's Valkey writes or its loop have been stuck for the stall time (5 s), or the
  only lease that listed the pod has expired (an ingester that cannot renew its lease cannot write either:
  Valkey out of memory under ``noeviction``, a dead process);
* ``unreachable``: the pod's engine fails its health checks (its fleet record): what the index holds for it
  is the memory of an engine that may be gone (a stopped engine holds nothing);
* ``retired``: the pod's record says retired (its entries are being cleared);
* ``unknown``: no lease lists it: its ingester left (a one-off ``ingest`` run naming pods its own way leaves
  them so, until the fleet retires them), an ingester that takes no lease (``--source``/``--bind`` alone with
  ``--no-registered-engines``), a pod written by ``index import``.
* ``approximate``: no ingester feeds it (an engine that publishes no KV events, named to a gateway): what it
  holds is a guess from the requests the gateways sent there (docs/gateway.md); set by the gateway's predictor.

``staleness_ms``: how long ago its ingester was last known current (0-1 s while current), the bound on what
the index may be missing for it; ``index_lag_ms``: now minus the engine timestamp of the pod's newest applied
batch (it grows while the engine is idle, which is not staleness: read it with the state).

The answer's state: ``partial`` when a Valkey Cluster shard did not answer (counts are lower bounds),
``degraded`` (with reasons) when a pod it names is behind, stalled, approximate or flagged incomplete, when a pod
it names as a holder (cached tokens in the answer) is unreachable, retired or unknown, or when the fleet's records
could not be read (every account is then as old as the last read), else ``exact``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Literal

import msgspec

from kv_preflight.fleet.records import FleetView, IngesterLease
from kv_preflight.index.rank_pods import base_pod

CURRENT, BEHIND, STALLED, UNREACHABLE, RETIRED, UNKNOWN, APPROXIMATE = (
    "current", "behind", "stalled", "unreachable", "retired", "unknown", "approximate")
PodState = Literal["current", "behind", "stalled", "unreachable", "retired", "unknown", "approximate"]
_RANK = {CURRENT: 0, BEHIND: 1, STALLED: 2, UNKNOWN: 3, APPROXIMATE: 4}  # among the leases listing a pod, the best wins
_LIST_FIRST = {UNREACHABLE: 4, RETIRED: 4, STALLED: 3, BEHIND: 2, APPROXIMATE: 2}  # what a truncated listing keeps first
# What an answer cannot vouch for when it names such a pod as a holder: the pod's blocks may not be the engine's.
_HOLDER_REASONS = {UNREACHABLE: "engine unreachable for {} (its health checks fail: what the index holds for it "
                                "may be gone)",
                   RETIRED: "pod retired: {}",
                   UNKNOWN: "ingestion unknown for {} (no ingester's lease covers it)"}
MISSED_RENEWALS = 2  # a lease that missed this many renewals no longer says its pods are current
DEFAULT_RENEW_MS = 1000  # the renewal interval of an ingester whose lease does not say it (one that predates it)


class PodFreshness(msgspec.Struct, frozen=True, omit_defaults=True):
    state: PodState
    staleness_ms: int | None = None
    index_lag_ms: int | None = None


UNKNOWN_POD = PodFreshness(UNKNOWN)
APPROXIMATE_POD = PodFreshness(APPROXIMATE)
MAX_LISTED = 64  # pods an answer's freshness lists (the ones not current first); its state counts them all


class Freshness(msgspec.Struct, frozen=True, omit_defaults=True):
    state: Literal["exact", "degraded", "partial"]
    reasons: list[str] = msgspec.field(default_factory=list)
    pods: dict[str, PodFreshness] = msgspec.field(default_factory=dict)
    pods_truncated: bool = False  # more pods than MAX_LISTED were named: the others are current or unknown


def late_after_ms(lease: IngesterLease) -> int:
    """How old a lease's renewal may get before its account stops counting as current: two renewals missed,
    and half an interval more for the one under way (a Valkey round trip, a busy event loop)."""
    return int((MISSED_RENEWALS + 0.5) * (lease.renew_ms or DEFAULT_RENEW_MS))


def is_late(lease: IngesterLease, now_ms: int) -> bool:
    """Whether the lease's ingester missed two renewals by ``now_ms`` (a lease without ``renewed_ms``: never)."""
    return bool(lease.renewed_ms) and now_ms - lease.renewed_ms > late_after_ms(lease)


def _lease_state(lease: IngesterLease, pod: str, now_ms: int) -> str:
    if lease.expires_ms <= now_ms or lease.state == STALLED:
        return STALLED
    if lease.state not in (CURRENT, BEHIND):
        return UNKNOWN  # an ingester that predates freshness
    if pod in lease.behind or (lease.state == BEHIND and not lease.behind):
        return BEHIND
    return BEHIND if is_late(lease, now_ms) else CURRENT


def _current_since(lease: IngesterLease, pod: str) -> int:
    """The Valkey time the lease last said ``pod`` was current (0: not known): its own for a pod it lists behind,
    else the lease's (the last renewal at which every pod it does not list behind was current)."""
    if lease.behind_since_ms is not None and pod in lease.behind:
        return lease.behind_since_ms.get(pod, 0)
    return lease.current_ms


Listing = dict[str, list[IngesterLease]]


def leases_by_pod(view: FleetView) -> Listing:
    """pod -> the leases that list it (built once per fleet view read)."""
    listing: Listing = {}
    for lease in view.ingesters.values():
        for pod in {*lease.pods, *lease.batch_ts}:
            listing.setdefault(pod, []).append(lease)
    return listing


def accounted_pods(view: FleetView, listing: Listing) -> list[str]:
    """Every pod the view says something of: listed by a lease, or a record that is not live."""
    return list(dict.fromkeys([*listing, *(p for p, r in view.pods.items() if r.state != "live")]))


def next_turn_ms(view: FleetView, now_ms: int) -> int | None:
    """The first Valkey time after ``now_ms`` at which a lease's account turns (late, then expired): until then
    the pods' states computed at ``now_ms`` hold, only their staleness grows."""
    turns = [t for lease in view.ingesters.values()
             for t in ((lease.renewed_ms + late_after_ms(lease) + 1) if lease.renewed_ms else 0, lease.expires_ms)
             if t > now_ms]
    return min(turns, default=None)


def pod_freshness(view: FleetView | None, pods: Iterable[str], now_ms: int, wall_now_s: float,
                  listing: Listing | None = None) -> dict[str, PodFreshness]:
    """Each pod's freshness at Valkey time ``now_ms``: the best account among the leases that list it, unless
    its record says its engine is unreachable or the pod retired."""
    out: dict[str, PodFreshness] = {}
    wanted = list(dict.fromkeys(pods))
    if view is None:
        return {p: PodFreshness(UNKNOWN) for p in wanted}
    if listing is None:
        listing = leases_by_pod(view)
    for pod in wanted:
        best: PodFreshness | None = None
        newest = 0.0  # the newest batch any ingester of the pod applied: a copy's duplicate is not applied again
        for lease in listing.get(pod, ()):
            state = _lease_state(lease, pod, now_ms)
            since = _current_since(lease, pod)
            staleness = max(0, now_ms - since) if since else None
            newest = max(newest, lease.batch_ts.get(pod) or 0.0)
            here = PodFreshness(state, staleness)
            if best is None or (_RANK[state], staleness if staleness is not None else 1 << 62) < \
                    (_RANK[best.state], best.staleness_ms if best.staleness_ms is not None else 1 << 62):
                best = here
        fresh = best or UNKNOWN_POD
        if best is not None and newest:
            fresh = PodFreshness(best.state, best.staleness_ms, max(0, int((wall_now_s - newest) * 1000)))
        record = view.pods.get(base_pod(pod))  # a data-parallel rank's record is its pod's
        if record is not None and record.state in (UNREACHABLE, RETIRED):  # an engine down is never current
            fresh = PodFreshness(record.state, fresh.staleness_ms, fresh.index_lag_ms)
        out[pod] = fresh
    return out


def _names(pods: list[str]) -> str:
    return f"{', '.join(pods[:10])}{' ...' if len(pods) > 10 else ''}"


def answer_freshness(pods: Mapping[str, PodFreshness], *, partial: bool = False, incomplete: Iterable[str] = (),
                     holders: Iterable[str] = (), fleet_problem: str | None = None,
                     aged: Callable[[PodFreshness], PodFreshness] | None = None) -> Freshness:
    """The answer's state and its reasons, from the freshness of the pods it names; ``holders``: the pods it
    names with cached tokens (an unreachable, retired or unknown pod degrades the answer only as one of
    those: one that holds nothing of the prompt misleads nobody); ``fleet_problem``: why the fleet's records
    behind every pod's account could not be read lately (None: they were)."""
    reasons = []
    if partial:
        reasons.append("a Valkey Cluster shard did not answer: counts are lower bounds")
    if fleet_problem:
        reasons.append(fleet_problem)
    for state in (STALLED, BEHIND):
        named = sorted(p for p, f in pods.items() if f.state == state)
        if named:
            reasons.append(f"ingestion {state} for {_names(named)}")
    guessed = sorted(p for p, f in pods.items() if f.state == APPROXIMATE)
    if guessed:
        reasons.append(f"index approximate for {_names(guessed)} (no KV events: what the gateways sent there)")
    held = set(holders)
    for state, why in _HOLDER_REASONS.items():
        named = sorted(p for p in held if (f := pods.get(p)) is not None and f.state == state)
        if named:
            reasons.append(why.format(_names(named)))
    flagged = sorted(set(incomplete))
    if flagged:
        reasons.append(f"index incomplete for {_names(flagged)}")
    state = "partial" if partial else "degraded" if reasons else "exact"
    listed = pods
    if len(pods) > MAX_LISTED:  # an answer naming a thousand pods lists those that need reading first
        order = sorted(pods, key=lambda p: -_LIST_FIRST.get(pods[p].state, 0) - (p in held))
        listed = {p: pods[p] for p in order[:MAX_LISTED]}
    if aged is not None:
        listed = {p: aged(f) for p, f in listed.items()}
    return Freshness(state=state, reasons=reasons, pods=dict(listed), pods_truncated=len(listed) < len(pods))


def fleet_health(view: FleetView | None, now_ms: int | None = None) -> list[str]:
    """Why the whole index may be stale, or a model unservable, at Valkey time ``now_ms`` (the view's own time
    when None), for /health: every ingester stalled or silent, pods behind, a model with no live pod."""
    if view is None:
        return []
    now_ms = view.now_ms if now_ms is None else now_ms
    reasons = []
    if view.ingesters:
        live = {i: lease for i, lease in view.ingesters.items() if lease.expires_ms > now_ms}
        stalled = {i for i, lease in live.items() if lease.state == STALLED}
        late = sorted(i for i, lease in live.items() if i not in stalled and is_late(lease, now_ms))
        if not live:
            reasons.append(f"no live ingester: {len(view.ingesters)} lease(s), all expired (ingestion stalled)")
        elif len(stalled) == len(live):
            reasons.append(f"every ingester stalled ({len(live)})")
        elif stalled:
            reasons.append(f"ingester(s) stalled: {_names(sorted(stalled))}")
        if late:
            reasons.append(f"ingester(s) silent, {MISSED_RENEWALS} lease renewals missed: {_names(late)}")
        down = {p for p, r in view.pods.items() if r.state in (UNREACHABLE, RETIRED)}  # said as such, not "behind"
        behind = sorted({p for lease in live.values() if lease.state == BEHIND
                         for p in (lease.behind or lease.pods) if base_pod(p) not in down})
        if behind:
            reasons.append(f"{len(behind)} pod(s) behind")
    served: dict[str, list[str]] = {}  # model -> its pods that are not retired
    for pod, record in sorted(view.pods.items()):
        if record.state != RETIRED:
            for model in record.models:
                served.setdefault(model, []).append(pod)
    down = sorted(m for m, ps in served.items() if all(view.pods[p].state == UNREACHABLE for p in ps))
    if down:
        reasons.append(f"no live pod for model(s) {_names(down)}: every pod serving them is unreachable")
    return reasons


def stale_for_route(pods: Mapping[str, PodFreshness], max_staleness_ms: int) -> list[str]:
    """The pods an answer relies on whose index may be older than ``max_staleness_ms`` (or not known)."""
    return sorted(p for p, f in pods.items()
                  if f.state != CURRENT or f.staleness_ms is None or f.staleness_ms > max_staleness_ms)


def untrusted(pods: Mapping[str, PodFreshness]) -> set[str]:
    """Pods whose blocks a route must not weigh: no ingester vouches for them (``unknown``), or their engine is
    unreachable or the pod retired (a route never sends there anyway)."""
    return {p for p, f in pods.items() if f.state in (UNKNOWN, UNREACHABLE, RETIRED)}
