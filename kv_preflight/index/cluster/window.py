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
from collections.abc import Callable

LATE_SHARE = 4  # the window is the takeover time less this share of it: the rest is for the last round to land


class Late(Exception):
    """A run's writer is past its entries' window (``ClusterWrites.send``): the rest is left to a drain."""


def window_end(takeover_ms: int) -> float:
    """The monotonic time after which a batch whose pod step is sent now sends no more of its changes."""
    return time.monotonic() + takeover_ms * (1 - 1 / LATE_SHARE) / 1000


def in_time(until: float | Callable[[], float] | None, round_: str) -> None:
    """Raise ``Late`` once ``until`` is past, before round ``round_`` is sent: a time, or what gives it now (a
    drain's, which its lease's renewals move on: kv_preflight/index/cluster/drain_lease.py); None: no window."""
    end = until() if callable(until) else until
    late = time.monotonic() - end if end is not None else 0.0
    if late > 0:
        raise Late(f"round {round_} would have gone {late * 1000:.0f} ms past the window of the entries' writer "
                   "(another writer may have run them and cleared the pod since)")


__all__ = ["LATE_SHARE", "Late", "in_time", "window_end"]
