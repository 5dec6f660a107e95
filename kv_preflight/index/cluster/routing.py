"""Where each key of a Valkey Cluster lives, and the lean connections to its primaries.

redis-py's cluster client routes every command (MOVED and ASK followed), but spends tens of µs of Python per
command; the hot paths (a prediction's one script per shard, an ingester's runs of pod steps and effects)
group their keys by primary here, from the client's slot map, and send each group on that primary's lean
connection (kv_preflight/index/resp.py), falling back to redis-py's routing for what a primary refuses as not
its slot's (resharding, failover) and for every group of a primary that did not answer."""
from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import NoScriptError, ResponseError, SlotNotCoveredError

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.entries import text
from kv_preflight.index.resp import FastConnection
from kv_preflight.index.slots import canonical_table, key_slot, slot_groups, slot_table

# Error replies that say a command reached a primary that does not (or not yet) serve its slot.
REDIRECTS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


def writer_id() -> str:
    """This process, as named in outbox entries: host, pid and a random part (no '|')."""
    host = socket.gethostname().replace("|", "_").replace("@", "_")[:40]
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def probe_cluster(url: str, timeout_s: float) -> bool | None:
    """Whether the node a URL names runs in cluster mode (``INFO cluster``: cluster_enabled);
    None when it does not answer (the caller decides, see ``--valkey-cluster``)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return str(client.info("cluster").get("cluster_enabled", 0)) == "1"
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


def cluster_client(url: str, *, timeout_s: float) -> RedisCluster:
    """A cluster client from any node's URL; the slot map is learned from it and refreshed on
    MOVED. A database other than 0 does not exist on a cluster: a clear error, not a surprise."""
    parts = urlsplit(url)
    db = parts.path.lstrip("/")
    if db not in ("", "0"):
        raise ValueError(f"{url.split('@')[-1]}: a Valkey Cluster has only database 0; drop /{db} from --valkey-url")
    clean = parts._replace(path="").geturl()
    # redis-py's default retry backs off for seconds (base 1 s); a lookup must fail within its deadline
    # and the ingester retries on its own, so: two quick tries, then the error.
    return RedisCluster.from_url(clean, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 require_full_coverage=False,
                                 retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), 2))


def node_for(client: RedisCluster, key: str):
    """The primary that owns a key, from the client's slot map. redis-py's get_node_from_key costs
    ~10 µs of Python per key (a lookup has hundreds); CRC16 from binascii costs well under one.
    SlotNotCoveredError (a RedisClusterException) when no node serves the slot."""
    holders = client.nodes_manager.slots_cache.get(key_slot(key))
    if not holders:
        raise SlotNotCoveredError(f"no node serves the slot of {key!r}")
    return holders[0]


def by_primary(client: RedisCluster, keys: Iterable[str]) -> tuple[dict[str, tuple[Any, list[int]]], list[int]]:
    """Positions of ``keys`` grouped by the primary serving each (primary name -> (node, positions), in
    order), and the positions whose slot no primary serves now."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    unserved: list[int] = []
    for i, key in enumerate(keys):
        try:
            node = node_for(client, key)
        except VALKEY_ERRORS:
            unserved.append(i)
            continue
        groups.setdefault(node.name, (node, []))[1].append(i)
    return groups, unserved


def over_tls(node) -> bool:
    """Whether redis-py reaches this cluster node over TLS (its connections' class says so)."""
    return "SSL" in node.connection_class.__name__


class Shards:
    """The cluster's primaries as the hot paths use them: the slot -> primary table, a lean connection
    to each, and redis-py's routing for the rest. ``resend_scripts``: scripts safe to send again on a
    lost connection (kv_preflight/index/resp.py)."""

    def __init__(self, client: RedisCluster, resend_scripts: Iterable[str] = ()):
        self.client = client
        self.resend = set(resend_scripts)
        self._fast: dict[str, FastConnection | None] = {}  # primary -> its lean connection (None: TLS)
        self._map_read_at = 0.0
        self._table: tuple[Any, bytes, list[Any]] | None = None  # (slot map it was built from, table, primaries)
        self._digest: tuple[bytes, tuple[bytes, tuple[str, ...]]] | None = None  # (table, ``map_digest``)
        self._forgets = 0  # how often a caller found slots moved (``forget_table``)
        # how often commands went through redis-py's routing rather than to the primary our table names (TLS:
        # no lean connection): redis-py follows a redirect there itself, unseen (an ASK leaves its map as it
        # was, a MOVED mostly patches it in place), so what those commands wrote may be on another primary
        self._routed = 0

    async def ready(self) -> None:
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()  # a new client learns the slot map on its first command

    def fast_for(self, node) -> FastConnection | None:
        """The lean connection to a primary; None, where redis-py carries the commands, over TLS (it speaks plain
        TCP) and for a client given a credential provider (it AUTHs with a fixed username and password, and a
        provider's credentials may be tokens that expire: it asks the provider at each connect)."""
        if node.name not in self._fast:
            kw = node.connection_kwargs
            carried = over_tls(node) or kw.get("credential_provider") is not None
            self._fast[node.name] = None if carried else FastConnection(
                host=node.host, port=node.port, username=kw.get("username"), password=kw.get("password"),
                timeout_s=kw.get("socket_timeout") or 1.0, resend_scripts=self.resend)
        return self._fast[node.name]

    def slot_table(self) -> tuple[bytes, list[Any]]:
        """(slot -> primary index, primaries) for the client's current slot map: rebuilt when redis-py
        replaces the map (it learns it again) or when a caller found a key moved (``forget_table``)."""
        cache = self.client.nodes_manager.slots_cache
        if self._table is None or self._table[0] is not cache:
            primaries = {slot: holders[0] for slot, holders in cache.items() if holders}
            table, names = slot_table({slot: node.name for slot, node in primaries.items()})
            by_name = {node.name: node for node in primaries.values()}
            self._table = (cache, table, [by_name[n] for n in names])
        return self._table[1], self._table[2]

    def map_digest(self) -> tuple[bytes, tuple[str, ...]]:
        """What the slot map says (slot -> primary), to compare with what it said before: unlike ``map_mark``,
        the same after redis-py learnt the same map again, from whichever node (the primaries in name order)."""
        table, primaries = self.slot_table()
        if self._digest is None or self._digest[0] is not table:
            self._digest = (table, canonical_table(table, [n.name for n in primaries]))
        return self._digest[1]

    def forget_table(self) -> None:
        self._table = None
        self._forgets += 1

    def map_mark(self) -> tuple[int, Any, int]:
        """What routing knows of the slot map now; ``map_moved`` says whether it has learnt anything since,
        ``routed_since`` whether commands went through redis-py's routing since."""
        return self._forgets, self.client.nodes_manager.slots_cache, self._routed

    def map_moved(self, mark: tuple[int, Any, int]) -> bool:
        """Whether slots were found moved, or redis-py learnt the slot map again, since ``mark``: a failover
        or a reshard may then have put a key written before it on another primary than the one written to."""
        return mark[0] != self._forgets or mark[1] is not self.client.nodes_manager.slots_cache

    def routed_since(self, mark: tuple[int, Any, int]) -> bool:
        """Whether commands went through redis-py's routing since ``mark``: which primaries they reached is
        then not known here (a redirect redis-py followed), and a barrier must ask every primary."""
        return mark[2] != self._routed

    async def request_keys_by_primary(self, request_keys: Sequence[int], prefix: str = "") -> \
            tuple[dict[str, tuple[Any, list[int]]], list[int]]:
        """Positions of request keys (llm-d's names: the decimal value, no tag; with ``prefix``, keys named
        the prefix and the value, such as ``engine:<ek>``) per primary serving each (primary name -> (node,
        positions), in order), and the positions whose slot no primary serves now. Slots come from C through
        the slot -> primary table (kv_preflight/index/slots.py): ~20 ns a key, where ``by_primary`` pays
        Python's CRC16 and a dict lookup per key."""
        await self.ready()
        table, nodes = self.slot_table()
        groups = slot_groups(request_keys, table, len(nodes), prefix)
        return {node.name: (node, idx) for node, idx in zip(nodes, groups) if idx}, groups[-1]

    async def reread_map(self) -> None:
        """Learn the slot map again (at most twice a second) after a primary failed to answer."""
        if time.monotonic() - self._map_read_at < 0.5:
            return
        self._map_read_at = time.monotonic()
        try:
            await self.client.nodes_manager.initialize()
        except VALKEY_ERRORS:
            pass  # no node answers now; the next failure tries again

    async def script_on(self, node, script, args: list[Any]) -> Any:
        """A script on one primary, with no declared keys: on its lean connection, else through redis-py
        (loading the script if the node does not know it)."""
        fast = self.fast_for(node)
        if fast is not None:
            try:
                async with asyncio.timeout(fast.timeout_s):
                    return await fast.evalsha(script.sha, script.script, args)
            except (*VALKEY_ERRORS, TimeoutError):
                await self.reread_map()  # a master gone (failover): redis-py's map is not told otherwise
                raise
        try:
            return await self.client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)
        except NoScriptError:
            await self.client.script_load(script.script)
            return await self.client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)

    async def numbered_by_primary(self, prefix: str, values: Sequence[int]) -> \
            tuple[dict[str, tuple[Any, list[int]]], list[int]]:
        """``request_keys_by_primary`` for keys named ``prefix`` and a decimal value, by name (``by_primary``)
        when a value is outside uint64, which the C routine refuses (a hand-made outbox entry)."""
        try:
            return await self.request_keys_by_primary(values, prefix)
        except OverflowError:
            return by_primary(self.client, (f"{prefix}{v}" for v in values))

    async def primaries_of(self, numbered: Iterable[tuple[str, Sequence[int]]]) -> list[Any] | None:
        """The primaries serving keys named a prefix and a decimal value (per group (prefix, values)), or None
        when some key's slot has no primary now."""
        nodes: dict[str, Any] = {}
        for prefix, values in numbered:
            groups, unserved = await self.numbered_by_primary(prefix, values)
            if unserved:
                return None
            nodes.update((name, node) for name, (node, _) in groups.items())
        return list(nodes.values())

    async def commands(self, commands: Sequence[tuple[Any, ...]], key_at: int = 1, *,
                       numbered: tuple[str, Sequence[int]] | None = None, resend: bool | None = None) -> list[Any]:
        """Commands, each routed by the key at position ``key_at`` (``HMGET <key> ...``), replies in order and
        error replies in place: grouped by primary, each group pipelined on that primary's lean connection,
        the primaries in parallel. A group whose primary did not answer, and a command refused as not its
        slot's, go again through redis-py's routing. Only for commands safe to send twice. ``numbered``:
        the commands' keys are (prefix, values), each key the prefix and the decimal value (request keys,
        ``engine:<ek>``), routed in C rather than by reading the names. ``resend``: whether every command can run
        twice after a lost connection (``FastConnection.pipeline``), when the caller knows."""
        out: list[Any] = [None] * len(commands)
        await self.ready()
        if numbered is not None:
            groups, unserved = await self.numbered_by_primary(*numbered)
        else:
            groups, unserved = by_primary(self.client, (text(c[key_at]) for c in commands))
        again: list[int] = list(unserved)
        # Whether the map is out of date: a slot with no primary in it, a primary that did not answer, a command
        # refused as not its slot's. A primary with no lean connection (TLS) is no such news: redis-py carries
        # its commands on the same map, and forgetting the map would make every cluster ack refuse
        # (``ClusterWrites._written_to``).
        stale = bool(unserved)

        async def one(node, idx: list[int]) -> None:
            nonlocal stale
            fast = self.fast_for(node)
            if fast is None:
                again.extend(idx)
                return
            try:
                async with asyncio.timeout(fast.timeout_s):
                    replies = await fast.pipeline([commands[i] for i in idx], resend=resend)
            except (*VALKEY_ERRORS, TimeoutError):
                again.extend(idx)
                stale = True
                return
            if not any(issubclass(t, ResponseError) for t in set(map(type, replies))):  # the usual: all in place
                for _ in map(out.__setitem__, idx, replies):
                    pass
                return
            for i, r in zip(idx, replies):
                if isinstance(r, ResponseError) and str(r).startswith(REDIRECTS):
                    again.append(i)
                    stale = True
                else:
                    out[i] = r

        await asyncio.gather(*(one(node, idx) for node, idx in groups.values()))
        if again:
            if stale:
                self.forget_table()  # a primary gone or a slot moved: the map redis-py learns now is the one to use
            self._routed += 1
            again.sort()
            async with self.client.pipeline(transaction=False) as pipe:
                for i in again:
                    pipe.execute_command(*commands[i])
                for i, r in zip(again, await pipe.execute(raise_on_error=False)):
                    out[i] = r
        return out

    async def close(self) -> None:
        for fast in self._fast.values():
            if fast is not None:
                await fast.close()
        self._fast.clear()


__all__ = ["REDIRECTS", "Shards", "by_primary", "cluster_client", "node_for", "over_tls", "probe_cluster", "writer_id"]
