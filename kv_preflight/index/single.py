"""A single Valkey node: a batch is one script (the pod step and its shared-key effects together,
atomically); a lookup is one script that walks the chain. The lean connection (kv_preflight/index/resp.py) carries
both hot paths when the URL allows it (redis://, unix://); redis-py everything else."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kv_preflight.index import scripts
from kv_preflight.index.backend import Looked, evalsha_pipeline, ms_of, read_fields, read_pipeline, ready
from kv_preflight.index.entries import ApplyResult, Lookup, PodMatch, apply_result, longest_prefix, parse_lookup_reply
from kv_preflight.keys.chain import pack_keys
from kv_preflight.index.presence import (NamesFor, mask_of, one_tier_of_reads, parse_bits_reply, prefix_from_bits,
                                        prefix_of_one_tier)
from kv_preflight.index.layout import LOOKUP_NAMES
from kv_preflight.index.resp import FastConnection
from kv_preflight.index.writer import Prepared


class SingleNodeBackend:
    cluster = False
    label = ""
    partial_reads = False  # the node answers whole or not at all

    def __init__(self, client, fast: FastConnection | None):
        self.client = client
        self.fast = fast
        self._apply = client.register_script(scripts.APPLY)
        self._lookup_linear = client.register_script(scripts.LOOKUP_LINEAR)
        self._lookup_bits = client.register_script(scripts.LOOKUP_BITS)
        # pods walked key by key instead of bisected (orphan keys, or their count unknown): a counter
        self.gap_walks = 0
        self.late_reads = 0  # (one round always, on one node)
        self.numbering_copies: tuple[str, ...] = ()  # the numbering goes with everything else, or not at all

    async def send(self, preps: Sequence[Prepared]) -> "asyncio.Future[list[ApplyResult]]":
        """Each batch is one script, its changes included. Written now on the lean connection (the caller
        prepares the next batches meanwhile; later commands run after these); without it (TLS) run before
        this returns."""
        keys = [p.keys for p in preps]
        args = [p.script_args() for p in preps]
        if self.fast is not None:
            replies = await self.fast.evalsha_send(self._apply.sha, self._apply.script, list(args), list(keys))

            async def results() -> list[ApplyResult]:
                return [apply_result(r) for r in await replies]

            return asyncio.ensure_future(results())
        return ready([apply_result(r) for r in await evalsha_pipeline(self.client, self._apply, keys, args)])

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None, mode: str) -> tuple[Lookup, int]:
        """Over llm-d's entries: ``linear``, the exact walk in one EVALSHA; ``pipeline``, llm-d's own pipelined
        HKEYS, walked in Python. (The default reads the bitmaps: ``lookup_bits``.)"""
        if mode == "pipeline":
            fields, foreign = await read_fields(self.client, request_keys)
            return Lookup(longest_prefix(fields, pods)), foreign
        if mode != "linear":
            raise ValueError(f"lookup mode {mode!r}: a single node walks llm-d's entries 'linear' or 'pipeline'")
        script = self._lookup_linear
        args = [len(request_keys), pack_keys(request_keys), 0, *(pods or ())]
        if self.fast is not None:
            matches, foreign = parse_lookup_reply(await self.fast.evalsha(script.sha, script.script, args), 1)
        else:
            matches, foreign = parse_lookup_reply(await script(keys=[], args=args), 1)
        return Lookup(matches), foreign

    async def lookup_bits(self, request_keys: Sequence[int], names: NamesFor) -> tuple[Lookup | None, int]:
        """The default lookup: lookup_bits.lua in one EVALSHA (the keys' pod bitmaps, walked here or
        bisected there, each pod's orphan count read there too: "local"); None when key 1 holds entries
        that are not ours (walk llm-d's entries then)."""
        args = [len(request_keys), "local", *LOOKUP_NAMES, *request_keys]
        if self.fast is not None:
            reply = await self.fast.evalsha(self._lookup_bits.sha, self._lookup_bits.script, args)
        else:
            reply = await self._lookup_bits(keys=[], args=args)
        r = parse_bits_reply(reply)
        if r.flat is not None:  # a prefix many pods hold, one tier per key: walked in C, no dict per key
            tiers, maps = r.flat
            known = await names(int.from_bytes(maps[0], "little"), r.epoch)
            return Lookup(prefix_of_one_tier(tiers, maps, known)), r.foreign
        self.gap_walks += r.walked
        if r.kind == 2:
            return None, r.foreign
        if r.kind == 0:
            per_key = r.reads
            known = await names(mask_of(per_key[0]) if per_key else 0, r.epoch)
            one_tier = one_tier_of_reads(per_key) if r.groups is not None else None
            if one_tier is not None:
                return Lookup(prefix_of_one_tier(*one_tier, known), group_bits=r.groups), r.foreign
            return Lookup(prefix_from_bits(per_key, known), group_bits=r.groups), r.foreign
        known = await names([num for num, _, _ in r.counts], r.epoch)
        return Lookup([PodMatch(known[num], held, tier) for num, held, tier in r.counts if num in known]), r.foreign

    async def drain_outbox(self, pod_id: str, *, stale_only: bool) -> int:
        return 0  # one script applies a whole batch: nothing is ever left half applied

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        return {}  # no outbox on one node

    def write_counts(self) -> dict[str, int]:
        return {"unreplicated": 0, "confirmed_late": 0, "late_runs": 0}  # one script applies a batch whole

    def nodes(self) -> list[tuple[str, int]]:
        return []  # the URL's node is all there is

    def forget(self, pods: Iterable[str]) -> None:
        pass  # nothing of a pod's writes is remembered here

    def left_to_drain(self, pod_id: str) -> bool:
        return False  # one script applies a batch whole

    async def read_timed(self, fill: Callable[[Any], None]) -> tuple[int, list[Any]]:
        """``TIME`` first in the same pipeline: one round trip."""
        def with_time(pipe) -> None:
            pipe.time()
            fill(pipe)

        now, *rest = await read_pipeline(self.client, with_time)
        return ms_of(now), rest

    async def look_at_shards(self, epoch: str) -> Looked:
        return Looked([], [])  # one node: its epoch key (kvpf:epoch) goes with its data, and says it all

    async def mark_shards(self, epoch: str) -> None:
        pass  # (the same)

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """On the lean connection where there is one (a thousand pods' metadata cost ~70 ms of redis-py's
        per-command Python; there a few ms), else a redis-py pipeline, sent again once on a fresh connection."""
        if self.fast is not None:
            return await self.fast.pipeline(commands)

        def fill(pipe) -> None:
            for c in commands:
                pipe.execute_command(*c)

        return await read_pipeline(self.client, fill)

    async def key_count(self) -> int:
        return int(await self.client.dbsize())

    async def memory_usage(self) -> int | None:
        return int((await self.client.info("memory")).get("used_memory", 0))

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()


__all__ = ["SingleNodeBackend"]
