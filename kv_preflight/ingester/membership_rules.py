"""Fleet membership rules, pure: who owns which engine, when a membership change counts, pod health.

Ingesters coordinate through Valkey alone (ingester/fleet_member.py does the I/O): each renews a lease, reads
the others' leases, and applies the rules below to the same inputs, so they agree on who ingests what
without a coordinator of our own.

* Ownership is rendezvous (highest-random-weight) hashing of (ingester, engine) with bounded loads
  (``balanced_owners``): every ingester ranks the live ingesters per engine the same way, and each engine
  goes to the first ``copies`` of its ranking that still have room, so every live ingester holds
  floor or ceil of engines x copies / ingesters. Plain rendezvous hashing is even only on average: in a
  small fleet it can leave an ingester with no engine at all, idle while the others do its share
  (docs/fleet.md). An ingester joining or leaving still moves about its share, plus
  the few engines whose first choice filled up. Copies are safe because a batch applies exactly once
  whoever sends it (the seq check in kv_preflight/index/lua/seq.lua).
* A membership change (an engine appearing in or vanishing from DNS or a file) takes effect only once
  it has held for ``hold_s``: one bad DNS answer does not retire a pod and re-ingest it a second later.
* A pod is unreachable after ``failures_needed`` failed health checks in a row (ZMQ silence proves
  nothing: an idle engine publishes nothing), and retired once unreachable for ``retire_after_ms``.
* A pod the fleet has a record of but no live lease lists (its ingester left: a one-off ``ingest --pod-id
  endpoint`` run leaves its pods so) is retired once it has been so for ``retire_after_ms`` (``unlisted``):
  nobody ingests it, so its entries only grow older, and every answer holding them is degraded meanwhile.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

from kv_preflight.fleet.records import PodRecord


class EngineSpec(msgspec.Struct, frozen=True, omit_defaults=True):
    """An engine to ingest, as the ingesters share it in their leases.

    ``pod``: the pod id to index it under; "" means the engine's topic names it (``--engine URL``, an
    engine whose topic is its own). Discovered engines (DNS, files without a pod) are named by their
    address, ``HOST:PORT``, as llm-d v0.10 names pods, because replicas often share one static topic."""

    url: str = ""
    pod: str = ""
    origin: str = "engine"  # engine (--engine), dns://..., file://..., registered
    # an engine registered by its ZMQ source instead of a URL (no /kv_event_sources, no health check)
    source: str = ""
    replay: str = ""
    model: str = ""

    @property
    def key(self) -> str:
        """What identifies the engine: its URL, or its source endpoint when it has no URL."""
        return self.url or self.source


def address_pod_id(url: str) -> str:
    """``HOST:PORT`` of an engine URL (IPv6 hosts in brackets), its pod id when discovered."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _weight(member: str, item: str) -> bytes:
    return hashlib.blake2b(f"{member}\x00{item}".encode(), digest_size=8).digest()


def rendezvous_owners(item: str, members: Iterable[str], copies: int) -> list[str]:
    """The ``copies`` members that rank first for ``item``, best first (plain rendezvous hashing: what one
    item alone would get; ``balanced_owners`` splits a whole set of items)."""
    return sorted(members, key=lambda m: (_weight(m, item), m), reverse=True)[:max(1, copies)]


def balanced_owners(items: Iterable[str], members: Iterable[str], copies: int) -> dict[str, list[str]]:
    """Each item's ``copies`` owners, best first (the first is its primary owner): rendezvous hashing with
    bounded loads. The copies are dealt one round at a time, items in sorted order: in round k each item
    goes to its best-ranked member that does not hold it yet and holds fewer than its quota, the quota
    being ``floor(items x k / members)``, or one more for as many members as the division leaves over.
    Late items may find room only in members that already hold them; a last pass evens those out. So
    every member ends with floor or ceil of items x copies / members, and the same inputs give the same
    answer in every ingester, whatever order they come in."""
    names = sorted(set(members))
    keys = sorted(set(items))
    if not names:
        return {k: [] for k in keys}
    want = min(max(1, copies), len(names))
    rankings = {k: rendezvous_owners(k, names, len(names)) for k in keys}
    owners: dict[str, list[str]] = {k: [] for k in keys}
    load = dict.fromkeys(names, 0)
    for round_ in range(1, want + 1):
        base, extra = divmod(len(keys) * round_, len(names))
        extra -= sum(1 for n in load.values() if n > base)  # holding one over already
        for key in keys:
            free = [m for m in rankings[key] if m not in owners[key]]
            pick = next((m for m in free if load[m] < base or (load[m] == base and extra > 0)), free[0])
            if load[pick] >= base:
                extra -= 1
            owners[key].append(pick)
            load[pick] += 1
    # Late items can find room only in members that already hold them: even out by moving, from the most
    # loaded member to the least, the item the latter ranks best among those it does not hold (there is
    # always one: the fuller member holds more items). Each move narrows the spread, so this ends.
    while True:
        most = max(names, key=lambda m: (load[m], m))
        least = min(names, key=lambda m: (load[m], m))
        if load[most] - load[least] <= 1:
            break
        key = min((k for k in keys if most in owners[k] and least not in owners[k]),
                  key=lambda k: (rankings[k].index(least), k))
        owners[key][owners[key].index(most)] = least
        load[most] -= 1
        load[least] += 1
    return {k: sorted(o, key=rankings[k].index) for k, o in owners.items()}


@dataclass
class Debounced:
    """A set that follows observations only once each difference has persisted for ``hold_s``.

    The first observation is taken at once (nothing to protect at start); after that, an item joins or
    leaves when every observation for ``hold_s`` seconds has said so."""

    hold_s: float
    current: frozenset = frozenset()
    started: bool = False
    _since: dict = field(default_factory=dict)  # item -> when observations began to disagree with current

    def observe(self, seen: Iterable, now: float) -> frozenset:
        seen = frozenset(seen)
        if not self.started:
            self.started, self.current = True, seen
            return self.current
        differing = seen ^ self.current
        for item in list(self._since):
            if item not in differing:
                del self._since[item]  # back to agreeing: the clock starts again next time
        flips = set()
        for item in differing:
            first = self._since.setdefault(item, now)
            if now - first >= self.hold_s:
                flips.add(item)
                del self._since[item]
        if flips:
            self.current = self.current ^ flips
        return self.current

    def pending(self) -> frozenset:
        """Items whose change has been seen but has not held long enough yet."""
        return frozenset(self._since)


@dataclass(frozen=True)
class Health:
    """One pod's health as its primary owner tracks it between checks."""

    failures: int = 0  # failed checks in a row


def after_check(record: PodRecord, health: Health, ok: bool, now_ms: int, *, failures_needed: int,
                retire_after_ms: int, detail: str = "") -> tuple[PodRecord, Health]:
    """The pod record and health after one health check of its engine.

    live -> unreachable after ``failures_needed`` failures in a row; unreachable -> retired once the
    first of those failures is ``retire_after_ms`` old; a success makes an unreachable pod live again
    (a retired one comes back through ``returned``, which needs its seq to decide how)."""
    if record.state == "retired":
        return record, health
    if ok:
        if record.state == "unreachable" or record.unreachable_since_ms:
            record = msgspec.structs.replace(record, state="live", since_ms=now_ms, reason="",
                                             unreachable_since_ms=0)
        return record, Health()
    health = Health(failures=health.failures + 1)
    first = record.unreachable_since_ms or now_ms
    if record.state == "live":
        if health.failures < failures_needed:
            return msgspec.structs.replace(record, unreachable_since_ms=first), health
        record = msgspec.structs.replace(
            record, state="unreachable", since_ms=now_ms, unreachable_since_ms=first,
            reason=f"health check failed {health.failures} times in a row" + (f" ({detail})" if detail else ""))
    if record.state == "unreachable" and now_ms - first >= retire_after_ms:
        record = retired(record, now_ms, f"unreachable for {(now_ms - first) / 1000:.0f} s ({record.reason})")
    return record, health


def retired(record: PodRecord, now_ms: int, reason: str) -> PodRecord:
    return msgspec.structs.replace(record, state="retired", since_ms=now_ms, reason=reason[:300])


def expired_retired(records: dict[str, PodRecord], now_ms: int, retention_ms: int) -> list[str]:
    """Retired pods whose registry row has been kept ``retention_ms``: dropped, so names do not pile up."""
    return sorted(p for p, r in records.items() if r.state == "retired" and now_ms - r.since_ms >= retention_ms)


def unlisted(records: dict[str, PodRecord], listed: set[str], since: dict[str, int], now_ms: int,
             retire_after_ms: int) -> tuple[dict[str, int], list[str]]:
    """Pods with a record (not retired) that no live lease lists: (each one's first time seen so, the ones to
    retire: seen so for ``retire_after_ms``). ``since``: the last call's first times (a pod listed again, or
    gone, starts over)."""
    kept = {p: since.get(p, now_ms) for p, r in records.items() if r.state != "retired" and p not in listed}
    return kept, sorted(p for p, at in kept.items() if now_ms - at >= retire_after_ms)
