"""Engine keys back to request keys: an event's parent block is named by the engine's hash (``engine:<key>``,
llm-d's sorted set of the request keys each engine key stands for, kv_preflight/index/layout.py), and a child
chains from its parent's last request key. Read when the ingester has not seen the parent itself (another
ingester wrote it, or this one restarted)."""
from __future__ import annotations

from collections.abc import Iterable

from kv_preflight.index.backend import foreign_as_empty
from kv_preflight.index.entries import parse_entry
from kv_preflight.index.layout import engine_key_name


async def resolve_engine_keys(client, engine_keys: Iterable[int], pod_id: str | None = None) -> dict[int, int]:
    """Engine key -> its last request key (the one a child block chains from), one round trip.

    Engines of different models with the same hash seed give the same tokens the same engine
    key (vLLM's block hash has no model in it), so ``engine:<key>`` can hold several models'
    request keys at the last position. Then the one ``pod_id`` holds wins (a child's parent is
    in its own pod's cache); if that does not single one out, the key stays unresolved (an
    orphan) rather than chaining from another model's key.
    """
    eks = list(dict.fromkeys(engine_keys))
    if not eks:
        return {}
    async with client.pipeline(transaction=False) as pipe:
        for ek in eks:
            pipe.zrevrange(engine_key_name(ek), 0, 1, withscores=True)
        replies = foreign_as_empty(await pipe.execute(raise_on_error=False))
    out: dict[int, int] = {}
    tied: list[tuple[int, float]] = []
    for ek, r in zip(eks, replies):
        if len(r) == 1 or (len(r) > 1 and r[0][1] != r[1][1]):
            out[ek] = int(r[0][0])
        elif r:
            tied.append((ek, r[0][1]))
    if tied and pod_id is not None:
        async with client.pipeline(transaction=False) as pipe:
            for ek, top in tied:
                pipe.zrangebyscore(engine_key_name(ek), top, top)
            candidates = foreign_as_empty(await pipe.execute(raise_on_error=False))
        async with client.pipeline(transaction=False) as pipe:
            for rks in candidates:
                for rk in rks:
                    pipe.hkeys(rk)
            fields = iter(foreign_as_empty(await pipe.execute(raise_on_error=False)))
        for (ek, _), rks in zip(tied, candidates):
            mine = []
            for rk in rks:
                entries = (parse_entry(f) for f in next(fields))
                if any(e is not None and e.PodIdentifier == pod_id for e in entries):
                    mine.append(int(rk))
            if len(mine) == 1:
                out[ek] = mine[0]
    return out


__all__ = ["resolve_engine_keys"]
