"""The pieces every backend uses (kv_preflight/index/single.py, kv_preflight/index/cluster/): what a Valkey call
can raise, scripts and reads pipelined, replies read. What a backend is: kv_preflight/index/connect.py."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, NamedTuple

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from kv_preflight.index.layout import request_key_name

# What a Valkey call can raise when Valkey (a node, a shard) is unreachable or answers an error:
# redis-py's cluster client raises RedisClusterException (not a RedisError) when it has no node.
VALKEY_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


class Looked(NamedTuple):
    """What one look at the markers found: the primaries (host:port) that came back without their data, and
    those whose marker was gone though they ran all along (evicted under an ``allkeys-*`` policy, or deleted by
    hand: written again, no loss)."""

    lost: list[str]
    rewritten: list[str]
    numbering: bool = False  # the pod numbering (``kvpf:{nums}:*``) was on a lost one


async def evalsha_pipeline(client, script, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> list[Any]:
    """One EVALSHA per (keys, args), pipelined (a cluster client groups them by node); the script is
    loaded (on every primary) if a server did not know it."""
    for attempt in range(2):
        async with client.pipeline(transaction=False) as pipe:
            for k, a in zip(keys, args):
                pipe.execute_command("EVALSHA", script.sha, len(k), *k, *a)
            try:
                out = await pipe.execute(raise_on_error=False)
            except NoScriptError:
                out = [NoScriptError("NOSCRIPT")]
        if attempt == 0 and any(isinstance(r, NoScriptError) for r in out):
            await client.script_load(script.script)
            continue
        for r in out:
            if isinstance(r, Exception):
                raise r
        return out
    raise AssertionError("unreachable")


def ready(value: Any) -> "asyncio.Future[Any]":
    done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    done.set_result(value)
    return done


async def read_pipeline(client, fill) -> list[Any]:
    """A pipeline of reads, sent once more on a fresh connection if the connection dropped under it
    (a Valkey restart, CLIENT KILL): reads are safe to repeat. Error replies come back in place."""
    for attempt in (0, 1):
        try:
            async with client.pipeline(transaction=False) as pipe:
                fill(pipe)
                return await pipe.execute(raise_on_error=False)
        except (RedisConnectionError, ConnectionError, OSError):
            if attempt:
                raise
    raise AssertionError("unreachable")


async def read_fields(client, request_keys: Sequence[int]) -> tuple[list[Any], int]:
    """llm-d's Lookup: pipelined HKEYS of each request key, its fields; a key of a foreign type (WRONGTYPE)
    reads as empty, a miss, and is counted (the second value); other errors raise."""
    def fill(pipe) -> None:
        for k in request_keys:
            pipe.hkeys(request_key_name(k))

    replies = await read_pipeline(client, fill)
    foreign = 0
    for i, r in enumerate(replies):
        if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):  # a miss, counted
            foreign += 1
            replies[i] = []
        elif isinstance(r, Exception):
            raise r
    return replies, foreign


def foreign_as_empty(replies: list[Any]) -> list[Any]:
    """Pipeline replies with a key of a foreign type (WRONGTYPE) read as empty; other errors raise."""
    for i, r in enumerate(replies):
        if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
            replies[i] = []
        elif isinstance(r, Exception):
            raise r
    return replies


def ms_of(time_reply: Any) -> int:
    """A ``TIME`` reply (seconds, microseconds) in milliseconds."""
    seconds, micros = time_reply
    return int(seconds) * 1000 + int(micros) // 1000


__all__ = ["VALKEY_ERRORS", "Looked", "evalsha_pipeline", "foreign_as_empty", "ms_of", "read_fields", "read_pipeline",
           "ready"]
