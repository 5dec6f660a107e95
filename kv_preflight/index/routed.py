"""The Valkey commands of what routing knows from the requests it sent (docs/gateway.md): gateways write these
keys, and every gateway reads them beside its lookup. The ingester never touches them, and they never touch
llm-d's keys or the presence bits (the index's write path is the ingester's alone).

Per pod, in the pod's slot (``{<pod>}``: each script runs on one shard of a Valkey Cluster as on one node):

* **bookings** (``lua/booked.lua``): the requests in flight there and their cost in tokens. A gateway books a
  request when it forwards it, renews its bookings while they run, releases each when it ends; a gateway that
  dies leaves bookings that expire after their TTL. Every operation drops the expired ones first, so the
  totals ``(n, tokens)`` are those of live bookings.

Key names come from kv_preflight/index/layout.py; the scripts from kv_preflight/index/lua/.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import msgspec

from kv_preflight.index import scripts
from kv_preflight.index.backend import evalsha_pipeline
from kv_preflight.index.layout import pod_booking_keys


class Booked(msgspec.Struct, frozen=True):
    """A pod's live bookings: requests in flight there through the gateways, and their summed cost in tokens."""

    requests: int = 0
    tokens: int = 0


class RoutedStore:
    def __init__(self, client):
        self.client = client
        self._booked = client.register_script(scripts.BOOKED)

    async def _booked_calls(self, calls: Sequence[tuple[str, Sequence[object]]]) -> list[Booked]:
        """One script call per (pod, arguments), pipelined (a cluster client sends each to its pod's shard)."""
        if not calls:
            return []
        replies = await evalsha_pipeline(self.client, self._booked, [pod_booking_keys(p) for p, _ in calls],
                                         [a for _, a in calls])
        return [Booked(int(n), int(tokens)) for n, tokens in replies]

    async def book(self, pod: str, booking: str, tokens: int, ttl_ms: int) -> Booked:
        return (await self._booked_calls([(pod, ("book", booking, max(0, int(tokens)), int(ttl_ms)))]))[0]

    async def renew(self, bookings: Mapping[str, Iterable[str]], ttl_ms: int) -> None:
        """Move the expiry of these bookings (pod -> booking ids) to now + ``ttl_ms``: they still run."""
        calls = [(pod, ("renew", int(ttl_ms), *ids)) for pod, ids in bookings.items() if ids]
        await self._booked_calls(calls)

    async def release(self, pod: str, booking: str) -> Booked:
        return (await self._booked_calls([(pod, ("release", booking))]))[0]

    async def booked(self, pods: Iterable[str]) -> dict[str, Booked]:
        """Each pod's live bookings, in one round trip (per shard on a cluster)."""
        pods = list(dict.fromkeys(pods))
        return dict(zip(pods, await self._booked_calls([(p, ("read",)) for p in pods])))
