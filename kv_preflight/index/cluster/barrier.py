"""Whether our writes to some shards of a Valkey Cluster have reached a replica of each (WAIT).

Replication is asynchronous, so a master killed right after a batch's changes can take them with it; its
promoted replica would then lack them. An outbox entry is deleted only after every shard its changes touched
confirms a replica has everything up to a later write of ours (the replication stream is ordered, and WAIT
counts this connection's last write): so changes lost in a failover belong to entries still in the outbox, and
they run again on the new master (kv_preflight/index/cluster/writes.py).
"""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AskError, ClusterDownError, ResponseError, TryAgainError

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.cluster.routing import over_tls
from kv_preflight.index.layout import barrier_key

# The TLS settings a redis-py client takes (ssl_ca_certs, ssl_certfile, ...), as its cluster nodes hold them
_TLS_ARGS = frozenset(p for p in inspect.signature(aioredis.Redis.__init__).parameters if p.startswith("ssl_"))


TOPOLOGY_TTL_S = 5.0  # how long the barrier trusts a node's table of replicas
# How long a replica marked failed is still waited for, from the last time it answered its master (pong-recv
# in the master's CLUSTER NODES, compared with the master's own clock). A replica cut off from its master may be
# promoted with what it had while its data age passes Valkey's check: node timeout x
# cluster-replica-validity-factor + repl-ping-replica-period, over the node timeout, from when it noticed the
# link gone (up to repl-timeout, 60 s, after its last contact): 15 s x 10 + 10 s + 15 s + 60 s = 235 s with
# Valkey's defaults.
# Writes acknowledged without it would be lost in that promotion with no outbox entry to run them again. Not
# covered, and not bounded by any wait: a replica paused (its data age counts from when it resumes) or a
# validity factor of 0, where Valkey promotes a replica however long it was gone; that is the double fault
# (the replica out, then its master dead) asynchronous replication cannot cover.
FAILED_REPLICA_GRACE_S = 240.0


def live_replicas(cluster_nodes: str, now_ms: float | None = None, grace_ms: float | None = None) -> int:
    """How many replicas of the node that answered (its line says "myself") are to be waited for, from the
    text of CLUSTER NODES: those not marked failed, and those marked failed that answered (pong received)
    within ``grace_ms`` (``FAILED_REPLICA_GRACE_S``) of ``now_ms`` (the node's clock, ms: TIME; this host's
    when not given). A replica suspected down ("fail?") counts: it may be back any moment, and a write it has
    not acknowledged is not confirmed; so does one marked failed a moment ago (a replica cut off or stalled
    past the node timeout), which may be back and promoted before it has caught up (the failover test lost
    writes under load that way once: its held replica had been marked failed; tests/integration/
    test_cluster.py reproduces the path, the slot map read again meanwhile)."""
    if grace_ms is None:
        grace_ms = FAILED_REPLICA_GRACE_S * 1000
    now = time.time() * 1000 if now_ms is None else now_ms
    rows = [line.split() for line in cluster_nodes.splitlines() if line.strip()]
    me = next((r[0] for r in rows if len(r) > 2 and "myself" in r[2].split(",")), None)
    if me is None:
        return 0

    def waited(r: list[str]) -> bool:
        flags = set(r[2].split(","))
        if not {"slave", "replica"} & flags:
            return False
        if "fail" not in flags:
            return True
        pong = int(r[5]) if len(r) > 5 and r[5].isdigit() else 0
        return pong > 0 and now - pong < grace_ms

    return sum(1 for r in rows if len(r) > 3 and r[3] == me and waited(r))


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
        self._replicas: dict[str, tuple[float, bool]] = {}  # node -> (read at, has a replica to wait for)

    def _barrier_key(self, node) -> str:
        """A key of ours (a HASH, like every key of ours) in a slot this node owns."""
        key = self._keys.get(node.name)  # by name: redis-py makes new node objects each time it reads the map
        if key is None or self.client.get_node_from_key(key).name != node.name:
            for i in range(100_000):
                key = barrier_key(i)
                if self.client.get_node_from_key(key).name == node.name:
                    break
            self._keys[node.name] = key
        return key

    def _conn(self, node):
        """A connection of the barrier's own to a primary (WAIT counts its last write), with the cluster
        client's credentials (or credential provider) and, over TLS, its TLS settings (CA, client certificate,
        hostname check): without them the handshake fails, and a node's replicas would read as none (nothing
        to wait for)."""
        conn = self._conns.get(node.name)
        if conn is None:
            kw = node.connection_kwargs
            tls = over_tls(node)
            conn = aioredis.Redis(host=node.host, port=node.port, username=kw.get("username"),
                                  password=kw.get("password"), credential_provider=kw.get("credential_provider"),
                                  socket_timeout=max(1.0, 2 * self.timeout_ms / 1000),
                                  socket_connect_timeout=kw.get("socket_connect_timeout") or 1.0, ssl=tls,
                                  **({k: v for k, v in kw.items() if k in _TLS_ARGS} if tls else {}))
            self._conns[node.name] = conn
        return conn

    async def _has_replicas(self, node, key: str) -> bool:
        """Whether the shard has a replica to wait for (a shard without one has nothing to wait for; one
        whose replica is only disconnected now must wait): the slot map lists one, or the node's own table
        does (CLUSTER NODES, read again every ``TOPOLOGY_TTL_S``; a replica marked failed counts for
        ``FAILED_REPLICA_GRACE_S`` after it last answered, ``live_replicas``). The table
        is needed because CLUSTER SLOTS leaves out a replica that has received nothing yet (offset 0): a
        client that learned the map before a new cluster's first write would never wait at all. The map
        is kept because it goes on listing a replica that failed since it was read, so the writes of a
        replica's outage stay in the outbox (as the failover repair needs) until the map is read again."""
        holders = self.client.nodes_manager.slots_cache.get(self.client.keyslot(key)) or []
        if len(holders) > 1:
            return True
        now = time.monotonic()
        hit = self._replicas.get(node.name)
        if hit is not None and now - hit[0] < TOPOLOGY_TTL_S:
            return hit[1]
        try:
            # two words: "CLUSTER NODES" as one would get redis-py's parsed dict, this the node's text
            async with self._conn(node).pipeline(transaction=False) as pipe:
                pipe.execute_command("CLUSTER", "NODES")
                pipe.execute_command("TIME")  # its clock, which its pong times are in
                table, clock = await pipe.execute()
        except VALKEY_ERRORS:
            return True  # not known: wait, and a node that does not answer confirms nothing (fail closed)
        if not isinstance(table, (bytes, str)):
            return False
        now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
        has = live_replicas(table.decode() if isinstance(table, bytes) else table, now_ms) > 0
        self._replicas[node.name] = (now, has)
        return has

    async def _one(self, node) -> bool:
        key = self._barrier_key(node)
        if not await self._has_replicas(node, key):
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

    async def incarnations(self, nodes: Iterable[Any]) -> dict[str, tuple[str, str] | None]:
        """Per primary (by name): which run of which dataset it is now, (``run_id``, ``master_replid``), from
        INFO; None when it did not answer or is not a master now. A restart changes the run id (and with no
        persistence, the data), a promotion the replication id: then what it was sent before may not be there,
        whatever a WAIT says now."""
        nodes = list(nodes)

        async def one(node) -> tuple[str, str] | None:
            info = await self._conn(node).execute_command("INFO", "server", "replication")
            if info.get("role") != "master":
                return None
            return str(info["run_id"]), str(info["master_replid"])

        results = await asyncio.gather(*(one(n) for n in nodes), return_exceptions=True)
        return {n.name: None if isinstance(r, BaseException) else r for n, r in zip(nodes, results)}

    async def confirm(self, nodes: Iterable[Any]) -> bool:
        """Whether each of these primaries (the ones our writes went to) has them on a replica."""
        results = await asyncio.gather(*(self._one(n) for n in nodes), return_exceptions=True)
        return all(r is True for r in results)

    async def close(self) -> None:
        for conn in self._conns.values():
            await conn.aclose()
        self._conns.clear()


__all__ = ["FAILED_REPLICA_GRACE_S", "ReplicationBarrier", "TOPOLOGY_TTL_S", "live_replicas"]
