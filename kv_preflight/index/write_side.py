"""The write side of the index: what an ingester (or the CLI's clear and import) asks of it. Apply a batch,
clear a pod, forget what this process remembers of one, finish what a stopped writer left half applied.

``Index`` (kv_preflight/index/index.py) is the implementation, over either backend chosen at connect
(kv_preflight/index/single.py, kv_preflight/index/cluster/): a caller types against ``WriteSide`` and never asks
which it has. tests/integration/test_contract_write_side.py is the bar every implementation clears.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index.entries import ApplyResult, Carry, Mutation

if TYPE_CHECKING:
    from kv_preflight.index.pod_meta import PodInfo
    from kv_preflight.index.pod_state import PodState


class PodFlags(Protocol):
    """What a writer reads and flags of a pod's meta (kv_preflight/index/pod_meta.py ``PodMeta``)."""

    async def pod_info(self, pod_id: str) -> "PodInfo":
        """The pod's seqs, flags and counters as Valkey holds them."""

    async def mark_incomplete(self, pod_id: str, reason: str, *, unless_rebuilt_in: str = "") -> bool:
        """Flag the pod: answers naming it say its history is not whole, and why."""

    async def mark_complete(self, pod_id: str, *, rebuilt_in: str = "") -> None: ...

    async def count(self, name: str, n: int = 1, *, pod_id: str | None = None) -> None: ...


class WriteSide(Protocol):
    meta: PodFlags

    def write_counts(self) -> dict[str, int]:
        """The write path's counters for /metrics (``Index.write_counts``)."""

    def entry_field(self, pod_id: str, medium: str | None, group_idx: int | None) -> str:
        """llm-d's entry field (PodEntry) for a pod, tier and KV cache group: what a StoreBlock carries."""

    async def apply_batch(self, *, pod_id: str, rank: int, seq: int, ts: float, model: str,
                          engine_block_size: int | None, mutations: Sequence[Mutation], mode: str = "check",
                          groups: Mapping[int, GroupSpec] | None = None, adapters: Iterable[str] = (),
                          carries: Mapping[int, Carry] | None = None) -> ApplyResult:
        """One engine batch, checked against the pod's persisted seq (docs/architecture.md, "Write semantics"):
        ``applied``, ``dup``, ``gap``, ``restart`` or ``corrupt``; applied whole or not at all. ``carries``: what
        its stored blocks left unkeyed (``PodState.carries``), persisted with them for their children."""

    async def apply_batches(self, batches: Sequence[dict[str, Any]]) -> list[ApplyResult]:
        """Several ``apply_batch`` calls (same keyword arguments each), in order, in one round trip."""

    async def send_batches(self, batches: Sequence[dict[str, Any]]) -> "asyncio.Future[list[ApplyResult]]":
        """``apply_batches`` in two steps: sent now, the results from the future."""

    async def pod_state(self, pod_id: str) -> "PodState":
        """The pod's state as this process plans its batches against it (loaded from its log if it is not): the
        blocks the pod holds, their request keys and carries, which the ingester's bridge chains a child's keys
        from."""

    async def reset_if_seq(self, pod_id: str, rank: int, expected_last: int, *, flag: str | None = None) -> bool:
        """Clear a restarted engine's pod unless its seq moved on since ``expected_last``; True if it did. ``flag``:
        the pod stays flagged incomplete with this reason, in the same step."""

    async def clear_pod(self, pod_id: str, *, forget: bool = False) -> int:
        """Every entry of the pod gone (``forget``: its meta, number and registry row too); blocks removed."""

    async def reset_pod(self, pod_id: str) -> int:
        """The pod as a new engine starts it: cleared, seqs dropped, not incomplete; blocks removed."""

    def forget_cached(self, pods: Iterable[str] | None = None) -> None:
        """Drop what this process remembers of these pods (None: every pod); read again from Valkey."""

    async def drain_outbox(self, pod_id: str, *, stale_only: bool = False) -> int:
        """Run what a stopped writer left of a pod's batch (0 where a batch is never left half applied)."""

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        """``drain_outbox(stale_only=True)`` of each pod side by side: entries run, or the Valkey error."""


__all__ = ["PodFlags", "WriteSide"]
