"""A writer's window on its outbox entries (Valkey Cluster; kv_preflight/index/cluster/writes.py).

Another writer takes an entry over (runs it, and may then clear the pod) once it is older than the takeover time,
by Valkey's clock from the pod step that wrote it. The entry's own writer therefore sends its changes only well
within that time, counted on its own monotonic clock from before the step (so never less than the entry's age on
Valkey's): stalled past it (a pause, a long GC, a starved machine, a primary's timeout), its changes could land
after another's clearing of the pod, entries and bits the pod's state no longer lists, which no later clear
removes. Past the window it leaves the entries in the outbox, for a drain (docs/durability.md).
"""
from __future__ import annotations

import time
from typing import Protocol

LATE_SHARE = 4  # the window is the takeover time less this share of it: the rest is for the last round to land


class Late(Exception):
    """A run's writer is past its entries' window (``ClusterWrites.send``): the rest is left to a drain."""


def window_end(takeover_ms: int) -> float:
    """The monotonic time after which a batch whose pod step is sent now sends no more of its changes."""
    return time.monotonic() + takeover_ms * (1 - 1 / LATE_SHARE) / 1000


class Renewable(Protocol):
    """A window that can be moved on (a drain's lease: kv_preflight/index/cluster/drain_lease.py)."""

    def end(self) -> float: ...

    async def renewed(self) -> bool: ...


async def in_time(until: float | Renewable | None, round_: str) -> None:
    """Raise ``Late`` once ``until`` is past, before round ``round_`` is sent: a writer's fixed end (its entries' age
    decides when another takes them over), or a drain's lease, renewed on the spot if its end went by (the process
    busy meanwhile: a renewal that succeeds proves nobody else held the lease since); None: no window."""
    if until is None:
        return
    if isinstance(until, float):
        end = until
    else:
        end = until.end()
        if time.monotonic() > end and await until.renewed():
            end = until.end()
    late = time.monotonic() - end
    if late > 0:
        raise Late(f"round {round_} would have gone {late * 1000:.0f} ms past the window of the entries' writer "
                   "(another writer may have run them and cleared the pod since)")


__all__ = ["LATE_SHARE", "Late", "Renewable", "in_time", "window_end"]
