"""``kv-preflight index migrate``: an index of layout 1 (kv-preflight 0.1) to layout 2.

Layout 1 kept each pod's state under ``kvpf:pod:<pod>``, ``kvpf:blocks:<pod>`` (field id and
copies per block) and ``kvpf:fields:<pod>``, and found a block's request keys by reading
``engine:<key>``. Layout 2 (shared/layout.py) puts every per-pod key in the pod's slot
(``kvpf:{<pod>}:...``), keeps the request keys in the reverse index, counts request-key refs per
pod, and gives each engine key a membership set. Request keys and ``engine:<key>`` are llm-d's and
do not change, so an llm-d scheduler reading the index sees nothing happen.

The move is per pod, read with HSCAN in chunks (a large pod never blocks Valkey), and idempotent:
a pod whose layout-1 keys are gone is done, so an interrupted migrate is simply run again. Stop the
ingesters first (a layout-1 ingester would keep writing layout-1 keys); the new ones refuse to
start on a layout-1 index and stop writing if a layout-1 writer appears (``kvpf:pods`` again).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kv_preflight.shared.layout import (LAYOUT_KEY, LAYOUT_VERSION, V1_PODS_KEY, engine_key_name, engine_members_key,
                           pod_blocks_key, pod_fields_key, pod_meta_key, pod_rks_key, register_pod_args,
                           v1_pod_blocks_key, v1_pod_fields_key, v1_pod_meta_key)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def v2_block(held: str, rks: list[str]) -> tuple[str, str]:
    """A layout-1 reverse-index value (``<id>[*<n>]``) and the block's request keys -> layout 2's
    value (``<id>[*<n>]:<rk>,..``) and its field id (pure)."""
    head = held.split(":", 1)[0]
    return f"{head}:{','.join(rks)}", head.split("*", 1)[0]


async def migrate(client, *, chunk: int = 500, progress: Callable[[str, int], None] | None = None) -> dict[str, int]:
    """Move every layout-1 pod to layout 2; returns counts. ``client`` is a redis-py asyncio
    client (single node or cluster)."""
    pods = {_text(k): _text(v) for k, v in (await client.hgetall(V1_PODS_KEY)).items()}
    done = {"pods": 0, "blocks": 0}
    for pod, model in sorted(pods.items()):
        meta = await client.hgetall(v1_pod_meta_key(pod))
        if meta:
            await client.hset(pod_meta_key(pod), mapping=meta)
        fields = await client.hgetall(v1_pod_fields_key(pod))
        if fields:
            await client.hset(pod_fields_key(pod), mapping=fields)
        # A migrate interrupted inside this pod left part of its blocks: start the pod afresh.
        await client.delete(pod_blocks_key(pod), pod_rks_key(pod))
        ids = {_text(k): _text(v) for k, v in fields.items()}
        by_field = {v: k for k, v in ids.items()}
        cursor = 0
        while True:
            cursor, part = await client.hscan(v1_pod_blocks_key(pod), cursor, count=chunk)
            items = [(_text(k), _text(v)) for k, v in part.items()]
            pipe = client.pipeline(transaction=False)
            for bk, _ in items:
                pipe.zrange(engine_key_name(int(bk.split("|", 1)[0])), 0, -1)
            members = await pipe.execute() if items else []
            pipe = client.pipeline(transaction=False)
            for (bk, held), rks in zip(items, members):
                rks = [_text(r) for r in rks]
                if not held.split("*", 1)[0].isdigit():  # a field written before ids: give it one
                    fld = held.split("*", 1)[0]
                    fid = by_field.get(fld)
                    if fid is None:
                        fid = by_field[fld] = str(len(by_field) + 1)
                        pipe.hset(pod_fields_key(pod), fid, fld)
                    held = fid + held[len(fld):]
                value, fid = v2_block(held, rks)
                pipe.hset(pod_blocks_key(pod), bk, value)
                for rk in rks:
                    pipe.hincrby(pod_rks_key(pod), f"{rk}|{fid}", 1)
                ek, _, slot = bk.partition("|")
                pipe.hset(engine_members_key(ek), f"{pod}|{slot}", 1)
            if items:
                await pipe.execute()
            done["blocks"] += len(items)
            if progress:
                progress(pod, done["blocks"])
            if cursor == 0:
                break
        await client.hset(*register_pod_args(pod, model))
        await client.delete(v1_pod_meta_key(pod), v1_pod_fields_key(pod), v1_pod_blocks_key(pod))
        await client.hdel(V1_PODS_KEY, pod)
        done["pods"] += 1
    await client.hset(LAYOUT_KEY, "version", LAYOUT_VERSION)
    return done


__all__ = ["migrate", "v2_block"]
