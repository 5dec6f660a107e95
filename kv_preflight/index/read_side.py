"""The read side of the index: what a predictor asks of it to answer. Look a chain of request keys up (per
pod, how many leading blocks it holds), read the chain's bits in a hybrid pod's other KV cache groups, and the
pods' metadata an answer carries (models, engine block sizes, flags, seqs).

``Index`` (kv_preflight/index/index.py) is the implementation, over either backend chosen at connect; its
``meta`` (kv_preflight/index/pod_meta.py) the metadata. A caller types against ``ReadSide`` and never asks which
topology it has. tests/integration/test_contract_read_side.py is the bar every implementation clears.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kv_preflight.index.entries import Lookup, PodMatch

if TYPE_CHECKING:
    from kv_preflight.index.pod_meta import PodInfo, ScoringInfo
    from kv_preflight.index.presence import GroupBits


class AnswerMeta(Protocol):
    """The pods' metadata answers carry (kv_preflight/index/pod_meta.py ``PodMeta``)."""

    async def pod_ids(self) -> dict[str, str]:
        """Every pod the registry lists -> its model."""

    async def adapters(self) -> dict[str, dict[str, str]]:
        """Per pod, the LoRA adapters its events stored blocks of -> its model."""

    async def pod_info(self, pod_id: str) -> "PodInfo": ...

    async def pod_infos(self, pod_ids: Sequence[str], chunk: int = 500) -> "list[PodInfo]": ...

    async def scoring_infos(self, pod_ids: Sequence[str], chunk: int = 1000) -> "list[ScoringInfo]":
        """What scoring needs of each pod (its engine block size, groups, flags), in one round per chunk."""

    async def meta_fields(self, pod_ids: Sequence[str], fields: Sequence[str], chunk: int = 1000
                          ) -> list[list[Any] | None]: ...

    async def counters(self) -> dict[str, int]: ...


class ReadSide(Protocol):
    meta: AnswerMeta
    gap_walks: int  # pods a default lookup walked key by key rather than bisected (a counter)
    late_reads: int  # lookups that took a round past the usual ones (a counter; 0 on one node)
    foreign_reads: int  # request keys of a foreign type read as misses (a counter)
    # True where a part of the index (a shard) can fail while the rest answers: go on, the answer says "partial"
    partial_reads: bool

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *,
                     mode: str = "script") -> list[PodMatch]:
        """Per pod holding key 1, how many leading keys of the chain it holds, and its tier there."""

    async def lookup_detailed(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *,
                              mode: str = "script") -> Lookup:
        """``lookup`` with what the answer says beside the matches (``partial``, other KV cache groups' bits)."""

    async def group_presence(self, request_keys: Sequence[int], pods: Iterable[str], *,
                             have: "Sequence[GroupBits] | None" = None) -> "tuple[Sequence[GroupBits], dict[str, int]]":
        """Each key's bitmaps in the KV cache groups other than the prefix group ((tier, group) -> bitmap), and the
        pods' numbers (their bit in each): what a hybrid pod's other groups' rules read. ``have``: the lookup's
        own (``Lookup.group_bits``), used where it covers the keys."""

    async def fields_per_key(self, request_keys: Sequence[int], *, stop_at_gap: bool = True) -> list[list[bytes]]:
        """llm-d's own Lookup: each key's entry fields (trimmed at the first empty key)."""


__all__ = ["AnswerMeta", "ReadSide"]
