"""Valkey Cluster backend: the write path without cross-slot scripts, and the sharded lookup.

A batch touches keys on many shards, so no script can apply it atomically. The guarantees are kept
another way (docs/architecture.md, "Valkey Cluster"):

1. **Pod step** (kv_preflight/index/lua/pod.lua with the apply_cluster.lua prelude), one script in the pod's
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
import logging
from bisect import bisect_left
import os
import socket
import time
import uuid
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AskError, ClusterDownError, NoScriptError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import SlotNotCoveredError

from kv_preflight.index import scripts
from kv_preflight.index.backend import VALKEY_ERRORS, evalsha_pipeline, ready
from kv_preflight.index.entries import ApplyResult, Lookup, PodMatch, apply_result, better_tier, parse_entry, text
from kv_preflight.keys.chain import pack_keys
from kv_preflight.index.layout import (engine_key_name, engine_members_key, pod_meta_key, pod_outbox_key, request_bits_key,
                                        request_key_name)
from kv_preflight.index.presence import (OUR_COUNT, BitsReply, NamesFor, TierRuns, bits_of, chain_of_one_tier, mask_of,
                                         numbers_in, parse_bits_reply, prefix_from_bits, prefix_of_one_tier, tier_in,
                                         tier_in_runs)
from kv_preflight.index.resp import FastConnection, script_sha
from kv_preflight.index.slots import key_slot, slot_groups, slot_table

_unpack = msgspec.msgpack.Decoder()
log = logging.getLogger("kvpf.index")
TAKEOVER_MS = 2000  # an outbox entry older than this is run by whoever applies the pod's next batch
# A shard walks its keys exactly (every field read, as the linear walk) while that reads at most this
# many fields, then bisects (kv_preflight/index/lua/lookup.lua). 0: bisect from the shard's first key, as the single
# node does. Measured (docs/benchmarks.md): an exact walk of up to 512 fields cost the 32K-token predict
# p50 10.5 ms against 6.1 ms, for an exactness the bisection lacks only while a batch is half applied
# (its effects on some shards, not yet on others), where either answer lies between the index before and
# after that batch. ``mode="linear"`` walks exactly.
EXACT_BUDGET = 0


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


def effect_list(payload: bytes) -> list[tuple[str, str, list[Any]]]:
    """An outbox entry's effects, in order, as (op, the key that decides its shard, its flat
    arguments as the effects script takes them) (pure; see the module docstring)."""
    items = _unpack.decode(payload)
    out: list[tuple[str, str, list[Any]]] = []
    i = 0
    while i < len(items):
        op = items[i]
        if op == "L":
            n = int(items[i + 3])
            out.append((op, engine_members_key(items[i + 1]), items[i:i + 4 + n]))
            i += 4 + n
        elif op == "U":
            out.append((op, engine_members_key(items[i + 1]), items[i:i + 3]))
            i += 3
        elif op in ("H", "D"):
            out.append((op, str(items[i + 1]), items[i:i + 3]))
            i += 3
        elif op in ("P", "Q"):
            out.append((op, request_bits_key(items[i + 1]), items[i:i + 4]))
            i += 4
        elif op in ("J", "K"):
            out.append((op, str(items[i + 1]), items[i:i + 5]))
            i += 5
        else:
            raise ValueError(f"unknown effect {op!r} in an outbox entry")
    return out


def effect_commands_of(flat: Sequence[Any]) -> list[tuple[str, tuple[Any, ...]]]:
    """One effect's flat arguments as plain commands ("UNLINK" and "SLOT" stand for one-slot scripts)."""
    op = flat[0]
    if op == "L":
        ek, member, n = flat[1], flat[2], int(flat[3])
        out: list[tuple[str, tuple[Any, ...]]] = [("HSET", (engine_members_key(ek), member, 1))]
        if n:
            pairs: list[Any] = []
            for pos, rk in enumerate(flat[4:4 + n]):
                pairs += [pos, rk]
            out.append(("ZADD", (engine_key_name(ek), *pairs)))
        return out
    if op == "U":
        return [("UNLINK", (flat[1], flat[2]))]
    # the one-slot script (kv_preflight/index/lua/bit_effect.lua): request key, field, on, tier, number
    if op in ("P", "Q"):
        return [("SLOT", (flat[1], "", 1 if op == "P" else 0, flat[2], flat[3]))]
    if op in ("J", "K"):
        return [("SLOT", (flat[1], flat[2], 1 if op == "J" else 0, flat[3], flat[4]))]
    return [("SLOT", (flat[1], flat[2], 1 if op == "H" else 0, "", 0))]  # H, D: the entry and its count


TOPOLOGY_TTL_S = 5.0  # how long the barrier trusts a node's table of replicas


def live_replicas(cluster_nodes: str) -> int:
    """How many replicas of the node that answered (its line says "myself") are not marked failed, from
    the text of CLUSTER NODES. A replica suspected down ("fail?") still counts: it may be back any moment,
    and a write it has not acknowledged is not confirmed."""
    rows = [line.split() for line in cluster_nodes.splitlines() if line.strip()]
    me = next((r[0] for r in rows if len(r) > 2 and "myself" in r[2].split(",")), None)
    if me is None:
        return 0
    return sum(1 for r in rows if len(r) > 3 and r[3] == me and "fail" not in r[2].split(",")
               and {"slave", "replica"} & set(r[2].split(",")))


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
                                  ssl="SSL" in node.connection_class.__name__)
            self._conns[node.name] = conn
        return conn

    async def _has_replicas(self, node, key: str) -> bool:
        """Whether the shard has a replica to wait for (a shard without one has nothing to wait for; one
        whose replica is only disconnected now must wait): the slot map lists one, or the node's own table
        does (CLUSTER NODES, read again every ``TOPOLOGY_TTL_S``, replicas not marked failed). The table
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
            table = await self._conn(node).execute_command("CLUSTER", "NODES")
        except VALKEY_ERRORS:
            return False  # as the slot map says; read again next time
        if not isinstance(table, (bytes, str)):
            return False
        has = live_replicas(table.decode() if isinstance(table, bytes) else table) > 0
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

    async def confirm(self, keys: Iterable[str]) -> bool:
        nodes = {}
        for k in keys:
            node = node_for(self.client, k)  # redis-py's get_node_from_key: ~10 µs of Python a key
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

    def __init__(self, client: RedisCluster, unlink_script: str, *, writer: str = "",
                 fast_for: Callable[[Any], FastConnection | None] | None = None):
        self.client = client
        self.writer = writer
        self.fast_for = fast_for  # a primary's lean connection (None: redis-py carries the effects)
        self._unlink = client.register_script(unlink_script)
        self._effects = client.register_script(scripts.EFFECTS_SHARD)
        self._bit = client.register_script(scripts.BIT_EFFECT)
        self.barrier = ReplicationBarrier(client)

    async def run(self, entries: Sequence[tuple[str, str, bytes]]) -> tuple[int, str, list[str]]:
        """Run (pod, outbox field, payload) entries in order: one script per shard with that shard's
        effects (in order), the shards in parallel; effects whose key moved meanwhile go again through
        the cluster's routing. Returns how many effects hit a key of a foreign type (skipped: each
        effect stands alone), the first such error, and the keys touched."""
        if not entries:
            return 0, "", []
        effects = [e for _pod, _field, payload in entries for e in effect_list(payload)]
        by_node, moved = by_primary(self.client, (key for _, key, _ in effects))

        async def shard(node, idx: list[int]) -> tuple[int, str]:
            args = [a for i in idx for a in effects[i][2]]
            fast = self.fast_for(node) if self.fast_for is not None else None
            if fast is not None:  # packed in C: redis-py's Python packing was most of a cluster batch's time
                try:
                    async with asyncio.timeout(fast.timeout_s):
                        reply = await fast.evalsha(self._effects.sha, self._effects.script, args)
                except TimeoutError:
                    raise RedisConnectionError(f"{node.name} did not answer the effects in time") from None
            else:
                try:
                    reply = await self.client.execute_command("EVALSHA", self._effects.sha, 0, *args, target_nodes=node)
                except NoScriptError:
                    await self.client.script_load(self._effects.script)
                    reply = await self.client.execute_command("EVALSHA", self._effects.sha, 0, *args, target_nodes=node)
            moved.extend(idx[int(p) - 1] for p in text(reply[0]).split(",") if p)
            return int(reply[1]), text(reply[2])

        foreign, first = 0, ""
        results = await asyncio.gather(*(shard(n, idx) for n, idx in by_node.values()), return_exceptions=True)
        for (_, idx), res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, VALKEY_ERRORS):
                    raise res
                moved.extend(idx)  # that shard did not answer: through the routing, which may have news
            else:
                foreign += res[0]
                first = first or res[1]
        if moved:
            f, fst = await self._run_routed([effects[i] for i in sorted(moved)])
            foreign, first = foreign + f, first or fst
        return foreign, first, [key for _, key, _ in effects]

    async def _run_routed(self, effects: Sequence[tuple[str, str, list[Any]]]) -> tuple[int, str]:
        """Effects as plain commands through the cluster's routing (MOVED/ASK followed), in order."""
        commands = [c for _op, _key, flat in effects for c in effect_commands_of(flat)]
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for cmd, args in commands:
                if cmd == "UNLINK":
                    ek, member = args
                    pipe.execute_command("EVALSHA", self._unlink.sha, 2, engine_members_key(ek), engine_key_name(ek),
                                         member)
                elif cmd == "SLOT":
                    pipe.execute_command("EVALSHA", self._bit.sha, 2, request_bits_key(args[0]), args[0], *args)
                else:
                    pipe.execute_command(cmd, *args)
            replies = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                await self.client.script_load(self._unlink.script)  # every primary; all effects are idempotent
                await self.client.script_load(self._bit.script)
                continue
            break
        foreign, first = 0, ""
        for r in replies:
            if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
                foreign += 1
                first = first or str(r)[:120]
            elif isinstance(r, Exception):
                raise r
        return foreign, first

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


class ClusterBackend:
    """Valkey Cluster: the write path of the module docstring, and a lookup of one pipelined HKEYS
    request per shard, the shards in parallel."""

    cluster = True

    def __init__(self, client: RedisCluster, *, writer: str | None = None, takeover_ms: int = TAKEOVER_MS):
        self.client = client
        self.writer = writer or writer_id()
        self.takeover_ms = takeover_ms
        self._apply = client.register_script(scripts.APPLY_CLUSTER)
        self._lookup = client.register_script(scripts.LOOKUP)
        self._lookup_bits = client.register_script(scripts.LOOKUP_BITS)
        self._fast: dict[str, FastConnection | None] = {}  # primary -> its lean connection (None: TLS)
        self._map_read_at = 0.0
        self._table: tuple[Any, bytes, list[Any]] | None = None  # (the slot map it was built from, table, primaries)
        # first request key of a chain -> the pods a shard bisected on it last time: their meta is read beside
        # the shards' round when the chain comes again (a prompt's prefix is looked up many times), so the
        # check that they may be bisected costs no round of its own (bounded, oldest dropped first)
        self._bisected_at: dict[int, frozenset[str]] = {}
        self.effects = ClusterEffects(client, scripts.UNLINK_ENGINE, writer=self.writer_arg(), fast_for=self._fast_for)
        self.unreplicated = 0  # runs whose effects a replica had not confirmed in time (kept in the outbox)
        self.gap_walks = 0  # pods a lookup walked key by key rather than bisected (orphan keys, a pending gap)
        # default lookups that read after the walk (a 4th round): a tier the merge wanted and no round had read
        # (a shard failed the walk, which moves the cut), or the keys of a shard whose walk found a key moved
        # (resharding); tests check it stays 0 otherwise
        self.late_reads = 0
        # A testing hook for the crash tests (tests/integration/test_cluster.py): "pod_step:N" or
        # "effects:N" ends the process (exit 137, as kill -9 would) right after the step that holds the
        # N-th batch.
        self._crash_at = _crash_point(os.environ.get("KVPF_TEST_CRASH_AT", ""))

    def writer_arg(self) -> str:
        return f"{self.writer}@{self.takeover_ms}"

    async def send(self, pods: Sequence[str], keys: Sequence[Sequence[str]],
                   args: Sequence[Sequence[Any]]) -> "asyncio.Future[list[ApplyResult]]":
        return ready(await self._apply_all(pods, keys, args))

    async def _apply_all(self, pods: Sequence[str], keys: Sequence[Sequence[str]],
                         args: Sequence[Sequence[Any]]) -> list[ApplyResult]:
        """Pod steps (pipelined, each in its pod's slot), then the effects of the applied ones on their
        shards, then the acks. A pod whose outbox holds another writer's entry is retried after that
        entry ran ("pending": run it now) or its writer had time to ("busy")."""
        results: list[ApplyResult | None] = [None] * len(pods)
        todo = list(range(len(pods)))
        deadline = time.monotonic() + 2 * self.takeover_ms / 1000 + 5
        while todo:
            replies = await self._pod_steps([keys[i] for i in todo], [args[i] for i in todo])
            entries: list[tuple[str, str, bytes]] = []
            ackable: list[tuple[str, str, bytes]] = []
            held_back: set[str] = set()  # pods with an older entry of ours still there: ack in order
            owners: list[int] = []
            again: list[int] = []
            drain: set[str] = set()
            blocked: set[str] = set()
            for i, r in zip(todo, replies):
                status = text(r[0])
                if pods[i] in blocked or status in ("busy", "pending"):
                    blocked.add(pods[i])  # this pod's later batches wait too: order within a pod
                    again.append(i)
                    if status == "pending":
                        drain.add(pods[i])
                    continue
                results[i] = apply_result(r[:4])
                if len(r) > 4:
                    entry = (pods[i], text(r[4]), r[5])
                    entries.append(entry)
                    owners.append(i)
                    if int(r[6]) > 0 or pods[i] in held_back:
                        held_back.add(pods[i])
                    else:
                        ackable.append(entry)
            self._maybe_crash("pod_step", len(entries))
            if entries:
                foreign, first, touched = await self.effects.run(entries)
                self._maybe_crash("effects", len(entries))
                # Deleted only once replicated (else they run again after a failover); a pod's
                # entries behind one of ours still there wait for the next drain, in order.
                if not await self.effects.ack(ackable, touched):
                    self.unreplicated += 1
                if foreign:
                    await self._flag_foreign(entries, foreign, first)
                    for i in owners:
                        res = results[i]
                        assert res is not None
                        results[i] = ApplyResult(res.status, res.last_seq, res.foreign_writes + foreign, first)
            for pod in sorted(drain):
                await self.effects.drain(pod)
            if again:
                if time.monotonic() > deadline:
                    raise RedisConnectionError(f"pods {sorted(blocked)[:5]} stayed busy: another ingester's "
                                               "outbox entries did not run")
                if not drain:
                    await asyncio.sleep(0.05)
            todo = again
        return [r for r in results if r is not None]

    async def _pod_steps(self, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> list[Any]:
        """The pod steps, pipelined per primary on its lean connection (packed in C), primaries in
        parallel; a step the primary refused as not its slot's (MOVED/ASK/TRYAGAIN during resharding or a
        failover), and every step of a primary that did not answer, goes again through redis-py's routing,
        in order. Running one again is safe: the seq check answers "dup" for a batch already applied, and
        a pod's later batches fail on the same slot as its earlier ones, so order within a pod holds."""
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()
        by_node, routed = by_primary(self.client, (k[0] for k in keys))  # a pod's keys share its slot
        out: list[Any] = [None] * len(keys)

        async def on_node(node, idx: list[int]) -> None:
            fast = self._fast_for(node)
            if fast is None:
                routed.extend(idx)
                return
            commands = [("EVALSHA", self._apply.sha, len(keys[i]), *keys[i], *args[i]) for i in idx]
            try:
                async with asyncio.timeout(fast.timeout_s):
                    replies = await fast.pipeline(commands)
                    if any(isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT") for r in replies):
                        await fast.execute("SCRIPT", "LOAD", self._apply.script)  # none ran: all again
                        replies = await fast.pipeline(commands)
            except (*VALKEY_ERRORS, TimeoutError):
                await self._reread_map()
                routed.extend(idx)  # the seq check makes a step that did run answer "dup" when sent again
                return
            for i, r in zip(idx, replies):
                if isinstance(r, ResponseError) and str(r).split(" ", 1)[0] in _REDIRECTS:
                    routed.append(i)
                elif isinstance(r, Exception):
                    raise r
                else:
                    out[i] = r

        await asyncio.gather(*(on_node(n, idx) for n, idx in by_node.values()))
        if routed:
            routed.sort()
            for i, r in zip(routed, await evalsha_pipeline(self.client, self._apply, [keys[i] for i in routed],
                                                            [args[i] for i in routed])):
                out[i] = r
        return out

    def _maybe_crash(self, point: str, batches: int) -> None:
        """Counts batches, not calls: under load the ingester sends several batches in one call, and a
        count of calls would then never reach N (the crash tests' ingester ran on to the end)."""
        if self._crash_at is not None and batches and self._crash_at[0] == point:
            self._crash_at[1] -= batches
            if self._crash_at[1] <= 0:
                log.error("KVPF_TEST_CRASH_AT: exiting after %s", point)
                os._exit(137)

    async def _flag_foreign(self, entries: Sequence[tuple[str, str, bytes]], n: int, first: str) -> None:
        """Effects that hit a key of a foreign type stand alone (skipped); their pods are flagged."""
        pipe = self.client.pipeline(transaction=False)
        for pod in {e[0] for e in entries}:
            pipe.hset(pod_meta_key(pod), mapping={"incomplete": 1, "incomplete_reason":
                                                  f"{n} write(s) hit a key of a foreign type ({first})"})
            pipe.hincrby(pod_meta_key(pod), "foreign_keys", n)
        await pipe.execute()

    async def drain_outbox(self, pod_id: str, *, stale_only: bool) -> int:
        return await self.effects.drain(pod_id, older_than_ms=self.takeover_ms if stale_only else 0)

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None, mode: str) -> tuple[Lookup, int]:
        """One round: the lookup script (kv_preflight/index/lua/lookup.lua) on every shard, the shards in parallel,
        each on the chain's keys it owns, in chain order; it answers per pod how many of those it holds
        from the first, and ``merge_shards`` takes each pod's prefix to the first key any shard lacks
        it on. Each shard walks exactly while that reads at most ``EXACT_BUDGET`` fields, then bisects
        (``mode`` "linear": always exactly). A second round only when a key moved meanwhile (resharding,
        failover: that shard's keys are read whole through the cluster's routing) or, on a layout that
        is not a prefix per pod (a batch half applied), to read a pod's tier at its last key. A shard that
        does not answer (down with no replica to take over) leaves its keys unread, so each count is a
        lower bound and the answer says from which key."""
        budget = 1 << 62 if mode == "linear" else EXACT_BUDGET
        by_node, unanswered = await self._keys_by_node(request_keys)

        async def shard(node, idx: list[int]) -> tuple[int, bool, dict[str, tuple[int, str]]]:
            args = [len(idx), pack_keys([request_keys[i] for i in idx]), budget, *(pods or ())]
            reply = await self._on_shard(node, self._lookup, args)
            held = {text(reply[p]): (int(reply[p + 1]), text(reply[p + 2])) for p in range(2, len(reply), 3)}
            return int(reply[0]), bool(reply[1]), held

        shards: list[tuple[list[int], dict[str, tuple[int, str]]]] = []
        reread: list[int] = []
        foreign = 0
        for idx, res in await self._each_shard(by_node, shard, unanswered):
            if res[1]:
                reread.extend(idx)  # a key moved since the map was read: all its keys, through the routing
                self._table = None
                foreign += res[0]
            else:
                shards.append((idx, res[2]))
                foreign += res[0]
        read = await self._read_routed(request_keys, sorted(reread), pods, unanswered) if reread else {}
        return await self._merged(request_keys, shards, read, unanswered, pods), foreign

    async def lookup_bits(self, request_keys: Sequence[int], names: NamesFor) -> tuple[Lookup | None, int]:
        """The default lookup: lookup_bits.lua on every shard over the keys it owns, the shards in parallel;
        each sends its keys' bitmaps (put back in chain order and walked here once, when every shard did) or,
        where few pods hold its first key, per pod how many of its keys the pod holds from its first (bisected
        there), and ``merge_shards`` ends each pod's prefix at the first key any shard lacks it on.

        A bisected pod's count is exact only when its keys are closed under "parent" (pod meta "orphan_keys"
        is 0, kv_preflight/index/lua/pod.lua) at every version a shard may show (no outbox entry left from a step taken
        while they were not: "gap_entry"); the other pods are walked key by key. At most 3 sequential
        rounds, each one pipelined request per shard, the shards in parallel (issue 9 item 4):

        1. the script on every shard; beside it, the meta of the pods bisected when this chain's first key
           was last looked up (a prompt's prefix is looked up many times), on the pods' own shards;
        2. only when a shard bisected a pod whose meta round 1 did not read: that meta; beside it, the
           keys of a shard whose key moved meanwhile (resharding, failover), read through the routing;
        3. the pods that may not be bisected, walked on the shards that bisected them (each sends a
           walked pod's tier runs where its tier changes along its keys); beside the walk, the tiers the
           merge needs for the other pods, read whole: on a layout that is not a prefix per pod (a batch
           half applied) a pod's count on one shard can run past the key where another shard cut its
           prefix, and its tier at that key is not in the answer. A shard that sent its keys' bitmaps
           needs no read for that, and a walked pod's runs give its tier at any key it holds.

        The pod names (``names``) are a cache: a number not known yet reads ``kvpf:{nums}:byid`` once per
        process. A shard that does not answer cuts every prefix at its first key (counts are then lower
        bounds, never silently short). Two events during a resharding or a failover cost a 4th round,
        counted in ``late_reads``: a shard failing the walk (the cut moves, and the merge may want a tier no
        round read) and a walk finding a key moved that round 1 did not read (its shard's keys are then
        read through the routing). None when a shard's first key holds entries that are not ours (walk
        llm-d's entries then)."""
        by_node, unanswered = await self._keys_by_node(request_keys)
        guess = self._bisected_at.get(request_keys[0])
        early = asyncio.ensure_future(self.pods_with_gaps(guess)) if guess else None

        async def shard(node, idx: list[int], how: str = "") -> tuple[Any, BitsReply]:
            args = [len(idx), how, *(request_keys[i] for i in idx)]
            return node, parse_bits_reply(await self._on_shard(node, self._lookup_bits, args))

        replies: list[tuple[list[int], BitsReply]] = []
        bisected: list[tuple[Any, list[int], BitsReply]] = []
        reread: list[int] = []
        foreign = 0
        try:
            answered = await self._each_shard(by_node, shard, unanswered)
        except BaseException:
            if early is not None:
                _abandon(early)
            raise
        for idx, (node, res) in answered:
            foreign += res.foreign
            if res.moved:
                reread.extend(idx)  # a key moved since the map was read: all its keys, through the routing
                self._table = None
            elif res.kind == 2:
                if early is not None:
                    _abandon(early)
                return None, foreign
            else:
                replies.append((idx, res))
                if res.kind == 1 and res.counts:
                    bisected.append((node, idx, res))
        epoch = next((res.epoch for _, res in replies if res.epoch), "")
        read_bits: dict[int, dict[str, bytes]] = {}
        read_entries: dict[int, dict[str, str]] = {}
        if reread and not bisected:  # no pod's meta to read: the reread is round 2 alone
            read_bits, read_entries = await self._read_keys(request_keys, sorted(reread), unanswered)
            reread = []
        if all(res.kind == 0 for _, res in replies) and not read_entries:
            # Every shard sent its keys' bitmaps (a prefix many pods hold): put them back in chain order and
            # walk once, as a single node does, rather than walking each shard's keys and merging per pod
            # (three walks of a thousand pods). A key a shard did not send lies past the first key nobody
            # holds on that shard, where every prefix has ended, so it reads as empty. Only the pods at the
            # chain's first key can match: their names are the ones read.
            if not read_bits and all(res.flat is not None for _, res in replies):  # one tier a key: in C
                if unanswered and len(unanswered) == len(request_keys):
                    raise RedisConnectionError("no shard of the cluster answered the lookup")
                tiers, maps = chain_of_one_tier(len(request_keys), ((idx, res.flat) for idx, res in replies))
                cut = min(unanswered) if unanswered else None
                first = int.from_bytes(maps[0], "little") if cut != 0 else 0
                known = await names(first, epoch) if first else {}
                if early is not None:
                    _abandon(early)  # nothing was bisected: no pod's state matters
                return Lookup(prefix_of_one_tier(tiers, maps, known, cut), cut), foreign
            per_key: list[dict[str, bytes] | None] = [None] * len(request_keys)
            for idx, res in replies:
                for i, bits in zip(idx, res.reads):
                    per_key[i] = bits
            for i, bits in read_bits.items():
                per_key[i] = bits
            if unanswered and len(unanswered) == len(request_keys):
                raise RedisConnectionError("no shard of the cluster answered the lookup")
            cut = min(unanswered) if unanswered else None
            first = mask_of(per_key[0]) if per_key[0] and cut != 0 else 0
            known = await names(first, epoch) if first else {}
            if early is not None:
                _abandon(early)  # nothing was bisected: no pod's state matters
            return Lookup(prefix_from_bits(per_key, known, cut=cut), cut), foreign
        wanted = set()
        for _, res in replies:
            wanted.update(numbers_in(res.reads[0]) if res.kind == 0 and res.reads else [])
            wanted.update(num for num, _, _ in res.counts)
        known = await names(wanted, epoch) if wanted else {}
        bisected_pods = {known[num] for _, _, res in bisected for num, _, _ in res.counts if num in known}
        unread = bisected_pods - (guess or frozenset())
        # Round 2: the meta of the bisected pods round 1 did not read, beside the moved keys' reread.
        gaps = asyncio.ensure_future(self.pods_with_gaps(unread)) if unread else None
        rereading = asyncio.ensure_future(self._read_keys(request_keys, sorted(reread), unanswered)) if reread else None
        try:
            prefetched: set[str] = await early if early is not None else set()
            gapped = await gaps if gaps is not None else set()
            if rereading is not None:
                read_bits, read_entries = await rereading
        except BaseException:
            for task in (early, gaps, rereading):
                if task is not None:
                    _abandon(task)
            raise
        gapped |= prefetched & bisected_pods
        number_of: dict[str, int] = {}

        async def as_read(bits_at: dict[int, dict[str, bytes]], entries_at: dict[int, dict[str, str]]
                          ) -> dict[int, dict[str, str]]:
            """Keys read whole, as position -> pod -> tier (a number not named yet: the names read again)."""
            nonlocal known
            more = {num for bits in bits_at.values() for num in numbers_in(bits)} - set(known)
            if more:
                known = await names(wanted | more, epoch)
                number_of.clear()
            out = {i: {m.pod_id: m.tier for m in prefix_from_bits([bits], known)} for i, bits in bits_at.items()}
            out.update(entries_at)
            return out

        read = await as_read(read_bits, read_entries)
        if bisected_pods and self._bisected_at.get(request_keys[0]) != bisected_pods:
            if len(self._bisected_at) >= 4096:
                del self._bisected_at[next(iter(self._bisected_at))]
            self._bisected_at[request_keys[0]] = frozenset(bisected_pods)
        shards: list[tuple[list[int], dict[str, tuple[int, str | TierRuns]]]] = []
        for idx, res in replies:
            if res.kind == 0:
                held = {m.pod_id: (m.blocks, m.tier) for m in prefix_from_bits(res.reads, known)}
            else:
                held = {known[num]: (c, t) for num, c, t in res.counts if num in known}
            shards.append((idx, held))
        # A pod's tier at a key before its last on some shard: from that shard's bitmaps where it sent them,
        # else from the key read whole in round 3 (pairs settled with None keep the shard's tier).
        with_bits = [(idx, res.reads) for idx, res in replies if res.kind == 0]
        tiers_read: dict[int, dict[str, str]] = {}

        def known_tiers(pairs: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str | None]:
            out: dict[tuple[str, int], str | None] = {}
            for pod, i in pairs:
                if i in tiers_read:
                    out[(pod, i)] = tiers_read[i].get(pod)
                    continue
                for idx, reads in with_bits:
                    j = bisect_left(idx, i)
                    if j < len(idx) and idx[j] == i:
                        if not number_of:
                            number_of.update((name, num) for num, name in known.items())
                        num = number_of.get(pod)
                        out[(pod, i)] = tier_in(reads[j], num) if j < len(reads) and num is not None else None
                        break
            return out

        if not gapped:  # every count is final: the merge reads the tiers it needs (round 2 or 3)
            return await self._merged(request_keys, shards, read, unanswered, None, known_tiers), foreign
        # The bisected pods' counts are final now: the tiers their merge needs are read beside the walk.
        cut = min(unanswered) if unanswered else len(request_keys)
        _, tiers_wanted = merge_shards(len(request_keys), shards, read, cut, skip=gapped)
        settled = known_tiers(tiers_wanted)
        to_read = sorted({i for pod, i in tiers_wanted if (pod, i) not in settled})
        for i in to_read:
            tiers_read[i] = {}  # settled by the read, whatever it finds (a key not answered: the shard's tier)
        tier_read = asyncio.ensure_future(self._read_routed(request_keys, to_read, None, set())) if to_read else None
        try:  # Round 3: walk those pods, on the shards that bisected them
            moved = await self._walk(shard, bisected, gapped, known, shards, with_bits, unanswered)
            if tier_read is not None:
                tiers_read.update(await tier_read)
        except _NotOurs:
            if tier_read is not None:
                _abandon(tier_read)
            return None, foreign
        except BaseException:
            if tier_read is not None:
                _abandon(tier_read)
            raise
        if moved:
            # The walk reached a key that moved away and round 1 did not (a bisection reads few keys): that
            # shard's keys read through the routing, as after round 1 (a 4th round, while resharding only).
            self.late_reads += 1
            self._table = None
            read.update(await as_read(*await self._read_keys(request_keys, moved, unanswered)))
        return await self._merged(request_keys, shards, read, unanswered, None, known_tiers, late=True), foreign

    async def _walk(self, shard, bisected: Sequence[tuple[Any, list[int], BitsReply]], gapped: set[str],
                    known: Mapping[int, str], shards: list[tuple[list[int], dict[str, tuple[int, str | TierRuns]]]],
                    with_bits: list[tuple[list[int], list[dict[str, bytes]]]], unanswered: set[int]) -> list[int]:
        """The gapped pods walked key by key on the shards that bisected them (``shard(node, positions,
        how)``), each shard's answer for them put in ``shards`` in place of its bisection (as tier runs, so
        their tier at any key they hold there is known); the other pods keep their counts from round 1. A
        shard that does not answer leaves its keys in ``unanswered``; one whose walk found a key moved away
        is dropped, its positions returned (to be read through the routing); _NotOurs when one's first key
        now holds entries that are not ours."""
        again = []
        for node, idx, res in bisected:
            walk = {num for num, _, _ in res.counts if known.get(num) in gapped}
            if walk:
                again.append((node, idx, walk))
        done = await asyncio.gather(*(shard(node, idx, "w:" + ",".join(map(str, sorted(walk))))
                                      for node, idx, walk in again), return_exceptions=True)
        at = {id(idx): k for k, (idx, _) in enumerate(shards)}
        dropped = set()
        moved: list[int] = []
        for (_, idx, walk), r in zip(again, done):
            k = at[id(idx)]
            if isinstance(r, BaseException):
                if not isinstance(r, VALKEY_ERRORS):
                    raise r
                unanswered.update(idx)  # not answered now: cut there (a lower bound, said so)
                dropped.add(k)
                continue
            res = r[1]
            if res.kind == 2:
                raise _NotOurs()
            if res.moved:
                moved.extend(idx)
                dropped.add(k)
            elif res.kind == 0:  # many pods at its first key by now: its bitmaps, as in round 1
                shards[k] = (idx, {m.pod_id: (m.blocks, m.tier) for m in prefix_from_bits(res.reads, known)})
                with_bits.append((idx, res.reads))
            else:
                self.gap_walks += res.walked
                walked = {known[num] for num in walk}
                held = {pod: v for pod, v in shards[k][1].items() if pod not in walked}
                for num, c, t in res.counts:
                    if num in walk:  # no runs sent: one tier all along, a single run
                        held[known[num]] = (c, res.runs.get(num) or ((t, c),))
                shards[k] = (idx, held)
        shards[:] = [s for k, s in enumerate(shards) if k not in dropped]
        return sorted(moved)

    async def pods_with_gaps(self, pods: Iterable[str]) -> set[str]:
        """The pods a lookup must not bisect: their orphan count is not 0 or not known, or an outbox entry
        made while it was not ("gap_entry") is still there (its effects may not have reached every shard,
        which then shows that version). One pipelined read per shard holding their meta, in parallel; a
        pod whose shard does not answer (or moved meanwhile) is one too: never a guess."""
        pods = list(pods)
        groups, unserved = by_primary(self.client, (pod_meta_key(p) for p in pods))
        out: set[str] = {pods[i] for i in unserved}
        by_node = {name: (node, [pods[i] for i in idx]) for name, (node, idx) in groups.items()}

        async def one(node, part: list[str]) -> list[Any]:
            commands = [c for p in part for c in (("HMGET", pod_meta_key(p), "orphan_keys", "gap_entry", "orphan_at",
                                                   "batches"),
                                                   ("HKEYS", pod_outbox_key(p)))]
            fast = self._fast_for(node)
            if fast is not None:
                async with asyncio.timeout(fast.timeout_s):
                    return await fast.pipeline(commands)
            return [await self.client.execute_command(*c, target_nodes=node) for c in commands]

        results = await asyncio.gather(*(one(n, part) for n, part in by_node.values()), return_exceptions=True)
        for (_, part), res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, (*VALKEY_ERRORS, TimeoutError)):
                    raise res
                out.update(part)
                continue
            for j, pod in enumerate(part):
                meta, outbox = res[2 * j], res[2 * j + 1]
                if isinstance(meta, Exception) or isinstance(outbox, Exception) or not pod_bisectable(meta, outbox):
                    out.add(pod)
        return out

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Read-only commands, each on the key it names second (``HMGET <key> ...``), replies in order and
        error replies in place: grouped by primary, each group pipelined on that primary's lean connection,
        the primaries in parallel. A group whose primary did not answer, and a command refused as not its
        slot's (MOVED/ASK/TRYAGAIN/CLUSTERDOWN: resharding, failover), go again through redis-py's routing.
        A thousand pods' metadata through redis-py's cluster pipeline cost ~0.3 s of Python a second in a
        predictor renewing it (its per-command slot and packing work); here a few ms."""
        out: list[Any] = [None] * len(commands)
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()  # a new client learns the slot map on its first command
        groups, unserved = by_primary(self.client, (text(c[1]) for c in commands))
        again: list[int] = list(unserved)

        async def one(node, idx: list[int]) -> None:
            fast = self._fast_for(node)
            if fast is None:
                again.extend(idx)
                return
            try:
                async with asyncio.timeout(fast.timeout_s):
                    replies = await fast.pipeline([commands[i] for i in idx])
            except (*VALKEY_ERRORS, TimeoutError):
                again.extend(idx)
                return
            for i, r in zip(idx, replies):
                if isinstance(r, ResponseError) and str(r).startswith(_ROUTING_ERRORS):
                    again.append(i)
                else:
                    out[i] = r

        await asyncio.gather(*(one(node, idx) for node, idx in groups.values()))
        if again:
            again.sort()
            async with self.client.pipeline(transaction=False) as pipe:
                for i in again:
                    pipe.execute_command(*commands[i])
                for i, r in zip(again, await pipe.execute(raise_on_error=False)):
                    out[i] = r
        return out

    async def _read_keys(self, request_keys: Sequence[int], positions: list[int], unanswered: set[int]
                         ) -> tuple[dict[int, dict[str, bytes]], dict[int, dict[str, str]]]:
        """Keys read one by one through the cluster's routing (MOVED/ASK followed): position -> its
        bitmaps where its fields are exactly ours, else position -> pod -> tier from its entries (a key
        of a foreign type: a miss). Keys not answered go to ``unanswered``."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for i in positions:
                    pipe.hgetall(request_bits_key(request_keys[i]))
                    pipe.hkeys(request_key_name(request_keys[i]))
                replies = await pipe.execute(raise_on_error=False)
        except VALKEY_ERRORS:
            replies = [RedisConnectionError("not answered")] * (2 * len(positions))
        bits_at: dict[int, dict[str, bytes]] = {}
        entries_at: dict[int, dict[str, str]] = {}
        for j, i in enumerate(positions):
            bits, entries = replies[2 * j:2 * j + 2]
            wrong = [r for r in (bits, entries) if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE")]
            if any(isinstance(r, Exception) and r not in wrong for r in (bits, entries)):
                unanswered.add(i)
            elif wrong:  # a key of a foreign type: a miss
                entries_at[i] = {}
            elif len(entries) == int(bits.get(OUR_COUNT.encode(), 0) or 0):
                bits_at[i] = bits_of([x for kv in bits.items() for x in kv])
            else:  # not exactly ours: the entries decide
                at = entries_at[i] = {}
                for f in entries:
                    e = parse_entry(f)
                    if e is not None and not e.Speculative and better_tier(e.DeviceTier, at.get(e.PodIdentifier)):
                        at[e.PodIdentifier] = e.DeviceTier
        return bits_at, entries_at

    async def _merged(self, request_keys: Sequence[int],
                      shards: Sequence[tuple[list[int], Mapping[str, tuple[int, str | TierRuns]]]],
                      read: dict[int, dict[str, str]], unanswered: set[int], pods: Sequence[str] | None,
                      known: Callable[[Iterable[tuple[str, int]]], Mapping[tuple[str, int], str | None]] | None = None,
                      late: bool = False) -> Lookup:
        """The shards' answers merged (``merge_shards``), cut at the first key no shard answered for; on a
        layout that is not a prefix per pod, the tier at such a pod's last key: from ``known`` (pod, position)
        -> tier (None: keep the shard's) where it has them, else read (``late``: that read is a 4th round,
        counted in ``late_reads``)."""
        if unanswered and len(unanswered) == len(request_keys):
            raise RedisConnectionError("no shard of the cluster answered the lookup")
        cut = min(unanswered) if unanswered else len(request_keys)
        matches, tiers_wanted = merge_shards(len(request_keys), shards, read, cut)
        if tiers_wanted:
            tiers = dict(known(tiers_wanted)) if known is not None else {}
            rest = {pair for pair in tiers_wanted if pair not in tiers}
            if rest:
                if late:
                    self.late_reads += 1
                at = await self._read_routed(request_keys, sorted({i for _, i in rest}), pods, set())
                tiers.update(((pod, i), at.get(i, {}).get(pod)) for pod, i in rest)
            matches = [m if not tiers.get((m.pod_id, m.blocks - 1))
                       else PodMatch(m.pod_id, m.blocks, tiers[(m.pod_id, m.blocks - 1)]) for m in matches]
        return Lookup(matches, min(unanswered) if unanswered else None)

    @staticmethod
    async def _each_shard(by_node: dict[str, tuple[Any, list[int]]], shard, unanswered: set[int]) -> list[tuple[list[int], Any]]:
        """``shard(node, positions)`` on every primary at once; the positions of a shard that did not
        answer go to ``unanswered`` (any other error is raised)."""
        results = await asyncio.gather(*(shard(n, idx) for n, idx in by_node.values()), return_exceptions=True)
        out = []
        for (_, idx), res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, VALKEY_ERRORS):
                    raise res
                unanswered.update(idx)
            else:
                out.append((idx, res))
        return out

    async def _keys_by_node(self, request_keys: Sequence[int]) -> tuple[dict[str, tuple[Any, list[int]]], set[int]]:
        """The chain's positions per primary, from the slot map (positions whose slot no node serves now
        are returned apart: unanswered). Slots are computed in C through a slot -> primary table built
        once per slot map (kv_preflight/index/slots.py)."""
        if not self.client.nodes_manager.slots_cache:
            await self.client.initialize()  # a new client learns the slot map on its first command
        table, nodes = self._slot_table()
        groups = slot_groups(request_keys, table, len(nodes))
        by_node = {node.name: (node, idx) for node, idx in zip(nodes, groups) if idx}
        return by_node, set(groups[-1])

    def _slot_table(self) -> tuple[bytes, list[Any]]:
        """(slot -> primary index, primaries) for the client's current slot map: rebuilt when redis-py
        replaces the map (it learns it again) or when a lookup found a key moved (redis-py may have
        patched one slot in place after a MOVED)."""
        cache = self.client.nodes_manager.slots_cache
        if self._table is None or self._table[0] is not cache:
            primaries = {slot: holders[0] for slot, holders in cache.items() if holders}
            table, names = slot_table({slot: node.name for slot, node in primaries.items()})
            by_name = {node.name: node for node in primaries.values()}
            self._table = (cache, table, [by_name[n] for n in names])
        return self._table[1], self._table[2]

    async def _on_shard(self, node, script, args: list[Any]) -> Any:
        """A read-only script on one primary, with no declared keys: on its lean connection, else through
        redis-py (loading the script if the node does not know it)."""
        fast = self._fast_for(node)
        if fast is not None:
            try:
                async with asyncio.timeout(fast.timeout_s):
                    return await fast.evalsha(script.sha, script.script, args)
            except (*VALKEY_ERRORS, TimeoutError):
                await self._reread_map()  # a master gone (failover): redis-py's map is not told otherwise
                raise
        try:
            return await self.client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)
        except NoScriptError:
            await self.client.script_load(script.script)
            return await self.client.execute_command("EVALSHA", script.sha, 0, *args, target_nodes=node)

    def _fast_for(self, node) -> FastConnection | None:
        """The lean connection (kv_preflight/index/resp.py) to a primary, for the lookup round: redis-py's cluster
        client spends tens of µs of Python per command, and a prediction sends one per shard. None over
        TLS (the lean connection speaks plain TCP), where redis-py carries it."""
        if node.name not in self._fast:
            kw = node.connection_kwargs
            tls = "SSL" in node.connection_class.__name__
            self._fast[node.name] = None if tls else FastConnection(
                host=node.host, port=node.port, username=kw.get("username"), password=kw.get("password"),
                timeout_s=kw.get("socket_timeout") or 1.0,
                resend_scripts={script_sha(self._lookup.script), script_sha(self._lookup_bits.script)})
        return self._fast[node.name]

    async def _reread_map(self) -> None:
        """Learn the slot map again (at most twice a second) after a primary failed to answer."""
        if time.monotonic() - self._map_read_at < 0.5:
            return
        self._map_read_at = time.monotonic()
        try:
            await self.client.nodes_manager.initialize()
        except VALKEY_ERRORS:
            pass  # no node answers now; the next failure tries again

    async def _read_routed(self, request_keys: Sequence[int], positions: list[int], pods: Sequence[str] | None,
                           unanswered: set[int]) -> dict[int, dict[str, str]]:
        """Keys read whole (HKEYS) through the cluster's routing (MOVED/ASK followed): position -> pod -> tier
        (gpu preferred). Keys not answered go to ``unanswered``."""
        wanted = set(pods) if pods else None
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for i in positions:
                    pipe.hkeys(request_key_name(request_keys[i]))
                replies = await pipe.execute(raise_on_error=False)
        except VALKEY_ERRORS:
            replies = [RedisConnectionError("not answered")] * len(positions)
        out: dict[int, dict[str, str]] = {}
        for i, r in zip(positions, replies):
            if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
                r = []  # a key of a foreign type is a miss
            if isinstance(r, Exception):
                unanswered.add(i)
                continue
            at = out.setdefault(i, {})
            for f in r:
                e = parse_entry(f)
                if e is None or e.Speculative or (wanted is not None and e.PodIdentifier not in wanted):
                    continue
                if better_tier(e.DeviceTier, at.get(e.PodIdentifier)):
                    at[e.PodIdentifier] = e.DeviceTier
        return out

    async def key_count(self) -> int:
        n = await self.client.dbsize(target_nodes=RedisCluster.PRIMARIES)
        return int(sum(n.values()) if isinstance(n, dict) else n)

    async def memory_usage(self) -> int | None:
        infos = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        if isinstance(infos, dict) and "used_memory" in infos:
            return int(infos["used_memory"])
        return sum(int(v.get("used_memory", 0)) for v in infos.values() if isinstance(v, dict))

    async def close(self) -> None:
        await self.effects.close()
        for fast in self._fast.values():
            if fast is not None:
                await fast.close()
        self._fast.clear()


# Error replies that say a command reached a primary that does not (or not yet) serve its slot.
_REDIRECTS = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN"})


_ROUTING_ERRORS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")  # a command sent where its slot is not served now


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


def pod_bisectable(meta: Sequence[Any], outbox: Iterable[Any]) -> bool:
    """Whether a lookup may bisect a pod, from its meta ``HMGET orphan_keys gap_entry orphan_at batches`` and
    its outbox's fields (pure): its keys are closed under "parent" now (orphan count known and 0, written at
    the pod's last batch: a writer of an earlier build keeps no count), and no outbox entry is left from a
    step taken while they were not (entries are numbered in order; "gap_entry" is the last such one), so
    every version of the pod a shard may show is closed too."""
    count, gap_entry, at, batches = (text(v) if v is not None else None for v in meta)
    if count != "0" or at != (batches or "0"):
        return False
    if not gap_entry:
        return True
    last = int(gap_entry)
    return all(int(text(f).split("|", 1)[0]) > last for f in outbox)


class _NotOurs(Exception):
    """A shard's first key holds entries that are not ours (lookup_bits.lua's "whole"): walk llm-d's."""


def _abandon(task: "asyncio.Future[Any]") -> None:
    """Let a read nobody needs any more finish on its own, its outcome retrieved when it does. Cancelling it
    would leave its replies' futures on the lean connection to fail unretrieved when it closes (seen as
    "connection to valkey dropped: closed by the client" in an event loop's exception handler)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def merge_shards(n: int, shards: Sequence[tuple[list[int], Mapping[str, tuple[int, str | TierRuns]]]],
                 read: dict[int, dict[str, str]], cut: int, skip: Container[str] = ()
                 ) -> tuple[list[PodMatch], set[tuple[str, int]]]:
    """Per pod, its prefix of an ``n``-key chain from the shards' answers (pure).

    ``shards``: per shard, the chain positions of its keys (ascending) and, per pod, how many of them it
    holds from the first and its tier at the last of those, or its tier runs along them (a walked pod:
    ``TierRuns``); ``read``: keys read whole (position -> pod -> tier); ``cut``: the first position
    nobody answered for; ``skip``: pods left out. A pod's prefix ends at the first position where some
    source lacks it: a shard at the key after its count (at its first key if the shard does not name the
    pod), a key read whole that does not list it, or ``cut``. Its tier is that of the source holding its
    last key; when that source is a shard whose count runs past it with no runs (only if a pod's keys
    are not a prefix, e.g. a batch half applied) the pair (pod, position) is returned, to be read whole.
    """
    pods: set[str] = set()
    for _, held in shards:
        pods.update(held)
    for at in read.values():
        pods.update(at)
    pods.difference_update(skip)
    missing = sorted(read)
    out: list[PodMatch] = []
    tiers_wanted: set[tuple[str, int]] = set()
    for pod in pods:
        end = cut
        for idx, held in shards:
            c = held.get(pod, (0, ""))[0]
            if c < len(idx) and idx[c] < end:
                end = idx[c]
        for i in missing:
            if i >= end:
                break
            if pod not in read[i]:
                end = i
                break
        if end <= 0:
            continue
        last = end - 1
        tier = read.get(last, {}).get(pod)
        if tier is None:
            for idx, held in shards:
                c, t = held.get(pod, (0, ""))
                j = bisect_left(idx, last, 0, c)
                if j < c and idx[j] == last:  # this shard owns `last`
                    if not isinstance(t, str):  # a walked pod's runs: its tier at every key it holds here
                        tier = tier_in_runs(t, j)
                    else:
                        tier = t
                        if j != c - 1:  # and holds the pod past it: not a prefix, its tier there is unknown
                            tiers_wanted.add((pod, last))
                    break
        out.append(PodMatch(pod, end, tier or "gpu"))
    return out, tiers_wanted


def _crash_point(spec: str) -> list | None:
    point, _, n = spec.partition(":")
    return [point, int(n or 1)] if point in ("pod_step", "effects") else None


__all__ = ["ClusterBackend", "ClusterEffects", "EXACT_BUDGET", "ReplicationBarrier", "TAKEOVER_MS", "cluster_client",
           "merge_shards", "pod_bisectable", "probe_cluster", "writer_id"]
