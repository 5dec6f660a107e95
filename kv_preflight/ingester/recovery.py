"""What to do after the apply script answers: the ingester's recovery rules as a pure function.

The index's seq check (``Index.apply_batch``; the pod step in kv_preflight/index/lua/pod.lua) answers
applied, dup, gap, restart or corrupt. ``Applier.apply`` (ingester/apply.py) carries out the step this
module returns, then tries the batch again in the step's mode, at most MAX_STEPS times per batch. A
gap's replay is fetched in the background while the pod's batches wait; the replayed batches are then
applied one by one before the batch that found the gap (never replaying again): no rule can make it loop,
and there is no recursion.

Rules (vLLM 0.32 numbers a process's batches from seq 0 and sends no incarnation id):
* applied, dup: done.
* restart at seq 0: the new process's first batch: clear the pod and apply it ("reset").
* restart past seq 0: the new process published batches 0..seq-1 that never came here: clear
  the pod unless another ingester moved on meanwhile ("reset_if"), then the batch is a gap from 0.
* gap: replay the missed seqs from the engine's replay socket once; if the replay does not cover
  them (buffer moved on, no replay endpoint, oversized frames dropped), flag the pod incomplete and
  apply past the gap ("force").
* corrupt: never applied (a seq far past the persisted one is forged or garbage; a pod key of a
  foreign type cannot be written): counted and flagged by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass

# More than any chain of rules needs (restart -> reset_if -> gap -> replay -> force -> done).
MAX_STEPS = 8


@dataclass(frozen=True)
class Done:
    status: str


@dataclass(frozen=True)
class Reset:
    """Apply again in "reset" mode: clear the pod first (the engine restarted at seq 0)."""


@dataclass(frozen=True)
class ResetIfThenCheck:
    """Clear the pod if its seq is still ``last_seq``, then apply again as a gap from seq 0."""

    last_seq: int


@dataclass(frozen=True)
class Replay:
    """Fetch seqs ``start`` .. seq-1 from the replay socket, apply them, then this batch."""

    start: int


@dataclass(frozen=True)
class Force:
    """Flag the pod incomplete with ``reason`` and apply past the gap."""

    reason: str


Step = Done | Reset | ResetIfThenCheck | Replay | Force


def next_step(status: str, *, mode: str, seq: int, last_seq: int, can_replay: bool, has_replay: bool) -> Step:
    """The step after the script answered ``status`` to a batch sent in ``mode``."""
    if status in ("applied", "dup", "corrupt"):
        return Done(status)
    if status == "restart":
        if mode == "reset":  # the script answers restart to reset only if it reset: cannot happen twice
            return Done(status)
        return Reset() if seq == 0 else ResetIfThenCheck(last_seq)
    if status == "gap":
        start = last_seq + 1
        if can_replay:
            return Replay(start)
        if has_replay:
            return Force(f"events {start}..{seq - 1} were missed and the engine's replay buffer no longer holds them")
        return Force(f"events {start}..{seq - 1} were missed and no replay endpoint is known")
    return Done(status)


__all__ = ["Done", "Force", "MAX_STEPS", "Replay", "Reset", "ResetIfThenCheck", "Step", "next_step"]
