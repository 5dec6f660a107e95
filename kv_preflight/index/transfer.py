"""A pod's blocks out of the index and back in (``kv-preflight index export`` and ``import``): read from
the pod's state log (kv_preflight/index/pod_state.py) by a reader of its own, so what a writer holds in
memory never stands in for what Valkey holds; written back through the Index's apply path.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from kv_preflight.index.entries import StoreBlock
from kv_preflight.index.layout import pod_meta_key
from kv_preflight.index.writer import PodWriter

if TYPE_CHECKING:
    from kv_preflight.index.index import Index


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


async def import_blocks(index: "Index", pod_id: str, model: str, engine_block_size: int | None,
                        stores: Sequence[StoreBlock]) -> None:
    """Write exported entries back; the pod's seq is left alone (the next live batch decides)."""
    await index.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model=model,
                            engine_block_size=engine_block_size, mutations=stores, mode="import")


async def restore_seqs(client, pod_id: str, seqs: dict[str, int]) -> None:
    """Set a pod's persisted seqs (index import): the next live batch is then judged against them."""
    if seqs:
        await client.hset(pod_meta_key(pod_id), mapping={f"seq:{r}": int(v) for r, v in seqs.items()})


__all__ = ["export_blocks", "held_blocks", "import_blocks", "restore_seqs"]
