"""One way a pod leaves the index, whoever removes it (``/unregister``, ``index clear --forget``, an
ingester retiring it or dropping it after its retention): every ingester is asked to let it go first
(``kvpf:forget``), and its keys go once every live lease says it has, so no batch in flight can bring back
a pod that no listing shows.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_preflight.index.rank_pods import base_pod, pods_with_ranks
from kv_preflight.index.transfer import held_blocks

if TYPE_CHECKING:
    from kv_preflight.index.index import Index

log = logging.getLogger("kvpf.fleet")

LET_GO_WAIT_S = 10.0  # how long a forget waits for the live ingesters to let the pods go (two lease TTLs)
FORGET_RETENTION_MS = 3_600_000  # a forget request is kept this long (a pod registered anew drops it at once)


async def let_go_everywhere(index: "Index", pods: Sequence[str]) -> list[str]:
    """Ask every ingester to let these pods go and wait (bounded) until every live one has; returns the
    ingesters that had not when the wait ended (they refuse the pods' frames as soon as they look)."""
    asked = await index.fleet.forget_pods(pods)
    deadline = time.monotonic() + LET_GO_WAIT_S
    while True:
        view = await index.fleet.fleet_view()
        behind = sorted(i for i, lease in view.live_ingesters().items() if lease.forget_seen_ms < asked)
        if not behind or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.1)
    if behind:
        log.warning("pods %s: ingester(s) %s did not confirm letting them go within %.0f s; clearing anyway (they "
                    "refuse the pods' frames once they look)", list(pods), behind, LET_GO_WAIT_S)
    stale = [p for p, at in (await index.fleet.forgotten()).items() if at < asked - FORGET_RETENTION_MS]
    await index.fleet.unforget_pods(stale)
    return behind


async def readable(index: "Index", pods: Sequence[str]) -> None:
    """Every pod's state log read before any pod is let go: ``PodLogError`` for one that does not read, whose
    entries cannot be found to clear. Let go first, it stayed refused by every ingester (``kvpf:forget``) when
    its clear failed."""
    for pod in pods:
        await held_blocks(index.writer, pod)


async def forget_pods(index: "Index", pods: Sequence[str], *, keep_refusing: bool) -> dict[str, int]:
    """Let the pods go everywhere, then clear their entries and drop their metadata, registry row, record
    and number: pod -> blocks removed. ``keep_refusing``: the ingesters go on refusing the pods' frames (an
    unregistered worker that still publishes) until they are registered anew; else (``index clear
    --forget``) a pod whose engine still publishes comes back as a new pod, listed like any other."""
    pods = pods_with_ranks(pods, await index.meta.pod_ids())  # a data-parallel pod with its ranks' pods
    await readable(index, pods)
    await let_go_everywhere(index, pods)
    removed = {pod: await index.clear_pod(pod, forget=True) for pod in pods}
    await index.fleet.drop_pod_records(pods)
    if not keep_refusing:
        await index.fleet.unforget_pods(pods)
    return removed


async def retire_pods(index: "Index", reasons: dict[str, str]) -> dict[str, int]:
    """Retire pods (their engine left discovery, or stayed unreachable): let go everywhere, then their entries
    cleared and the pods flagged, as a forget does it, so a copy's batch in flight cannot write entries back
    behind the clear. Their metadata, number and record stay (a retired pod may return, and is listed until
    its retention ends), and the ingesters may take their engines again at once (a still-known engine is
    attached anew, which is how its return is seen): pod -> blocks removed."""
    ranks = pods_with_ranks(reasons, await index.meta.pod_ids())  # a data-parallel pod with its ranks' pods
    reasons = {pod: reasons.get(pod) or reasons[base_pod(pod)] for pod in ranks}
    pods = sorted(reasons)
    for pod in pods:
        await flag_retired(index, pod, reasons[pod])
    await readable(index, pods)
    await let_go_everywhere(index, pods)
    removed = {pod: await index.clear_pod(pod) for pod in pods}
    await index.fleet.unforget_pods(pods)
    return removed


async def flag_retired(index: "Index", pod: str, reason: str) -> None:
    """A retiring pod is flagged first, before the wait for every ingester and the clear: an answer in between
    counts what it still holds, flagged; and a return without a full replay stays honest."""
    await index.meta.mark_incomplete(pod, f"retired: {reason}"[:300])
