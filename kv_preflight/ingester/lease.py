"""An ingester's lease in ``kvpf:ingesters`` (``LeaseHolder``, the lease part of ingester/fleet_member.py's
``FleetMember``): what it says (state, pods, sources, the engines this ingester knows), its renewal every second
in a task of its own whatever a round waits for, and ``vouch``, which puts it at once for a new pod's first write.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import msgspec

from kv_preflight.config import Config
from kv_preflight.fleet.records import MAX_LEASE_SOURCES, IngesterLease
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.ingester.membership_rules import EngineSpec

log = logging.getLogger("kvpf.ingester")

LEASE_RENEW_S = 1.0  # the lease is renewed this often, beside the rounds (``renew_forever``)
VOUCH_WAIT_S = 1.0  # how long a new pod's first write waits for a lease listing it (``vouch``) before going on


class LeaseHolder:
    """Mixed into ``FleetMember``, which sets these in its ``__init__`` and puts the lease in each round too."""

    ing: Any  # the ingester (fleet_member.Ingesting): its state, pods, sources, lags for the lease
    cfg: Config
    index: Index
    me: str
    ticks: int
    attached: dict
    known: dict[str, EngineSpec]
    started_ms: int  # Valkey's time of this ingester's first renewal
    current_ms: int  # Valkey's time of the last renewal at which every pod not listed behind was current
    pod_current_ms: dict[str, int]  # pod -> Valkey's time of the last renewal at which it was current
    forget_seen_ms: int  # the newest forget request carried out
    renewed_at: float  # monotonic time of the last lease renewal
    renewer: asyncio.Task | None  # renew_forever's task (start_renewing)
    vouched: set[str]  # pods a lease put by this process listed (or tried to): ``vouch``
    _vouching: asyncio.Future | None  # the lease put a new pod's first write waits for
    active: bool  # FleetMember.active: whether this ingester takes part in membership

    def _lease(self, now_ms: int) -> IngesterLease:
        state, behind = self.ing.ingest_state()
        pods = self.ing.pods()
        late = set(behind)
        # current for every pod it does not list as behind (one engine's stream down leaves the others current,
        # and their staleness a renewal's): ``current_ms`` moves; each pod behind keeps when it last was
        if state == "current" or (state == "behind" and not late.issuperset(pods)):
            self.current_ms = now_ms
            for pod in pods:
                if pod not in late:
                    self.pod_current_ms[pod] = now_ms
        if len(self.pod_current_ms) > 2 * max(len(pods), 64):  # pods let go of: forgotten
            self.pod_current_ms = {p: self.pod_current_ms[p] for p in pods if p in self.pod_current_ms}
        listed = behind[:MAX_LEASE_SOURCES]
        return IngesterLease(
            state=state, current_ms=self.current_ms, pods=pods[:MAX_LEASE_SOURCES], behind=listed,
            behind_since_ms={p: self.pod_current_ms.get(p, 0) for p in listed},
            batch_ts=self.ing.batch_ts(),
            expires_ms=now_ms + int(self.cfg.lease_ttl_s * 1000), started_ms=self.started_ms, renewed_ms=now_ms,
            renew_ms=int(LEASE_RENEW_S * 1000), private=self.cfg.private,
            forget_seen_ms=self.forget_seen_ms, sources=dict(list(self.ing.endpoints().items())[:MAX_LEASE_SOURCES]),
            host=socket.gethostname(), engines=sorted(self.attached), lag_s=self.ing.lag_s(),
            known=[msgspec.to_builtins(s) for s in sorted(self.known.values(), key=lambda s: s.key)])

    async def renew(self) -> None:
        now_ms = await self.index.fleet.now_ms()
        self.started_ms = self.started_ms or now_ms
        await self._put_lease(now_ms)

    async def _put_lease(self, now_ms: int) -> None:
        lease = self._lease(now_ms)
        await self.index.fleet.put_lease(self.me, lease)
        self.renewed_at = time.monotonic()
        self.vouched.update(lease.pods)

    async def vouch(self, pod: str) -> None:
        """Record first: a pod's first write here waits for a lease that lists it (put now, not at the next
        renewal). A predictor weighs only blocks some lease vouches for (an ``unknown`` pod's are not routed by),
        so an engine just attached whose blocks landed before its lease did had its first hits routed as misses
        for up to a renewal. Once per pod and process; a lease put that fails or is slow delays nothing for long
        (``VOUCH_WAIT_S``): the renewals list the pod anyway. The pods past the lease's cap are never listed."""
        if pod in self.vouched:
            return
        if not self.active:  # no lease of ours to list it: not asked again for this pod (a batch's hot path)
            self.vouched.add(pod)
            return
        if self.ticks == 0:  # the first round puts the first lease, listing the pods routed by then
            return
        if self._vouching is None or self._vouching.done():
            self._vouching = asyncio.ensure_future(self.renew())
            self._vouching.add_done_callback(lambda t: t.cancelled() or t.exception())  # a late failure: retrieved
        try:
            await asyncio.wait_for(asyncio.shield(self._vouching), VOUCH_WAIT_S)
        except (*VALKEY_ERRORS, TimeoutError) as exc:
            log.warning("pod %s: its first write goes ahead before a lease lists it (%s)", pod,
                        exc or type(exc).__name__)
        self.vouched.add(pod)

    def start_renewing(self) -> asyncio.Task:
        """``renew_forever`` in a task of its own, which ``close`` ends before it gives the lease back."""
        self.renewer = asyncio.ensure_future(self.renew_forever())
        return self.renewer

    async def renew_forever(self) -> None:
        """The lease, renewed every second in a task of its own: whatever a round is waiting for, the
        others never take this ingester for dead while it lives (nor does a stalled round hide that it
        is alive but slow: the watchdog says so)."""
        while True:
            # due a second after the last renewal, whoever made it (a round renews too): renewals stay a second
            # apart, as the lease says (``renew_ms``), so predictors can take two missed ones for silence
            due = self.renewed_at + LEASE_RENEW_S - time.monotonic()
            if self.ticks == 0 or due > 0:  # the first round puts the first; else the next one is not due yet
                await asyncio.sleep(due if due > 0 else LEASE_RENEW_S)
                continue
            try:
                async with asyncio.timeout(max(1.0, self.cfg.lease_ttl_s / 2)):
                    await self.renew()
            except (*VALKEY_ERRORS, TimeoutError) as exc:
                log.warning("lease not renewed now (%s)", exc or type(exc).__name__)
                await asyncio.sleep(LEASE_RENEW_S / 4)  # tried again soon, never in a loop that spins
