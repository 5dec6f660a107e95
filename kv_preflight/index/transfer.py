"""A pod's blocks out of the index and back in (``kv-preflight index export`` and ``import``): read from
the pod's state log (kv_preflight/index/pod_state.py) by a reader of its own, so what a writer holds in
memory never stands in for what Valkey holds; written back through the write side's ``apply_batch``.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index.entries import StoreBlock
from kv_preflight.index.layout import pod_meta_key
from kv_preflight.index.write_side import WriteSide
from kv_preflight.index.writer import PodWriter


async def _read_pod(writer: PodWriter, pod_id: str) -> PodWriter:
    """A fresh reader, loaded with the pod: planning as ``writer`` plans (its client, topology and
    reannouncements), but not ``writer`` itself."""
    reader = PodWriter(writer.client, cluster=writer.cluster, reannouncements=writer.reannouncements)
    await reader.load([pod_id])
    return reader


async def held_blocks(writer: PodWriter, pod_id: str) -> dict[tuple[int, str, int], tuple[tuple[int, ...], int]]:
    """A pod's blocks as its state log says: (engine key, tier, group) -> (request keys, physical copies)."""
    reader = await _read_pod(writer, pod_id)
    return {k: (b.rks, b.copies) for k, b in reader.pods[pod_id].state.blocks.items()}


async def export_blocks(writer: PodWriter, pod_id: str) -> AsyncIterator[StoreBlock]:
    """Yield every StoreBlock a pod holds (once per physical copy), from its state log."""
    reader = await _read_pod(writer, pod_id)
    for block in reader.pods[pod_id].state.stores():
        yield block


async def pod_groups(writer: PodWriter, pod_id: str) -> dict[int, GroupSpec]:
    """A pod's KV cache groups as its state log says (learned from its events, kept with its state)."""
    reader = await _read_pod(writer, pod_id)
    return dict(reader.pods[pod_id].state.groups)


def groups_row(groups: Mapping[int, GroupSpec]) -> dict[str, list[Any]]:
    """Groups as an export writes them: {"<group>": [kind, block size, window, chunk, eagle]}, the pod meta's
    "groups" form (kv_preflight/index/pod_meta.py ``groups_from`` reads it)."""
    return {str(g): [s.kind, s.block_size, s.sliding_window, s.attention_chunk_size, s.eagle]
            for g, s in sorted(groups.items())}


def groups_of_row(raw: Any) -> dict[int, GroupSpec]:
    """An export's groups back as specs; ValueError for anything ``groups_row`` does not write."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError("groups must map group numbers to [kind, block size, window, chunk, eagle]")
    out = {}
    for g, v in raw.items():
        if not str(g).isdigit() or not isinstance(v, list) or len(v) != 5 or not isinstance(v[0], str) \
                or not all(x is None or (isinstance(x, int) and not isinstance(x, bool) and x > 0) for x in v[1:4]) \
                or not isinstance(v[4], bool):
            raise ValueError(f"group {g!r}: {v!r} is not [kind, block size, window, chunk, eagle]")
        out[int(g)] = GroupSpec(*v)
    return out


async def import_blocks(index: WriteSide, pod_id: str, model: str, engine_block_size: int | None,
                        stores: Sequence[StoreBlock], groups: Mapping[int, GroupSpec] | None = None) -> None:
    """Write exported entries back, with the pod's KV cache groups (without them a hybrid pod would be scored
    as a plain one until its next BlockStored named them); the pod's seq is left alone (the next live batch
    decides)."""
    await index.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model=model,
                            engine_block_size=engine_block_size, mutations=stores, mode="import",
                            groups=groups or None)


async def restore_seqs(client, pod_id: str, seqs: dict[str, int]) -> None:
    """Set a pod's persisted seqs (index import): the next live batch is then judged against them."""
    if seqs:
        await client.hset(pod_meta_key(pod_id), mapping={f"seq:{r}": int(v) for r, v in seqs.items()})


__all__ = ["export_blocks", "groups_of_row", "groups_row", "held_blocks", "import_blocks", "pod_groups",
           "restore_seqs"]
