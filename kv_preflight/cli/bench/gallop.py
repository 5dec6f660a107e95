"""Layout 2's galloping lookup over llm-d's entries, on a single node: ``lua/lookup.lua`` with no exact-walk budget,
so every pod holding key 1 is bisected (exact only where a pod's blocks form a prefix of the chain). The
benchmark's point of comparison for the bitmaps (docs/benchmarks.md); no process looks chains up this way, so it
lives here, out of the index's modules (a cluster's shards run the same script with a budget:
kv_preflight/index/cluster/lookup.py)."""
from __future__ import annotations

from collections.abc import Sequence

from kv_preflight.index import scripts
from kv_preflight.index.entries import PodMatch, parse_lookup_reply
from kv_preflight.keys.chain import pack_keys


async def gallop(client, request_keys: Sequence[int], pods: Sequence[str] | None = None) -> list[PodMatch]:
    """Per pod holding the chain's first key, how many leading keys it holds, bisected (one EVALSHA)."""
    if not request_keys:
        return []
    script = client.register_script(scripts.LOOKUP)
    reply = await script(keys=[], args=[len(request_keys), pack_keys(request_keys), 0, *(pods or ())])
    return parse_lookup_reply(reply, 2)[0]  # (lookup.lua also says whether a key moved: never, on one node)


__all__ = ["gallop"]
