"""What a backend is (the one interface kv_preflight/index/index.py calls for what differs between a single
Valkey node and a Valkey Cluster), and the pieces both use."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from kv_preflight.index.entries import ApplyResult, Lookup
from kv_preflight.index.layout import request_key_name

if TYPE_CHECKING:
    from kv_preflight.index.resp import FastConnection
    from kv_preflight.index.presence import NamesFor
    from kv_preflight.index.writer import Prepared

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


class IndexBackend(Protocol):
    """A topology: how a batch is applied, how a chain is looked up, and its housekeeping. The Index
    (kv_preflight/index/index.py) calls only these, and never asks which backend it has: a new topology
    is one module implementing them."""

    cluster: bool  # for the index's own modules (the pod's key names); callers ask the questions below instead
    label: str  # what a log line calls the topology ("" for a plain single node)
    # True where one part of the index (a shard) can fail while the others answer: a caller then goes on with
    # what answers (the answer says "partial") rather than failing the request
    partial_reads: bool
    gap_walks: int  # pods a default lookup walked key by key rather than bisected (a counter)
    late_reads: int  # default lookups that took a round past the usual ones (a counter; 0 on one node)
    unreplicated: int  # runs whose changes no replica confirmed in time, kept in the outbox (a counter; 0 on one node)
    confirmed_late: int  # kept outbox entries deleted once a replica confirmed them (a counter; 0 on one node)
    # keys elsewhere than the numbering's that keep its high-water mark (kv_preflight/index/numbering.py
    # give_numbers): a cluster's shards may lose their data one at a time; () on one node
    numbering_copies: tuple[str, ...]
    # the lean connection (kv_preflight/index/resp.py) where the topology and URL have one, for other scripts on
    # the hot path (the gateway's routed state, kv_preflight/index/routed.py); None: redis-py carries everything
    fast: "FastConnection | None"

    def nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node the client knows beyond the URL's (a cluster's shards and replicas)."""

    async def send(self, preps: Sequence["Prepared"]) -> "asyncio.Future[list[ApplyResult]]":
        """Apply planned batches (kv_preflight/index/writer.py), in order; the results come from the future."""

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None, mode: str) -> tuple[Lookup, int]:
        """Over llm-d's entries (``linear``, ``pipeline``): per pod, its prefix of the chain; and how
        many foreign-typed keys were read as misses."""

    async def lookup_bits(self, request_keys: Sequence[int], names: "NamesFor") -> tuple[Lookup | None, int]:
        """The default lookup, over the presence bitmaps; None when a key holds entries that are not ours."""

    async def drain_outbox(self, pod_id: str, *, stale_only: bool) -> int:
        """Finish what a stopped writer left half applied (nothing to do on a single node)."""

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        """``drain_outbox(stale_only=True)`` of each pod, ``at_once`` side by side: per pod the entries run again,
        or the Valkey error that stopped it (other errors raise). A single node has none: ``{}`` at once."""

    async def read_timed(self, fill: Callable[[Any], None]) -> tuple[int, list[Any]]:
        """Valkey's time (ms) and the replies of the reads ``fill`` puts in a pipeline (error replies in place),
        in as few round trips as the topology allows."""

    async def look_at_shards(self, epoch: str) -> Looked:
        """The primaries that came back without their data in ``epoch``, and those whose slot marker was
        evicted (kv_preflight/index/cluster/markers.py); a single node has none: its epoch key says it all."""

    async def mark_shards(self, epoch: str) -> None:
        """Every slot marked in ``epoch`` so a shard's loss from here on shows (nothing to mark on one node)."""

    def forget(self, pods: Iterable[str]) -> None:
        """Drop what this process remembers of these pods' writes (a pod let go, the index's data lost)."""

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Read-only commands on the keys they name second, replies in order, error replies in place."""

    async def key_count(self) -> int: ...

    async def memory_usage(self) -> int | None: ...

    async def close(self) -> None: ...


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


__all__ = ["VALKEY_ERRORS", "IndexBackend", "Looked", "evalsha_pipeline", "foreign_as_empty", "ms_of", "read_fields", "read_pipeline",
           "ready"]
