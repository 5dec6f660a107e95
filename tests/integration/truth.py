"""What the index must hold: the engine's stored-minus-removed blocks, replayed from its event stream."""
from __future__ import annotations

from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import Index, tier_of
from kv_preflight.index.transfer import export_blocks


def engine_truth(batches: list[EventBatch]) -> set[tuple[int, str]]:
    """(engine key, tier) the engine holds after these batches."""
    held: set[tuple[int, str]] = set()
    for b in batches:
        for ev in b.events:
            if isinstance(ev, BlockStored):
                held.update((ek, tier_of(ev.medium)) for ek in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.difference_update((ek, tier_of(ev.medium)) for ek in ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
    return held


async def index_state(ix: Index, pod_id: str) -> set[tuple[int, str]]:
    """(engine key, tier) the index holds for a pod, after checking every request key really lists it."""
    held = set()
    async for s in export_blocks(ix.writer, pod_id):
        for rk in s.request_keys:
            fields = await ix.client.hkeys(str(rk))
            assert s.entry_field.encode() in fields, f"request key {rk} lost {pod_id}'s entry"
        held.add((s.engine_key, s.tier))
    return held
