"""Valkey Cluster backend: the write path without cross-slot scripts, and the sharded lookup.

A batch touches keys on many shards, so no script can apply it atomically. The guarantees are kept
another way (docs/architecture.md, "Valkey Cluster"):

1. **Pod step** (shared/lua/pod.lua with the apply_cluster.lua prelude), one script in the pod's
   slot (every per-pod key carries the ``{<pod>}`` hash tag): the seq check and every change to the
   pod's own state (reverse index, request-key refs, field ids, counters, seq) happen atomically,
   and the effects on shared keys are written to the pod's outbox in the same step and returned.
2. **Effects**, pipelined per shard: ``HSET``/``HDEL`` of the pod's field on request keys, ``HSET`` of
   the membership and ``ZADD`` for a linked engine key, a one-slot script that unlinks one (the engine key goes
   with the last member of ``kvpf:{engine:<key>}:pods``). Each is idempotent and commutes with every
   other pod's, so running an effect twice changes nothing; no count lives on a shared key.
3. **Ack**: the outbox entry is deleted.

An ingester killed between 1 and 3 leaves the entry; the next pod step of any ingester for that pod
answers "pending" (the entry is older than the takeover time) or "busy" (younger: its writer is
presumably running it), and the caller runs the entry first (``drain``). So nothing is lost and,
since the counts live only in the pod step, a retry never changes counts.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AskError, ClusterDownError, NoScriptError, ResponseError, TryAgainError

from shared.layout import engine_key_name, engine_members_key, pod_outbox_key

_unpack = msgspec.msgpack.Decoder()
TAKEOVER_MS = 2000  # an outbox entry older than this is run by whoever applies the pod's next batch


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


def effect_commands(payload: bytes) -> list[tuple[str, tuple[Any, ...]]]:
    """An outbox entry's effects as commands, in order (pure; see the module docstring).
    ("UNLINK" stands for the one-slot unlink script.)"""
    items = _unpack.decode(payload)
    out: list[tuple[str, tuple[Any, ...]]] = []
    i = 0
    while i < len(items):
        op = items[i]
        if op == "L":
            ek, member, n = items[i + 1], items[i + 2], int(items[i + 3])
            rks = items[i + 4:i + 4 + n]
            out.append(("HSET", (engine_members_key(ek), member, 1)))
            if rks:
                pairs: list[Any] = []
                for pos, rk in enumerate(rks):
                    pairs += [pos, rk]
                out.append(("ZADD", (engine_key_name(ek), *pairs)))
            i += 4 + n
        elif op == "U":
            out.append(("UNLINK", (items[i + 1], items[i + 2])))
            i += 3
        elif op == "H":
            out.append(("HSET", (items[i + 1], items[i + 2], "")))
            i += 3
        elif op == "D":
            out.append(("HDEL", (items[i + 1], items[i + 2])))
            i += 3
        else:
            raise ValueError(f"unknown effect {op!r} in an outbox entry")
    return out


class ReplicationBarrier:
    """Whether the writes sent so far to some shards have reached a replica of each (WAIT).

    Replication is asynchronous, so a master killed right after our effects can take them with it;
    its promoted replica would then lack them. An outbox entry is deleted only after every shard its
    effects touched confirms a replica has everything up to a later write of ours (the replication
    stream is ordered, and WAIT counts this connection's last write): so effects lost in a failover
    belong to entries still in the outbox, and they run again on the new master.
    """

    def __init__(self, client: RedisCluster, timeout_ms: int = 200):
        self.client = client
        self.timeout_ms = timeout_ms
        self._conns: dict[str, Any] = {}
        self._keys: dict[str, str] = {}

    def _barrier_key(self, node) -> str:
        """A key of ours (a HASH, like every key of ours) in a slot this node owns."""
        key = self._keys.get(node.name)
        if key is None or self.client.get_node_from_key(key) is not node:
            for i in range(100_000):
                key = f"kvpf:{{b{i}}}:barrier"
                if self.client.get_node_from_key(key) is node:
                    break
            self._keys[node.name] = key
        return key

    def _conn(self, node):
        conn = self._conns.get(node.name)
        if conn is None:
            import redis.asyncio as aioredis

            kw = node.connection_kwargs
            conn = aioredis.Redis(host=node.host, port=node.port, username=kw.get("username"),
                                  password=kw.get("password"), socket_timeout=max(1.0, 2 * self.timeout_ms / 1000),
                                  socket_connect_timeout=kw.get("socket_connect_timeout") or 1.0,
                                  ssl="SSL" in type(node).__name__ or "SSL" in getattr(node.connection_class, "__name__", ""))
            self._conns[node.name] = conn
        return conn

    def _has_replicas(self, key: str) -> bool:
        """Whether the cluster's topology gives this key's shard a replica (a shard without one has
        nothing to wait for; one whose replica is only disconnected now must wait)."""
        holders = self.client.nodes_manager.slots_cache.get(self.client.keyslot(key)) or []
        return len(holders) > 1

    async def _one(self, node) -> bool:
        key = self._barrier_key(node)
        if not self._has_replicas(key):
            return True
        try:
            async with self._conn(node).pipeline(transaction=False) as pipe:
                pipe.hset(key, "t", "1")
                pipe.execute_command("WAIT", 1, self.timeout_ms)
                _, acked = await pipe.execute()
        except ResponseError as exc:
            moved = isinstance(exc, (AskError, TryAgainError, ClusterDownError))  # redis-py strips the code
            if moved or str(exc).startswith(("MOVED", "ASK", "TRYAGAIN")):  # the slot moved (resharding, failover):
                self._keys.pop(node.name, None)  # learn the map again; the entry is confirmed next time
                await self.client.nodes_manager.initialize()
                return False
            raise
        return int(acked) >= 1

    async def confirm(self, keys: Iterable[str]) -> bool:
        nodes = {}
        for k in keys:
            node = self.client.get_node_from_key(k)
            nodes[node.name] = node
        if not nodes:
            return True
        results = await asyncio.gather(*(self._one(n) for n in nodes.values()), return_exceptions=True)
        return all(r is True for r in results)

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.aclose()
        self._conns.clear()


class ClusterEffects:
    """Runs outbox entries on their shards (step 2) and deletes them once replicated (step 3)."""

    def __init__(self, client: RedisCluster, unlink_script: str, *, writer: str = ""):
        self.client = client
        self.writer = writer
        self._unlink = client.register_script(unlink_script)
        self.barrier = ReplicationBarrier(client)

    async def run(self, entries: Sequence[tuple[str, str, bytes]]) -> tuple[int, str, list[str]]:
        """Run (pod, outbox field, payload) entries in order. Returns how many effects hit a key of a
        foreign type (skipped: each effect stands alone), the first such error, and the keys touched."""
        if not entries:
            return 0, "", []
        commands = [c for _pod, _field, payload in entries for c in effect_commands(payload)]
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for cmd, args in commands:
                if cmd == "UNLINK":
                    ek, member = args
                    pipe.execute_command("EVALSHA", self._unlink.sha, 2, engine_members_key(ek), engine_key_name(ek),
                                         member)
                else:
                    pipe.execute_command(cmd, *args)
            replies = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self.client.script_load(self._unlink.script)  # every primary; all effects are idempotent
                continue
            break
        foreign, first = 0, ""
        for r in replies:
            if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
                foreign += 1
                first = first or str(r)[:120]
            elif isinstance(r, Exception):
                raise r
        touched = [engine_members_key(a[0]) if cmd == "UNLINK" else str(a[0]) for cmd, a in commands]
        return foreign, first, touched

    async def ack(self, entries: Sequence[tuple[str, str, bytes]], touched: Iterable[str]) -> bool:
        """Delete the entries once every shard their effects touched has them on a replica; False
        (entries kept, to run again later) when one has not confirmed in time."""
        if not entries:
            return True
        if not await self.barrier.confirm(touched):
            return False
        pipe = self.client.pipeline(transaction=False)
        for pod, field, _ in entries:
            pipe.hdel(pod_outbox_key(pod), field)
        await pipe.execute()
        return True

    async def drain(self, pod: str, *, older_than_ms: int = 0) -> int:
        """Run the entries left in a pod's outbox, oldest first: every entry of this writer (which is not
        running any other batch meanwhile), and other writers' entries (a crashed or stalled writer's)
        once at least ``older_than_ms`` old (Valkey's clock). Stops at the first entry it must not run
        yet, since effects of one pod must run in order."""
        raw = await self.client.hgetall(pod_outbox_key(pod))
        if not raw:
            return 0
        entries = sorted((int(f.split(b"|", 1)[0]), f.decode(), v) for f, v in raw.items())
        if older_than_ms:
            sec, usec = await self.client.time()
            now_ms = sec * 1000 + usec // 1000
            keep = []
            for n, f, v in entries:
                _, writer, ms = f.split("|", 2)
                if writer != self.writer and now_ms - int(ms) < older_than_ms:
                    break
                keep.append((n, f, v))
            entries = keep
        todo = [(pod, f, v) for _, f, v in entries]
        _, _, touched = await self.run(todo)
        await self.ack(todo, touched)
        return len(todo)

    async def close(self) -> None:
        await self.barrier.close()


__all__ = ["ClusterEffects", "ReplicationBarrier", "TAKEOVER_MS", "cluster_client", "effect_commands", "probe_cluster", "writer_id"]
