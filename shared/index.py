"""The Valkey index: every Valkey command of the project, the field encodings, and the scripts.

Key names come from shared/layout.py (layout 2, documented there, the same on a single node and on
Valkey Cluster); the Lua scripts live in shared/lua/ as package data; the cluster's write path is in
shared/backends/cluster.py. Batches are applied after a seq check against the persisted seq of
(pod, dp rank), atomic with the pod's whole state change, so several ingesters on one engine converge
on exactly one application of every batch (see docs/operations.md). A key of a foreign type never
fails a batch half way: writes to keys we do not own stand alone (the pod is flagged, a counter
counts), and our own keys are checked before the first write.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from importlib import resources
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError

from shared.keys import pack_keys
from shared.backends.cluster import TAKEOVER_MS, ClusterEffects, cluster_client, probe_cluster, writer_id
from shared.layout import (COUNTERS_KEY, FEEDS_KEY, LAYOUT_KEY, LAYOUT_VERSION, PODS_KEY, V1_PODS_KEY, engine_key_name,
                           feed_field, pod_blocks_key, pod_fields_key, pod_keys, pod_meta_key, pod_state_keys,
                           request_key_name)
from shared.resp import FastConnection

DEFAULT_TIER = "gpu"
log = logging.getLogger("kvpf.index")
# What a Valkey call can raise when Valkey (a node, a shard) is unreachable or answers an error:
# redis-py's cluster client raises RedisClusterException (not a RedisError) when it has no node.
VALKEY_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


# ---------------------------------------------------------------- PodEntry


class PodEntry(msgspec.Struct, frozen=True):
    """llm-d's PodEntry; field order is Go's, which the JSON encoding must keep byte for byte."""

    PodIdentifier: str
    DeviceTier: str = DEFAULT_TIER
    Speculative: bool = False
    HasGroup: bool = False
    GroupIdx: int = 0


_entry_json = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(PodEntry)


def tier_of(medium: str | None) -> str:
    return medium.lower() if medium else DEFAULT_TIER


def make_entry(pod_id: str, medium: str | None, group_idx: int | None) -> PodEntry:
    return PodEntry(
        PodIdentifier=pod_id,
        DeviceTier=tier_of(medium),
        HasGroup=group_idx is not None,
        GroupIdx=group_idx or 0,
    )


def encode_entry(entry: PodEntry, entry_format: str = "json") -> str:
    if entry_format == "v08":
        return f"{entry.PodIdentifier}@{entry.DeviceTier}" + ("[speculative]" if entry.Speculative else "")
    return _entry_json.encode(entry).decode()


def parse_entry(field_value: str | bytes) -> PodEntry | None:
    """Either form llm-d has written; None for a field no llm-d version would write."""
    text = field_value.decode("utf-8", "replace") if isinstance(field_value, bytes) else field_value
    if text.startswith("{"):
        try:
            return _entry_decoder.decode(text)
        except msgspec.DecodeError:
            return None
    pod, sep, tier = text.partition("@")
    if not sep or not pod:
        return None
    speculative = False
    bracket = tier.find("[")
    if bracket != -1:
        speculative = "speculative" in tier[bracket:]
        tier = tier[:bracket]
    return PodEntry(PodIdentifier=pod, DeviceTier=tier or DEFAULT_TIER, Speculative=speculative)


# ---------------------------------------------------------------- mutations


class StoreBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    entry_field: str
    request_keys: tuple[int, ...]
    group: int = 0  # the engine's KV-cache group (hybrid models hold one hash once per group)
    # The event had no parent: a store of a hash the pod already holds is then vLLM's
    # re-announcement of a reused block (kv_cache_report_mode "full"), not a second copy.
    parentless: bool = False


class RemoveBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    group: int = 0


def block_slot(tier: str, group: int | None) -> str:
    """The reverse-index key suffix of a block: its tier, and its KV-cache group when not 0."""
    return f"{tier}|{group}" if group else tier


class ClearPod(msgspec.Struct, frozen=True):
    pass


class MarkIncomplete(msgspec.Struct, frozen=True):
    """Flag the pod incomplete in the same script that applies the batch (so a batch applied
    whose reply was lost, then answered "dup" on retry, still leaves its flag)."""

    reason: str


Mutation = StoreBlock | RemoveBlock | ClearPod | MarkIncomplete


def encode_mutations(mutations: Iterable[Mutation]) -> list[str | int]:
    """Flat script arguments: ``nf field..`` (the batch's distinct PodEntry fields, each sent
    once), then ops ``S ek tier fi n rk..`` (fi: 1-based into the fields; ``A`` instead of ``S``
    for a parentless store) / ``R ek tier`` / ``C`` / ``I reason``."""
    fields: dict[str, int] = {}
    ops: list[str | int] = []
    for m in mutations:
        if isinstance(m, StoreBlock):
            fi = fields.get(m.entry_field)
            if fi is None:
                fi = fields[m.entry_field] = len(fields) + 1
            ops += ["A" if m.parentless else "S", m.engine_key, block_slot(m.tier, m.group), fi, len(m.request_keys),
                    *m.request_keys]
        elif isinstance(m, RemoveBlock):
            ops += ["R", m.engine_key, block_slot(m.tier, m.group)]
        elif isinstance(m, MarkIncomplete):
            ops += ["I", m.reason]
        else:
            ops.append("C")
    return [len(fields), *fields, *ops]


def _lua(*names: str) -> str:
    """A script from the package's lua/ files; preludes first (Lua has no include)."""
    base = resources.files("shared") / "lua"
    return "\n".join((base / f"{n}.lua").read_text() for n in names)


_LUA_APPLY_SINGLE = _lua("apply_single", "pod")
_LUA_APPLY_CLUSTER = _lua("apply_cluster", "pod")
_LUA_APPLY = _LUA_APPLY_SINGLE  # the lean connection's resend list names it
_LUA_UNLINK = _lua("unlink_engine")
_LUA_LOOKUP = _lua("parse_entry", "chain", "lookup")
_LUA_LOOKUP_LINEAR = _lua("parse_entry", "chain", "lookup_linear")


def _apply_args(pod_id: str, rank: int, seq: int, ts: float, model: str, engine_block_size: int | None,
                mutations: Sequence[Mutation], mode: str, writer: str = "") -> list[Any]:
    return [pod_id, rank, seq, repr(ts), mode, model, "" if engine_block_size is None else engine_block_size,
            repr(time.time()), writer, *encode_mutations(mutations)]


def _crash_point(spec: str) -> list | None:
    point, _, n = spec.partition(":")
    return [point, int(n or 1)] if point in ("pod_step", "effects") else None


def _text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _apply_result(reply: Sequence[Any]) -> "ApplyResult":
    status, last, foreign, detail = reply
    return ApplyResult(_text(status), int(last), int(foreign), _text(detail))


@dataclass(frozen=True)
class ApplyResult:
    status: str  # applied | dup | gap | restart | corrupt (never applied: a forged seq, a foreign-typed pod key)
    last_seq: int
    foreign_writes: int = 0  # writes that hit a key of a foreign type (skipped; the pod is flagged)
    detail: str = ""  # why, for corrupt and foreign writes


@dataclass(frozen=True)
class Lookup:
    """A lookup's answer: per pod, its prefix; ``unanswered_from``: on a cluster with a shard down
    (and no replica to take over), the first key (block index, 0-based) whose shard did not answer:
    counts are then lower bounds, never silently short."""

    matches: list["PodMatch"]
    unanswered_from: int | None = None

    @property
    def partial(self) -> bool:
        return self.unanswered_from is not None


@dataclass(frozen=True)
class PodMatch:
    pod_id: str
    blocks: int  # consecutive request-key blocks from the start of the chain
    tier: str


@dataclass
class PodInfo:
    pod_id: str
    model: str
    engine_block_size: int | None
    seqs: dict[str, int]
    last_event_time: float | None
    incomplete: bool
    incomplete_reason: str
    blocks: int
    counters: dict[str, int] = field(default_factory=dict)


_POD_COUNTERS = ("batches", "stored", "removed", "cleared", "orphans", "restarts", "gaps_accepted", "replays",
                 "reannounced", "foreign_keys", "corrupt")


def pod_info_from(pod_id: str, meta_raw: Any, blocks: Any) -> PodInfo:
    """A pod's metadata from HGETALL and HLEN replies. State we did not write (a non-integer seq,
    a key of another type) makes the pod incomplete with the reason, never an exception."""
    problems: list[str] = []
    if isinstance(meta_raw, Exception):
        problems.append(f"{pod_meta_key(pod_id)}: {str(meta_raw)[:120]}")
        meta_raw = {}
    if isinstance(blocks, Exception):
        problems.append(f"{pod_blocks_key(pod_id)}: {str(blocks)[:120]}")
        blocks = 0
    meta = {_text(k): _text(v) for k, v in meta_raw.items()}

    def num(name: str, value: str, kind: type = int) -> Any:
        try:
            return kind(value)
        except ValueError:
            problems.append(f"{name} is {value[:40]!r}, not a number")
            return None

    seqs = {k[4:]: v for k, raw in meta.items() if k.startswith("seq:") and (v := num(k, raw)) is not None}
    counters = {k: v for k in _POD_COUNTERS if k in meta and (v := num(k, meta[k])) is not None}
    ebs = num("engine_block_size", meta["engine_block_size"]) if meta.get("engine_block_size") else None
    let = num("last_event_time", meta["last_event_time"], float) if meta.get("last_event_time") else None
    reason = meta.get("incomplete_reason", "")
    if problems:
        reason = "; ".join(filter(None, [reason, "corrupt pod state: " + "; ".join(problems)]))
    return PodInfo(
        pod_id=pod_id,
        model=meta.get("model", ""),
        engine_block_size=ebs,
        seqs=seqs,
        last_event_time=let,
        incomplete=meta.get("incomplete") == "1" or bool(problems),
        incomplete_reason=reason,
        blocks=int(blocks),
        counters=counters,
    )


def longest_prefix(fields_per_key: Sequence[Sequence[str | bytes]], pods: Iterable[str] | None = None) -> list[PodMatch]:
    """Pure twin of the lookup script, for the pipeline path (Valkey Cluster) and tests."""
    wanted = set(pods) if pods else None
    alive: dict[str, str] | None = None
    counts: dict[str, int] = {}
    tiers: dict[str, str] = {}
    for i, fields in enumerate(fields_per_key, start=1):
        present: dict[str, str] = {}
        for f in fields:
            entry = parse_entry(f)
            if entry is None or entry.Speculative:
                continue
            if wanted is not None and entry.PodIdentifier not in wanted:
                continue
            if entry.PodIdentifier not in present or entry.DeviceTier == DEFAULT_TIER:
                present[entry.PodIdentifier] = entry.DeviceTier
        alive = present if alive is None else {p: t for p, t in present.items() if p in alive}
        if not alive:
            break
        for pod in alive:
            counts[pod] = i
            tiers[pod] = alive[pod]
    return [PodMatch(p, n, tiers[p]) for p, n in counts.items()]


def _foreign_as_empty(replies: list[Any]) -> list[Any]:
    """Pipeline replies with a key of a foreign type (WRONGTYPE) read as empty; other errors raise."""
    for i, r in enumerate(replies):
        if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
            replies[i] = []
        elif isinstance(r, Exception):
            raise r
    return replies


def parse_lookup_reply(flat: Sequence[Any]) -> tuple[list[PodMatch], int]:
    """The scripts' reply: the number of foreign-typed keys read (as misses), then pod triples."""
    out = []
    for i in range(1, len(flat), 3):
        pod, n, tier = flat[i], flat[i + 1], flat[i + 2]
        out.append(PodMatch(pod.decode() if isinstance(pod, bytes) else pod, int(n),
                            tier.decode() if isinstance(tier, bytes) else tier))
    return out, int(flat[0]) if flat else 0


class LayoutError(RuntimeError):
    """The index was written in another layout version (see shared/layout.py and ``index migrate``)."""


class Index:
    """Async access to the index, on a single node or a Valkey Cluster (``from_url`` tells which).

    Every call is bounded by the client's socket timeout. What differs between the two topologies
    is the write path and the lookup: on a single node one script applies a batch (and one script
    answers a lookup); on a cluster a batch is a pod step, its effects and an ack
    (shared/backends/cluster.py), and a lookup is one pipelined round of HKEYS per shard.
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, entry_format: str = "json",
                 fast: FastConnection | None = None, *, cluster: bool = False, writer: str | None = None,
                 takeover_ms: int = TAKEOVER_MS):
        self.client = client
        self.entry_format = entry_format
        self.fast = fast  # the lean connection (single node, redis:// and unix://)
        self.cluster = cluster
        self.writer = writer or writer_id()
        self.takeover_ms = takeover_ms
        # A testing hook for the crash tests (tests/integration/test_cluster.py): "pod_step:N" or
        # "effects:N" ends the process (exit 137, as kill -9 would) right after the N-th such step.
        self._crash_at = _crash_point(os.environ.get("KVPF_TEST_CRASH_AT", ""))
        self.unreplicated = 0  # runs whose effects a replica had not confirmed in time (kept in the outbox)
        self.foreign_reads = 0  # request keys of a foreign type read as misses (a counter for /metrics)
        self._registered: dict[str, str] = {}  # pod -> model this Index has put in the registry
        self._apply = client.register_script(_LUA_APPLY_CLUSTER if cluster else _LUA_APPLY_SINGLE)
        self._lookup = client.register_script(_LUA_LOOKUP)
        self._lookup_linear = client.register_script(_LUA_LOOKUP_LINEAR)
        self.effects = ClusterEffects(client, _LUA_UNLINK, writer=self._writer_arg_for(cluster)) if cluster else None

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, entry_format: str = "json",
                 cluster: bool | None = None) -> "Index":
        """``cluster``: None asks the node (``INFO cluster``); a node that does not answer is taken
        for a single node, with a warning (``--valkey-cluster yes`` says so up front)."""
        from shared import resp  # (belongs with the module's imports; kept here to touch only this method)

        if cluster is None:
            cluster = probe_cluster(url, timeout_s)
            if cluster is None:
                log.warning("%s did not answer; taking it for a single node (--valkey-cluster yes if it is a "
                            "cluster)", url.split("@")[-1])
        if cluster:
            return cls(cluster_client(url, timeout_s=timeout_s), entry_format, None, cluster=True)
        # Scripts resent once after a lost connection, being safe to run twice (shared/resp.py): the
        # read-only lookups; and on the lean connection the apply, whose seq check answers "dup" to a
        # batch already applied (only the ingester's checked runs go there; "import" goes by redis-py).
        lookups = {resp.script_sha(_LUA_LOOKUP), resp.script_sha(_LUA_LOOKUP_LINEAR)}
        client = resp.redis_client(url, timeout_s=timeout_s, resend_scripts=lookups)
        fast = FastConnection.from_url(url, timeout_s=timeout_s, resend_scripts=lookups | {resp.script_sha(_LUA_APPLY)})
        return cls(client, entry_format, fast)

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        if self.effects is not None:
            await self.effects.close()
        await self.client.aclose()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    def entry_field(self, pod_id: str, medium: str | None, group_idx: int | None) -> str:
        return encode_entry(make_entry(pod_id, medium, group_idx), self.entry_format)

    # ---- layout version

    async def check_layout(self) -> str:
        """The layout version, set to ours on an empty index; ``LayoutError`` for any other."""
        found = await self.client.hget(LAYOUT_KEY, "version")
        if found is None:
            if await self.v1_writer_seen():
                raise LayoutError("this index has layout 1 (kv-preflight 0.1): stop its ingesters and run "
                                  "`kv-preflight index migrate --valkey-url URL`")
            await self.client.hsetnx(LAYOUT_KEY, "version", LAYOUT_VERSION)
            found = await self.client.hget(LAYOUT_KEY, "version")
        version = _text(found)
        if version != LAYOUT_VERSION:
            raise LayoutError(f"this index has layout {version!r}; this kv-preflight reads and writes layout "
                              f"{LAYOUT_VERSION} only")
        return version

    async def v1_writer_seen(self) -> bool:
        """Whether a layout-1 writer (kv-preflight 0.1) has written here (its registry exists)."""
        return bool(await self.client.exists(V1_PODS_KEY))

    # ---- write path

    async def apply_batch(
        self,
        *,
        pod_id: str,
        rank: int,
        seq: int,
        ts: float,
        model: str,
        engine_block_size: int | None,
        mutations: Sequence[Mutation],
        mode: str = "check",
    ) -> ApplyResult:
        return (await self.apply_batches([dict(pod_id=pod_id, rank=rank, seq=seq, ts=ts, model=model,
                                                engine_block_size=engine_block_size, mutations=mutations,
                                                mode=mode)]))[0]

    async def apply_batches(self, batches: Sequence[dict[str, Any]]) -> list[ApplyResult]:
        """Several ``apply_batch`` calls (same keyword arguments each) in one round trip, in order.

        Each still runs its own seq check, so the results are what one-by-one calls would give
        when every batch applies; a batch behind one that did not (gap, restart) gets "gap" or
        "restart" itself and the caller re-applies it after recovering.
        """
        return await (await self.send_batches(batches))

    async def send_batches(self, batches: Sequence[dict[str, Any]]) -> "asyncio.Future[list[ApplyResult]]":
        """``apply_batches`` in two steps: the commands are written now, the results come from
        the returned future, so the caller can prepare the next batches while Valkey runs these.
        Commands written later on this Index run after these (one connection). Without the
        lean connection (TLS, cluster) the batches run before this returns."""
        args = [_apply_args(b["pod_id"], b["rank"], b["seq"], b["ts"], b["model"], b["engine_block_size"],
                            b["mutations"], b.get("mode", "check"), self._writer_arg()) for b in batches]
        keys = [pod_keys(b["pod_id"], cluster=self.cluster) for b in batches]
        if self.cluster:
            results = await self._apply_cluster([b["pod_id"] for b in batches], keys, args)
        elif self.fast is not None:
            replies = await self.fast.evalsha_send(self._apply.sha, self._apply.script, args, keys)

            async def results_later() -> list[ApplyResult]:
                out = [_apply_result(r) for r in await replies]
                await self._register_new(batches, out)
                return out

            return asyncio.ensure_future(results_later())
        else:
            results = [_apply_result(r) for r in await self._evalsha_pipeline(self._apply, keys, args)]
        await self._register_new(batches, results)
        done: asyncio.Future[list[ApplyResult]] = asyncio.get_running_loop().create_future()
        done.set_result(results)
        return done

    async def _register_new(self, batches: Sequence[dict[str, Any]], results: Sequence[ApplyResult]) -> None:
        """Pods applied for the first time by this Index (or with a new model) go into the fleet
        registry: a separate write, since no per-batch step may touch a fleet-wide key on a cluster."""
        new = {b["pod_id"]: b["model"] for b, r in zip(batches, results)
               if r.status == "applied" and b["model"] and self._registered.get(b["pod_id"]) != b["model"]}
        if new:
            await self.client.hset(PODS_KEY, mapping=new)
            self._registered.update(new)

    def _writer_arg(self) -> str:
        return self._writer_arg_for(self.cluster)

    def _writer_arg_for(self, cluster: bool) -> str:
        return f"{self.writer}@{self.takeover_ms}" if cluster else ""

    async def _evalsha_pipeline(self, script, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> list[Any]:
        """One EVALSHA per (keys, args), pipelined; the script is loaded (every primary) if missing."""
        for attempt in range(2):
            async with self.client.pipeline(transaction=False) as pipe:
                for k, a in zip(keys, args):
                    pipe.execute_command("EVALSHA", script.sha, len(k), *k, *a)
                try:
                    out = await pipe.execute(raise_on_error=False)
                except NoScriptError:
                    out = [NoScriptError("NOSCRIPT")]
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in out):
                await self.client.script_load(script.script)
                continue
            for r in out:
                if isinstance(r, Exception):
                    raise r
            return out
        raise AssertionError("unreachable")

    async def _apply_cluster(self, pods: Sequence[str], keys: Sequence[Sequence[str]],
                             args: Sequence[Sequence[Any]]) -> list[ApplyResult]:
        """Pod steps (pipelined, each in its pod's slot), then the effects of the applied ones on their
        shards, then the acks. A pod whose outbox holds another writer's entry is retried after that
        entry ran ("pending": run it now) or its writer had time to ("busy")."""
        results: list[ApplyResult | None] = [None] * len(pods)
        todo = list(range(len(pods)))
        deadline = time.monotonic() + 2 * self.takeover_ms / 1000 + 5
        while todo:
            replies = await self._evalsha_pipeline(self._apply, [keys[i] for i in todo], [args[i] for i in todo])
            entries: list[tuple[str, str, bytes]] = []
            ackable: list[tuple[str, str, bytes]] = []
            held_back: set[str] = set()  # pods with an older entry of ours still there: ack in order
            owners: list[int] = []
            again: list[int] = []
            drain: set[str] = set()
            blocked: set[str] = set()
            for i, r in zip(todo, replies):
                status = _text(r[0])
                if pods[i] in blocked or status in ("busy", "pending"):
                    blocked.add(pods[i])  # this pod's later batches wait too: order within a pod
                    again.append(i)
                    if status == "pending":
                        drain.add(pods[i])
                    continue
                results[i] = _apply_result(r[:4])
                if len(r) > 4:
                    entry = (pods[i], _text(r[4]), r[5])
                    entries.append(entry)
                    owners.append(i)
                    if int(r[6]) > 0 or pods[i] in held_back:
                        held_back.add(pods[i])
                    else:
                        ackable.append(entry)
            self._maybe_crash("pod_step", bool(entries))
            if entries:
                foreign, first, touched = await self.effects.run(entries)
                self._maybe_crash("effects", True)
                # Deleted only once replicated (else they run again after a failover); a pod's
                # entries behind one of ours still there wait for the next drain, in order.
                if not await self.effects.ack(ackable, touched):
                    self.unreplicated += 1
                if foreign:
                    await self._flag_foreign(entries, foreign, first)
                    for i in owners:
                        res = results[i]
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

    def _maybe_crash(self, point: str, happened: bool) -> None:
        if self._crash_at is not None and happened and self._crash_at[0] == point:
            self._crash_at[1] -= 1
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

    async def drain_outbox(self, pod_id: str, *, stale_only: bool = False) -> int:
        """Run what a crashed writer left in a pod's outbox (cluster; nothing to do on one node);
        ``stale_only``: only entries older than the takeover time (their writer is gone)."""
        if self.effects is None:
            return 0
        return await self.effects.drain(pod_id, older_than_ms=self.takeover_ms if stale_only else 0)

    async def resolve_engine_keys(self, engine_keys: Iterable[int], pod_id: str | None = None) -> dict[int, int]:
        """Engine key -> its last request key (the one a child block chains from), one round trip.

        Engines of different models with the same hash seed give the same tokens the same engine
        key (vLLM's block hash has no model in it), so ``engine:<key>`` can hold several models'
        request keys at the last position. Then the one ``pod_id`` holds wins (a child's parent is
        in its own pod's cache); if that does not single one out, the key stays unresolved (an
        orphan) rather than chaining from another model's key.
        """
        eks = list(dict.fromkeys(engine_keys))
        if not eks:
            return {}
        async with self.client.pipeline(transaction=False) as pipe:
            for ek in eks:
                pipe.zrevrange(engine_key_name(ek), 0, 1, withscores=True)
            replies = _foreign_as_empty(await pipe.execute(raise_on_error=False))
        out: dict[int, int] = {}
        tied: list[tuple[int, float]] = []
        for ek, r in zip(eks, replies):
            if len(r) == 1 or (len(r) > 1 and r[0][1] != r[1][1]):
                out[ek] = int(r[0][0])
            elif r:
                tied.append((ek, r[0][1]))
        if tied and pod_id is not None:
            async with self.client.pipeline(transaction=False) as pipe:
                for ek, top in tied:
                    pipe.zrangebyscore(engine_key_name(ek), top, top)
                candidates = _foreign_as_empty(await pipe.execute(raise_on_error=False))
            async with self.client.pipeline(transaction=False) as pipe:
                for rks in candidates:
                    for rk in rks:
                        pipe.hkeys(rk)
                fields = iter(_foreign_as_empty(await pipe.execute(raise_on_error=False)))
            for (ek, _), rks in zip(tied, candidates):
                mine = []
                for rk in rks:
                    entries = (parse_entry(f) for f in next(fields))
                    if any(e is not None and e.PodIdentifier == pod_id for e in entries):
                        mine.append(int(rk))
                if len(mine) == 1:
                    out[ek] = mine[0]
        return out

    async def import_blocks(self, pod_id: str, model: str, engine_block_size: int | None,
                            stores: Sequence[StoreBlock]) -> None:
        """Write exported entries back; the pod's seq is left alone (the next live batch decides)."""
        await self.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model=model,
                               engine_block_size=engine_block_size, mutations=stores, mode="import")

    async def export_blocks(self, pod_id: str, batch: int = 1000):
        """Yield every StoreBlock a pod holds, read with HSCAN so a large pod never blocks Valkey."""
        ids = {k: v.decode() for k, v in (await self.client.hgetall(pod_fields_key(pod_id))).items()}
        cursor = 0
        while True:
            cursor, chunk = await self.client.hscan(pod_blocks_key(pod_id), cursor, count=batch)
            for bk, held in chunk.items():
                ek, _, slot = bk.decode().partition("|")
                tier, _, group = slot.partition("|")
                head, _, rks = held.partition(b":")
                fld, star, n = head.partition(b"*")
                block = StoreBlock(int(ek), tier, ids.get(fld) or fld.decode(),
                                   tuple(int(k) for k in rks.split(b",") if k), int(group) if group.isdigit() else 0)
                for _ in range(int(n) if star and n.isdigit() else 1):  # one per physical copy
                    yield block
            if cursor == 0:
                return

    async def memory_usage(self) -> int | None:
        """Bytes Valkey uses, summed over the primaries of a cluster."""
        try:
            if self.cluster:
                infos = await self.client.info("memory", target_nodes=RedisCluster.PRIMARIES)
                return sum(int(v.get("used_memory", 0)) for v in infos.values() if isinstance(v, dict)) or \
                    int(infos.get("used_memory", 0))
            info = await self.client.info("memory")
            return int(info.get("used_memory", 0))
        except (RedisError, ValueError, TypeError):
            return None

    async def reset_if_seq(self, pod_id: str, rank: int, expected_last: int) -> bool:
        """Clear a restarted engine's pod, unless its seq moved on since ``expected_last`` was read."""
        result = await self.apply_batch(pod_id=pod_id, rank=rank, seq=expected_last, ts=0.0, model="",
                                        engine_block_size=None, mutations=(), mode="reset_if")
        return result.status == "applied"

    async def clear_pod(self, pod_id: str, *, forget: bool = False) -> int:
        """Remove every entry of a pod; ``forget`` also drops its metadata. Returns blocks removed."""
        await self.drain_outbox(pod_id)
        result = await self.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model="", engine_block_size=None,
                                        mutations=(), mode="clear")
        if forget:
            await self.client.delete(*pod_state_keys(pod_id))
            await self.client.hdel(PODS_KEY, pod_id)
        return result.last_seq

    async def mark_incomplete(self, pod_id: str, reason: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 1, "incomplete_reason": reason})

    async def mark_complete(self, pod_id: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 0, "incomplete_reason": ""})

    async def count(self, name: str, n: int = 1, *, pod_id: str | None = None) -> None:
        key = pod_meta_key(pod_id) if pod_id else COUNTERS_KEY
        await self.client.hincrby(key, name, n)

    async def remember_feed(self, replay_endpoint: str, rank: int, pod_id: str, model: str) -> None:
        """Note that ``replay_endpoint`` (rank ``rank``) serves ``pod_id``; see ``feeds``."""
        await self.client.hset(FEEDS_KEY, feed_field(replay_endpoint, rank), f"{pod_id}\t{model}")

    async def feeds(self, replay_endpoints: Iterable[str]) -> list[tuple[str, int, str, str]]:
        """(replay endpoint, rank, pod, model) remembered for these endpoints: what a restarted
        ingester resumes at start, before any frame names a pod (SGLang's replay replies carry
        no topic, so the pod cannot be learned from them)."""
        wanted = set(replay_endpoints)
        if not wanted:
            return []
        out = []
        for f, v in (await self.client.hgetall(FEEDS_KEY)).items():
            endpoint, _, rank = _text(f).rpartition("|")
            pod, _, model = _text(v).partition("\t")
            if endpoint in wanted and rank.isdigit() and pod:
                out.append((endpoint, int(rank), pod, model))
        return sorted(out)

    # ---- read path

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *, mode: str = "script") -> list[PodMatch]:
        return (await self.lookup_detailed(request_keys, pods, mode=mode)).matches

    async def lookup_detailed(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *,
                              mode: str = "script") -> "Lookup":
        """Per pod, how many leading blocks of the chain it holds. One round trip in every mode.

        ``script``: galloping search in one EVALSHA (a pod's blocks form a prefix of the chain);
        ``linear``: the exact walk in one EVALSHA; ``pipeline``: pipelined HKEYS, the exact walk in
        Python. On a cluster the keys live on every shard, so the lookup is always the pipeline:
        one round, one pipelined request per shard, the shards in parallel.
        """
        if not request_keys:
            return Lookup([])
        if self.cluster:
            fields, unanswered = await self._fields_by_shard(request_keys)
            return Lookup(longest_prefix(fields, pods), unanswered)
        if mode == "pipeline":
            return Lookup(longest_prefix(await self.fields_per_key(request_keys, stop_at_gap=False), pods))
        script = self._lookup_linear if mode == "linear" else self._lookup
        args = [len(request_keys), pack_keys(request_keys), *(pods or ())]
        if self.fast is not None:
            matches, foreign = parse_lookup_reply(await self.fast.evalsha(script.sha, script.script, args))
        else:
            matches, foreign = parse_lookup_reply(await script(keys=[], args=args))
        self.foreign_reads += foreign
        return Lookup(matches)

    async def _fields_by_shard(self, request_keys: Sequence[int]) -> tuple[list[list[bytes]], int | None]:
        """HKEYS of every key, one pipeline per shard, the shards in parallel. A shard that does not
        answer (down with no replica to take over) leaves its keys empty, so each count is a lower
        bound; returns the index of the first key not answered (None when every shard answered)."""
        by_node: dict[str, list[int]] = {}
        unanswered: set[int] = set()
        for i, k in enumerate(request_keys):
            try:
                by_node.setdefault(self.client.get_node_from_key(request_key_name(k)).name, []).append(i)
            except VALKEY_ERRORS:
                unanswered.add(i)  # its slot is served by no node now
        out: list[list[bytes]] = [[] for _ in request_keys]

        async def one(idx: list[int]) -> None:
            async with self.client.pipeline(transaction=False) as pipe:
                for i in idx:
                    pipe.hkeys(request_key_name(request_keys[i]))
                replies = await pipe.execute(raise_on_error=False)
            for i, r in zip(idx, replies):
                if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
                    self.foreign_reads += 1
                elif isinstance(r, Exception):
                    unanswered.add(i)
                else:
                    out[i] = r

        results = await asyncio.gather(*(one(idx) for idx in by_node.values()), return_exceptions=True)
        for idx, res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, VALKEY_ERRORS):
                    raise res
                unanswered.update(idx)
        if len(unanswered) == len(request_keys) and request_keys:
            raise RedisConnectionError("no shard of the cluster answered the lookup")
        return out, min(unanswered) if unanswered else None

    async def fields_per_key(self, request_keys: Sequence[int], *, stop_at_gap: bool = True) -> list[list[bytes]]:
        """llm-d's Lookup: pipelined HKEYS; with ``stop_at_gap`` trimmed at the first empty key."""
        def fill(pipe) -> None:
            for k in request_keys:
                pipe.hkeys(request_key_name(k))

        replies = await self._read_pipeline(fill)
        for i, r in enumerate(replies):
            if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):  # a miss, counted
                self.foreign_reads += 1
                replies[i] = []
            elif isinstance(r, Exception):
                raise r
        if stop_at_gap:
            for i, r in enumerate(replies):
                if not r:
                    return replies[:i]
        return replies

    async def pod_ids(self) -> dict[str, str]:
        raw = await self.client.hgetall(PODS_KEY)
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def pod_info(self, pod_id: str) -> PodInfo:
        return (await self.pod_infos([pod_id]))[0]

    async def pod_infos(self, pod_ids: Sequence[str], chunk: int = 500) -> list[PodInfo]:
        """Several pods' metadata, pipelined ``chunk`` pods per round trip (bounded replies)."""
        out: list[PodInfo] = []
        for i in range(0, len(pod_ids), chunk):
            part = pod_ids[i:i + chunk]

            def fill(pipe, part=part) -> None:
                for p in part:
                    pipe.hgetall(pod_meta_key(p))
                    pipe.hlen(pod_blocks_key(p))

            replies = await self._read_pipeline(fill)
            for j, p in enumerate(part):
                out.append(pod_info_from(p, replies[2 * j], replies[2 * j + 1]))
        return out

    async def _read_pipeline(self, fill) -> list[Any]:
        """A pipeline of reads, sent once more on a fresh connection if the connection dropped under it
        (a Valkey restart, CLIENT KILL): reads are safe to repeat. Error replies come back in place."""
        for attempt in (0, 1):
            try:
                async with self.client.pipeline(transaction=False) as pipe:
                    fill(pipe)
                    return await pipe.execute(raise_on_error=False)
            except (RedisConnectionError, ConnectionError, OSError):
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def pods(self) -> list[PodInfo]:
        return await self.pod_infos(sorted(await self.pod_ids()))

    async def counters(self) -> dict[str, int]:
        raw = await self.client.hgetall(COUNTERS_KEY)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def key_count(self) -> int:
        """Keys in the index (summed over a cluster's primaries)."""
        if self.cluster:
            n = await self.client.dbsize(target_nodes=RedisCluster.PRIMARIES)
        else:
            n = await self.client.dbsize()
        return int(sum(n.values()) if isinstance(n, dict) else n)


__all__ = [
    "VALKEY_ERRORS", "ApplyResult", "Lookup", "ClearPod", "Index", "LayoutError", "MarkIncomplete", "Mutation", "PodEntry", "PodInfo", "PodMatch", "RedisError",
    "RemoveBlock", "ResponseError", "StoreBlock", "block_slot", "encode_entry", "engine_key_name", "longest_prefix",
    "make_entry", "parse_entry", "pod_blocks_key", "pod_fields_key", "pod_meta_key", "request_key_name", "tier_of",
]
