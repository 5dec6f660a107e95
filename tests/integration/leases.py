"""A lease that vouches for pods a test writes in-process, as a fleet ingester's lease does for the pods it
ingests: a pod no lease covers reads ``unknown``, which degrades every answer that holds it and keeps routes from
weighing its blocks (issue 40). Tests about routing or scoring put one; tests about freshness say what they need."""
from __future__ import annotations

from kv_preflight.fleet.records import IngesterLease
from kv_preflight.index.index import Index

HOUR_MS = 3_600_000


async def vouch(ix: Index, *pods: str, ingester: str = "test-ingester") -> None:
    """A live, current ingester ingests ``pods`` for the next hour (its lease says no renewal interval, so no
    missed renewal makes it late: the test stands in for it)."""
    now = await ix.fleet.now_ms()
    await ix.fleet.put_lease(ingester, IngesterLease(expires_ms=now + HOUR_MS, state="current", current_ms=now,
                                                     pods=sorted(pods)))
