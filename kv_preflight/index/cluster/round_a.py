"""Round A of a Valkey Cluster run (kv_preflight/index/cluster/writes.py): each request key's change (its llm-d entry
and its presence bit, in its slot) on the shard that holds it, and the probes of the run's engine-key drops (is
each request key empty where the drop stands?), which rounds B-D act on."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from kv_preflight.index.backend import VALKEY_ERRORS, evalsha_pipeline
from kv_preflight.index.changes import shard_args
from kv_preflight.index.cluster.outbox_ops import OutboxEntry, key_op_args
from kv_preflight.index.cluster.routing import Shards
from kv_preflight.index.cluster.window import Renewable, in_time
from kv_preflight.index.entries import text
from kv_preflight.index.layout import presence_key

# a shard's share goes in scripts of at most this many, in order (~10 us a change: ~80 ms a script). One script of a
# large clearing's whole share (a pod of 320,000 blocks on 3 masters) held its shard for over a second: every lookup
# and writer there waited, the script outran the connection's timeout (1 s) and the run was resent one script per
# change through redis-py's routing (which a review saw time out for good)
EFFECTS_CHUNK = 8192


async def run_round_a(client: RedisCluster, shards: Shards, script: Any, key_ops: Sequence[Any],
                      whose: Sequence[OutboxEntry], until: float | Renewable | None) -> tuple[int, str, dict[int, int]]:
    """The request keys' changes (``whose``: each one's entry) with ``script`` (effects.lua): per shard its share in
    order, in scripts of at most ``EFFECTS_CHUNK``, each sent only within ``until``; the shards in parallel. Changes
    whose key moved meanwhile, and what a shard did not answer, go again through the cluster's routing, one script
    each (declared keys: the request key and its presence hash, one slot). Returns foreign writes, the first such
    error, and per probed drop (its position in the run) how many of its request keys were empty where it stands."""
    if not key_ops:
        return 0, "", {}
    by_node, moved = await shards.request_keys_by_primary([op[0] for op in key_ops])
    empty_at: dict[int, int] = {}

    def probes(reply_part: Sequence[Any]) -> None:
        for j in reply_part:
            j = int(j)  # a probe's j (an int, or the script's reply as bytes)
            empty_at[j] = empty_at.get(j, 0) + 1

    async def shard(node, idx: list[int]) -> tuple[int, str]:
        foreign, first = 0, ""
        for lo in range(0, len(idx), EFFECTS_CHUNK):
            # each script is a send of its own: none past the window (a large run's round A outlasts it; the
            # first comes after its keys were worked out, the loop busy meanwhile)
            await in_time(until, "A")
            try:
                f, fst = await shard_chunk(node, idx[lo:lo + EFFECTS_CHUNK])
            except VALKEY_ERRORS:  # the rest through the routing; what answered stays counted (its probes)
                moved.extend(idx[lo:])
                break
            foreign, first = foreign + f, first or fst
        return foreign, first

    async def shard_chunk(node, idx: list[int]) -> tuple[int, str]:
        # effects.lua names a moved op by its position among the ops it ran (shard_args says whose)
        ops = [key_ops[i] for i in idx]
        args, at, folded = shard_args(ops, [whose[i] for i in idx])
        fast = shards.fast_for(node)
        if fast is not None:
            try:
                async with asyncio.timeout(fast.timeout_s):
                    reply = await fast.evalsha(script.sha, script.script, args)
            except TimeoutError:
                raise RedisConnectionError(f"{node.name} did not answer the changes in time") from None
        else:
            try:
                reply = await client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)
            except NoScriptError:
                await client.script_load(script.script)
                reply = await client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)
        gone = {int(p) for p in text(reply[0]).split(",") if p}
        for p in gone:
            moved.append(idx[at[p - 1]])
            if p in folded:
                moved.append(idx[folded[p]])  # its probe goes with it
        probes(reply[3])
        # r blocks that left their key empty answer the probes that rode on them
        probes([ops[folded[p]].at for p in map(int, reply[4]) if p in folded and p not in gone])
        return int(reply[1]), text(reply[2])

    foreign, first = 0, ""
    results = await asyncio.gather(*(shard(n, idx) for n, idx in by_node.values()), return_exceptions=True)
    for res in results:
        if isinstance(res, BaseException):  # Late, or a bug: a shard's Valkey error moved its unanswered scripts'
            raise res  # changes already (``shard``), to go again through the routing, which may have news
        foreign += res[0]
        first = first or res[1]
    if moved:
        shards.forget_table()  # slots moved: the barrier's routing reads the map redis-py learns now
        await in_time(until, "A, resent")  # a shard that timed out (a failover) may have taken the window
        moved = sorted(set(moved))
        replies = await evalsha_pipeline(client, script,
                                         [(str(key_ops[i][0]), presence_key(key_ops[i][0])) for i in moved],
                                         [key_op_args(key_ops[i], whose[i]) for i in moved])
        for r in replies:
            foreign += int(r[1])
            first = first or text(r[2])
            probes(r[3])
    return foreign, first, empty_at


__all__ = ["EFFECTS_CHUNK", "run_round_a"]
