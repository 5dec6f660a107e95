"""``kv-preflight index migrate``: an index of layout 1 (kv-preflight 0.1) or 2 to layout 3.

Layout 2 to 3 adds the presence bitmaps (``kvpf:{<rk>}:bits``, kv_preflight/index/layout.py) the lookup reads:
every pod gets its number, its per-tier link counts (``<rk>|~<tier>`` in its refs) and its bits,
rebuilt from its own refs and fields; then every request key's count of our entries ("#n") is set
from its fields. Each step writes absolute values (a bit set, a count HSET), so an interrupted migrate
is simply run again. Request keys and ``engine:`` keys are not touched.

Layout 1 kept each pod's state under ``kvpf:pod:<pod>``, ``kvpf:blocks:<pod>`` (field id and
copies per block) and ``kvpf:fields:<pod>``, and found a block's request keys by reading
``engine:<key>``. Layout 2 (kv_preflight/index/layout.py) puts every per-pod key in the pod's slot
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

from kv_preflight.index import scripts
from kv_preflight.index.entries import parse_entry
from kv_preflight.index.index import give_numbers
from kv_preflight.index.presence import OUR_COUNT
from kv_preflight.index.layout import (LAYOUT_KEY, LAYOUT_VERSION, PODS_KEY, V1_PODS_KEY,
                                        request_bits_key, engine_key_name, engine_members_key,
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
    """Move an index of layout 1 or 2 to layout 3; returns counts. ``client`` is a redis-py asyncio
    client (single node or cluster)."""
    done = await _v1_to_v2(client, chunk=chunk, progress=progress)
    done["keys"] = await add_bits(client, chunk=chunk, progress=progress)
    await client.hset(LAYOUT_KEY, "version", LAYOUT_VERSION)
    return done


async def add_bits(client, *, chunk: int = 500, progress: Callable[[str, int], None] | None = None) -> int:
    """Layout 2 -> 3: numbers, tier counts and bits per pod, then each request key's count of our
    entries. Returns the request keys counted."""
    bit = client.register_script(scripts.BIT_EFFECT)
    await client.script_load(bit.script)  # on every primary of a cluster
    pods = sorted(_text(k) for k in await client.hkeys(PODS_KEY))
    ours: set[str] = set(pods)
    for pod in pods:
        num = (await give_numbers(client, [pod]))[pod]
        tier_of = {}
        for fid, fld in (await client.hgetall(pod_fields_key(pod))).items():
            e = parse_entry(fld)
            tier_of[_text(fid)] = e.DeviceTier if e is not None and not e.Speculative and e.PodIdentifier == pod else None
        links: dict[tuple[str, str], int] = {}
        async for f, v in client.hscan_iter(pod_rks_key(pod), count=chunk):
            rk, _, fid = _text(f).rpartition("|")
            tier = tier_of.get(fid)
            if rk and not fid.startswith("~") and tier and int(v) > 0:
                links[(rk, tier)] = links.get((rk, tier), 0) + 1
        items = sorted(links.items())
        for s in range(0, len(items), chunk):
            pipe = client.pipeline(transaction=False)
            for (rk, tier), n in items[s:s + chunk]:
                pipe.hset(pod_rks_key(pod), f"{rk}|~{tier}", n)
                # (EVALSHA through execute_command: redis-py's cluster pipeline routes it by its first key)
                pipe.execute_command("EVALSHA", bit.sha, 2, request_bits_key(rk), rk, rk, "", 1, tier, num)
            await pipe.execute()
        if progress:
            progress(pod, len(items))
    counted = 0
    batch: list[str] = []

    async def count(keys: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.hkeys(k)
        fields = await pipe.execute(raise_on_error=False)
        pipe = client.pipeline(transaction=False)
        for k, fl in zip(keys, fields):
            if isinstance(fl, Exception):
                continue  # a key of a foreign type: not ours
            n = sum(1 for f in fl if (e := parse_entry(f)) is not None and e.PodIdentifier in ours)
            if n:
                pipe.hset(request_bits_key(k), OUR_COUNT, n)
            else:
                pipe.hdel(request_bits_key(k), OUR_COUNT)
        await pipe.execute()

    async for key in client.scan_iter(count=chunk):
        k = _text(key)
        if k.isdigit():  # llm-d's request keys are decimal; every other key has a prefix
            batch.append(k)
            if len(batch) >= chunk:
                await count(batch)
                counted += len(batch)
                batch = []
                if progress:
                    progress("request keys", counted)
    if batch:
        await count(batch)
        counted += len(batch)
    return counted


async def _v1_to_v2(client, *, chunk: int, progress: Callable[[str, int], None] | None) -> dict[str, int]:
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
    return done


__all__ = ["add_bits", "migrate", "v2_block"]
