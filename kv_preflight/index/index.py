"""The index: the one interface every process reads and writes the Valkey index through.

Key names come from kv_preflight/index/layout.py (layout 3, documented there, the same on a single node and on
Valkey Cluster); what travels (PodEntry fields, mutations, replies) is in kv_preflight/index/entries.py; the Lua
scripts in kv_preflight/index/lua/. What differs between the topologies, the write path and the lookup, is a
backend (kv_preflight/index/): a single node applies a batch with one script, a cluster with a pod step,
its effects and an ack. Either way a batch is applied after a seq check against the persisted seq of
(pod, dp rank), atomic with the pod's whole state change, so several ingesters on one engine converge
on exactly one application of every batch (see docs/operations.md). A key of a foreign type never
fails a batch half way: writes to keys we do not own stand alone (the pod is flagged, a counter
counts), and our own keys are checked before the first write.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index import scripts
from kv_preflight.index.backend import VALKEY_ERRORS, IndexBackend, foreign_as_empty, read_pipeline
from kv_preflight.index.cluster import TAKEOVER_MS, ClusterBackend, cluster_client, probe_cluster
from kv_preflight.index.single import SingleNodeBackend
from kv_preflight.index.entries import (DEFAULT_TIER, ApplyResult, ClearPod, Lookup, MarkIncomplete, Mutation, PodEntry, PodMatch,
                            RemoveBlock, StoreBlock, block_slot, encode_entry, encode_mutations,
                            longest_prefix, make_entry, parse_entry, text, tier_of)
from kv_preflight.fleet.store import FleetStore
from kv_preflight.index.layout import (COUNTERS_KEY, LAYOUT_KEY, LAYOUT_VERSION, PODS_KEY, V1_PODS_KEY, engine_key_name,
                           pod_meta_key, pod_state_keys, request_key_name)
from kv_preflight.index.layout import NUM_REUSE_MS, NUMS_BYID_KEY, NUMS_KEYS, NUMS_NEXT_KEY, presence_key
from kv_preflight.index.presence import presence_value

from kv_preflight.index.resp import FastConnection
from kv_preflight.index.writer import MAX_RETRIES, REPLAN, PodWriter, Prepared

log = logging.getLogger("kvpf.index")

REGISTRY_REFRESH_S = 10.0  # a registry row this process wrote is written again after this long (_register_new)
NAMES_TTL_S = 5.0  # how long a lookup trusts its pod number -> pod map (numbers are reused only after NUM_REUSE_MS)


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
    # held request keys whose parent the pod does not hold (kv_preflight/index/pod_state.py); None: not known (the
    # lookup walks the pod rather than bisecting it until its next clear)
    orphan_keys: int | None = None


_POD_COUNTERS = ("batches", "stored", "removed", "cleared", "orphans", "restarts", "gaps_accepted", "replays",
                 "reannounced", "foreign_keys", "corrupt")


@dataclass(frozen=True)
class ScoringInfo:
    """What scoring needs of a pod (its engine block size, whether its index may miss blocks): the
    predictor reads this for every pod a prompt matches, so it is two fields of the pod's meta, not
    all of it (a prompt a thousand pods hold re-reads a thousand pods' worth every second)."""

    pod_id: str
    engine_block_size: int | None
    incomplete: bool
    # its KV cache groups (kind, sizes), when it has several (a hybrid model): the engine's rule for
    # each group decides the hit (kv_preflight/engines/hit_rules.py); None for a plain model
    groups: Mapping[int, GroupSpec] | None = None


def groups_from(raw: Any) -> dict[int, GroupSpec] | None:
    """A pod's meta "groups" ({"<group>": [kind, block size, window, chunk, eagle]}) as specs; None when it
    names fewer than two groups (a plain model) or cannot be read."""
    if not raw:
        return None
    try:
        found = msgspec.json.decode(raw)
        groups = {int(g): GroupSpec(*v) for g, v in found.items()}
    except (msgspec.DecodeError, TypeError, ValueError, AttributeError):
        return None
    return groups if len(groups) > 1 else None


def scoring_info_from(pod_id: str, reply: Any) -> ScoringInfo:
    """A pod's ScoringInfo from ``HMGET meta engine_block_size incomplete groups``. State we did not write
    (a key of another type, a block size that is not a number) makes the pod incomplete, never an error."""
    if isinstance(reply, Exception):
        return ScoringInfo(pod_id, None, True)
    raw_ebs, raw_inc = reply[0], reply[1]
    ebs = None
    bad = False
    if raw_ebs:
        try:
            ebs = int(raw_ebs)
        except ValueError:
            bad = True
    return ScoringInfo(pod_id, ebs, bad or raw_inc in (b"1", "1"), groups_from(reply[2]) if len(reply) > 2 else None)


def pod_info_from(pod_id: str, meta_raw: Any) -> PodInfo:
    """A pod's metadata from its meta's HGETALL. State we did not write (a non-integer seq, a key of
    another type) makes the pod incomplete with the reason, never an exception."""
    problems: list[str] = []
    if isinstance(meta_raw, Exception):
        problems.append(f"{pod_meta_key(pod_id)}: {str(meta_raw)[:120]}")
        meta_raw = {}
    try:  # both clients answer bytes; decoded in one pass (a thousand pods' metadata is read at once)
        meta = {k.decode(): v.decode("utf-8", "replace") for k, v in meta_raw.items()}
    except AttributeError:
        meta = {text(k): text(v) for k, v in meta_raw.items()}

    def num(name: str, value: str, kind: type = int) -> Any:
        try:
            return kind(value)
        except ValueError:
            problems.append(f"{name} is {value[:40]!r}, not a number")
            return None

    seqs = {k[4:]: v for k, raw in meta.items() if k[:4] == "seq:" and (v := num(k, raw)) is not None}
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
        blocks=(num("blocks", meta["blocks"]) or 0) if meta.get("blocks") else 0,
        counters=counters,
        orphan_keys=(num("orphan_keys", meta["orphan_keys"])
                     if meta.get("orphan_keys") and meta.get("orphan_at") == meta.get("batches", "0") else None),
    )


async def give_numbers(client, pod_ids: Sequence[str]) -> dict[str, int]:
    """Each pod's number (its bit in the presence bitmaps), given fleet-wide if it has none
    (kv_preflight/index/lua/nums.lua), and kept in its meta, where the apply script reads it (the pod's slot on a
    cluster). Idempotent. ``client``: redis-py, single node or cluster."""
    script = client.register_script(scripts.NUMS)
    nums = [int(n) for n in await script(keys=list(NUMS_KEYS), args=["give", NUM_REUSE_MS, *pod_ids])]
    async with client.pipeline(transaction=False) as pipe:
        for pod, n in zip(pod_ids, nums):
            pipe.hset(pod_meta_key(pod), "num", n)
        await pipe.execute()
    return dict(zip(pod_ids, nums))


class LayoutError(RuntimeError):
    """The index was written in another layout version (see kv_preflight/index/layout.py and ``index migrate``)."""


class Index:
    """Async access to the index, on a single node or a Valkey Cluster (``from_url`` tells which).

    Every call is bounded by the client's socket timeout. ``self.backend`` does what differs between
    the topologies (applying batches, looking up chains); everything else is the same commands on
    either client (redis-py's cluster client routes each key to its shard).
    """

    def __init__(self, client: aioredis.Redis | RedisCluster, entry_format: str = "json",
                 fast: FastConnection | None = None, *, backend: IndexBackend | None = None,
                 reannouncements: bool = False):
        self.client = client
        self.entry_format = entry_format
        self._fields: dict[tuple[str, str | None, int | None], str] = {}
        self.backend: IndexBackend = backend or SingleNodeBackend(client, fast)
        self.cluster = self.backend.cluster
        self.foreign_reads = 0  # request keys of a foreign type read as misses (a counter for /metrics)
        # pod -> (model, monotonic time) this Index last put in the registry: written again after
        # REGISTRY_REFRESH_S, so a row someone removed (a lost index, a forget) comes back with the pod's batches
        self._registered: dict[str, tuple[str, float]] = {}
        self._numbered: set[str] = set()  # pods whose number this Index has made sure of (meta "num")
        self._nums: dict[str, int] = {}  # their numbers
        # the pods this process writes: their states in memory, batches planned against them
        self.writer = PodWriter(client, cluster=self.cluster, reannouncements=reannouncements)
        self._names: dict[int, str] = {}  # pod number -> pod, for the lookup (read at most NAMES_TTL_S ago)
        self._names_at = -1e9
        self._names_lock = asyncio.Lock()
        self._names_epoch = ""  # the numbering's epoch those names were read under (kv_preflight/index/lua/nums.lua)
        self._names_mask = 0  # bit n set: number n is in self._names
        self._nums_script = client.register_script(scripts.NUMS)
        # fleet records, leases, load, settings, aliases, feeds: kv_preflight/fleet/store.py
        self.fleet = FleetStore(client, cluster=self.cluster)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, entry_format: str = "json",
                 cluster: bool | None = None, takeover_ms: int = TAKEOVER_MS, reannouncements: bool = False) -> "Index":
        """``cluster``: None asks the node (``INFO cluster``); a node that does not answer is taken
        for a single node, with a warning (``--valkey-cluster yes`` says so up front). ``reannouncements``:
        PodState.reannouncements (ingest --kv-cache-report-mode full)."""
        from kv_preflight.index import resp  # (belongs with the module's imports; kept here to touch only this method)

        if cluster is None:
            cluster = probe_cluster(url, timeout_s)
            if cluster is None:
                log.warning("%s did not answer; taking it for a single node (--valkey-cluster yes if it is a "
                            "cluster)", url.split("@")[-1])
        if cluster:
            client = cluster_client(url, timeout_s=timeout_s)
            return cls(client, entry_format, backend=ClusterBackend(client, takeover_ms=takeover_ms),
                       reannouncements=reannouncements)
        # Scripts resent once after a lost connection, being safe to run twice (kv_preflight/index/resp.py): the
        # read-only lookups; and on the lean connection the apply, whose seq check answers "dup" to a
        # batch already applied (only the ingester's checked runs go there; "import" goes by redis-py).
        lookups = {resp.script_sha(s) for s in (scripts.LOOKUP, scripts.LOOKUP_LINEAR, scripts.LOOKUP_BITS)}
        client = resp.redis_client(url, timeout_s=timeout_s, resend_scripts=lookups)
        fast = FastConnection.from_url(url, timeout_s=timeout_s,
                                       resend_scripts=lookups | {resp.script_sha(scripts.APPLY)})
        return cls(client, entry_format, fast, reannouncements=reannouncements)

    @property
    def gap_walks(self) -> int:
        """Pods the default lookup walked key by key instead of bisecting (orphan keys, or their count
        unknown: kv_preflight/index/lua/lookup_bits.lua): a counter for /metrics."""
        return self.backend.gap_walks

    @property
    def late_reads(self) -> int:
        """Cluster lookups that took a 4th round (a key moved or a shard failed mid-lookup): for /metrics."""
        return self.backend.late_reads

    async def close(self) -> None:
        await self.backend.close()
        await self.client.aclose()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    def entry_field(self, pod_id: str, medium: str | None, group_idx: int | None) -> str:
        """llm-d's entry field for a pod, tier and group (asked once per stored event: kept once made)."""
        k = (pod_id, medium, group_idx)
        f = self._fields.get(k)
        if f is None:
            if len(self._fields) > 100_000:
                self._fields.clear()
            f = self._fields[k] = encode_entry(make_entry(pod_id, medium, group_idx), self.entry_format)
        return f

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
        version = text(found)
        if version in ("2", "3"):
            raise LayoutError(f"this index has layout {version} (kv-preflight before layout 4): stop its ingesters and "
                              "run `kv-preflight index migrate --valkey-url URL` (llm-d's keys do not change)")
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
        groups: Mapping[int, GroupSpec] | None = None,
    ) -> ApplyResult:
        return (await self.apply_batches([dict(pod_id=pod_id, rank=rank, seq=seq, ts=ts, model=model,
                                                engine_block_size=engine_block_size, mutations=mutations,
                                                mode=mode, groups=groups)]))[0]

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
        lean connection (TLS, cluster) the batches run before this returns.

        Each batch is planned against its pod's state (kv_preflight/index/writer.py); a plan another writer
        made stale meanwhile is planned again and sent again here, so callers only see the seq's answers."""
        # listed before its first keys are written: no reader ever sees keys of a pod that no listing shows
        await self._register_new(batches)
        preps = await self.plan_batches(batches)
        try:
            sent = await self.backend.send(preps)
        except BaseException:
            self.writer.lost(preps)
            raise

        async def settled() -> list[ApplyResult]:
            try:
                return await self._settle(batches, preps, list(await sent))
            except BaseException:
                self.writer.lost(preps)  # (pods of batches that did apply are loaded again too: harmless)
                raise

        return asyncio.ensure_future(settled())

    async def _settle(self, batches: Sequence[dict[str, Any]], preps: list[Prepared],
                      results: list[ApplyResult]) -> list[ApplyResult]:
        """Commit what applied; plan and send again what another writer made stale (up to MAX_RETRIES)."""
        for _ in range(MAX_RETRIES + 1):
            redo = self.writer.settle(preps, results)
            if not redo:
                break
            lost = sorted({preps[i].pod for i in redo if results[i].status == "nonum"})
            again = []
            for i in redo:
                b = dict(batches[i])
                if results[i].status == REPLAN:
                    b["mode"] = "check"  # a reset another writer did already: this is the next seq
                again.append(b)
            await self._list_again(lost, again)
            await self._load_pods(sorted({b["pod_id"] for b in again}))
            redo_preps = self.writer.prepare_run(again)
            for i, prep in zip(redo, redo_preps):
                preps[i] = prep
            redone = await (await self.backend.send(redo_preps))
            for i, r in zip(redo, redone):
                results[i] = r
        else:
            stuck = [(preps[i].pod, results[i].status) for i in self.writer.settle(preps, results)]
            raise RedisConnectionError(f"batches could not be applied after {MAX_RETRIES} tries: {stuck[:3]}")
        return results

    async def _list_again(self, lost: Sequence[str], again: Sequence[dict[str, Any]]) -> None:
        """Before batches are sent again: their pods listed, then the ``lost`` ones (forgotten meanwhile by
        ``index clear --forget`` or retention, their row, number and meta gone) numbered again. In that order:
        a number given first is a key (``{nums}:byname``, the meta's ``num``) of a pod that no listing shows
        until the row comes back, which a reader in between sees."""
        for pod in lost:
            self._numbered.discard(pod)
            self._registered.pop(pod, None)
        await self._register_new(again)
        if lost:
            await self.ensure_numbers(lost)

    async def plan_batches(self, batches: Sequence[dict[str, Any]]) -> list[Prepared]:
        """The batches planned against their pods' states (numbered and loaded first), not sent yet."""
        pods = sorted({b["pod_id"] for b in batches})
        unnumbered = [p for p in pods if p not in self._numbered]
        if unnumbered:
            await self.ensure_numbers(unnumbered)
        await self._load_pods(pods)
        return self.writer.prepare_run(batches)

    async def _load_pods(self, pods: Sequence[str]) -> None:
        """Load the pods this Index has not loaded yet, or that another writer may have moved."""
        due = [p for p in pods if p not in self.writer.pods]
        if due:
            await self.writer.load(due)
            for p in due:
                if self.writer.pods[p].num is None and p in self._nums:
                    self.writer.set_num(p, self._nums[p])

    async def ensure_numbers(self, pod_ids: Sequence[str]) -> dict[str, int]:
        """``give_numbers``, remembered: this Index does not ask again for these pods."""
        nums = await give_numbers(self.client, pod_ids)
        self._numbered.update(pod_ids)
        self._nums.update(nums)
        for p, n in nums.items():
            self.writer.set_num(p, n)
        return nums

    async def pod_names(self, *, refresh: bool = False) -> dict[int, str]:
        """Pod number -> pod, read again when older than NAMES_TTL_S (a freed number is reused only
        NUM_REUSE_MS later, long after every reader has dropped its old name)."""
        if refresh or time.monotonic() - self._names_at > NAMES_TTL_S:
            asked = time.monotonic()
            async with self._names_lock:  # one read for every lookup waiting (one connection, not one each)
                if self._names_at < asked:
                    async with self.client.pipeline(transaction=False) as pipe:  # one slot: {nums}
                        pipe.hgetall(NUMS_BYID_KEY)
                        pipe.hget(NUMS_NEXT_KEY, "epoch")
                        raw, epoch = await pipe.execute()
                    self._names = {int(k): text(v) for k, v in raw.items() if text(k).isdigit()}
                    self._names_mask = sum(1 << n for n in self._names)  # which numbers are named, as bits
                    self._names_epoch = text(epoch) if epoch else ""
                    self._names_at = time.monotonic()
        return self._names

    async def _register_new(self, batches: Sequence[dict[str, Any]]) -> None:
        """Pods this Index writes for the first time (or with a new model, or not written for
        REGISTRY_REFRESH_S) go into the fleet registry, before their batch is sent: a separate write, since no
        per-batch step may touch a fleet-wide key on a cluster. The cache never outlives what Valkey holds by
        more than that; a pod's batch at seq 0 (a new engine, or a replay from the start after the index lost
        it) always writes its row."""
        now = time.monotonic()
        new = {}
        for b in batches:
            if not b.get("model") or b.get("mode") == "clear":
                continue
            had = self._registered.get(b["pod_id"])
            if had is None or had[0] != b["model"] or now - had[1] > REGISTRY_REFRESH_S or b.get("seq") == 0:
                new[b["pod_id"]] = b["model"]
        if new:
            await self.register_pods(new)

    async def register_pods(self, models: dict[str, str]) -> None:
        """Registry rows (pod -> model), written now."""
        if models:
            await self.client.hset(PODS_KEY, mapping=models)
            now = time.monotonic()
            self._registered.update({p: (m, now) for p, m in models.items()})

    def forget_cached(self, pods: Iterable[str] | None = None) -> None:
        """Drop what this process remembers of these pods (None: of every pod) having written: their
        registry rows, numbers and in-memory states are read or written again from Valkey. After a pod was
        let go (another process may forget it), and after the index lost its data."""
        if pods is None:
            pods = set(self._registered) | set(self._numbered) | set(self.writer.pods)
            self._names, self._names_at = {}, -1e9
        for pod in list(pods):
            self._registered.pop(pod, None)
            self._numbered.discard(pod)
            self._nums.pop(pod, None)
            self.writer.forget(pod)

    async def drain_outbox(self, pod_id: str, *, stale_only: bool = False) -> int:
        """Run what a stopped writer left in a pod's outbox (cluster; nothing to do on one node);
        ``stale_only``: only entries older than the takeover time (their writer is gone)."""
        return await self.backend.drain_outbox(pod_id, stale_only=stale_only)

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
            replies = foreign_as_empty(await pipe.execute(raise_on_error=False))
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
                candidates = foreign_as_empty(await pipe.execute(raise_on_error=False))
            async with self.client.pipeline(transaction=False) as pipe:
                for rks in candidates:
                    for rk in rks:
                        pipe.hkeys(rk)
                fields = iter(foreign_as_empty(await pipe.execute(raise_on_error=False)))
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

    async def held_blocks(self, pod_id: str) -> dict[tuple[int, str, int], tuple[tuple[int, ...], int]]:
        """A pod's blocks as its state log says: (engine key, tier, group) -> (request keys, physical copies)."""
        reader = PodWriter(self.client, cluster=self.cluster, reannouncements=self.writer.reannouncements)
        await reader.load([pod_id])
        return {k: (b.rks, b.copies) for k, b in reader.pods[pod_id].state.blocks.items()}

    async def export_blocks(self, pod_id: str):
        """Yield every StoreBlock a pod holds (once per physical copy), from its state log."""
        reader = PodWriter(self.client, cluster=self.cluster, reannouncements=self.writer.reannouncements)
        await reader.load([pod_id])
        for block in reader.pods[pod_id].state.stores():
            yield block

    async def memory_usage(self) -> int | None:
        """Bytes Valkey uses (summed over the primaries of a cluster); None if it does not say."""
        try:
            return await self.backend.memory_usage()
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
        self.writer.forget(pod_id)  # planned from what Valkey holds now
        held = len(await self.held_blocks(pod_id))
        await self.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model="", engine_block_size=None,
                               mutations=(), mode="clear")
        self.writer.forget(pod_id)
        if forget:
            await self._drop_pod(pod_id)
        return held

    async def _drop_pod(self, pod_id: str) -> None:
        """A cleared pod's keys, then its number, then its registry row. The row goes last: dropped before the
        number was freed, ``{nums}:byname`` named a pod that no listing showed until the free came (a reader in
        between saw it; under load for milliseconds). The other way round, a reader in between sees a listed
        pod that holds nothing, which answers like any empty pod."""
        await self.client.delete(*pod_state_keys(pod_id))
        # its bits are all clear now (the clear above ran its effects): the number may serve another pod
        await self._nums_script(keys=list(NUMS_KEYS), args=["free", NUM_REUSE_MS, pod_id])
        await self.client.hdel(PODS_KEY, pod_id)
        self._numbered.discard(pod_id)
        self._registered.pop(pod_id, None)

    async def reset_pod(self, pod_id: str) -> int:
        """The pod as a new engine starts it: entries cleared, seqs dropped, not incomplete. For a pod id
        published by another engine (a restarted stack) or rebuilt from its engine's seq 0: whatever its
        history (retired, flagged), what follows is judged from seq 0, so a gap is still seen and flagged.
        A pod with no seq cannot be reset through its seq (the engine never published), so its flag is
        cleared directly. Returns blocks removed."""
        held = await self.clear_pod(pod_id)
        info = await self.pod_info(pod_id)
        for rank, last in sorted(info.seqs.items()):
            await self.reset_if_seq(pod_id, int(rank), last)  # the first drops every rank's seq, flags cleared
        if (await self.pod_info(pod_id)).incomplete:
            await self.mark_complete(pod_id)
        return held

    async def restore_seqs(self, pod_id: str, seqs: dict[str, int]) -> None:
        """Set a pod's persisted seqs (index import): the next live batch is then judged against them."""
        if seqs:
            await self.client.hset(pod_meta_key(pod_id), mapping={f"seq:{r}": int(v) for r, v in seqs.items()})

    async def mark_incomplete(self, pod_id: str, reason: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 1, "incomplete_reason": reason})

    async def mark_complete(self, pod_id: str) -> None:
        await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 0, "incomplete_reason": ""})

    async def count(self, name: str, n: int = 1, *, pod_id: str | None = None) -> None:
        key = pod_meta_key(pod_id) if pod_id else COUNTERS_KEY
        await self.client.hincrby(key, name, n)

    # ---- read path

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *, mode: str = "script") -> list[PodMatch]:
        return (await self.lookup_detailed(request_keys, pods, mode=mode)).matches

    async def lookup_detailed(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *,
                              mode: str = "script") -> Lookup:
        """Per pod, how many leading blocks of the chain it holds. One round trip in every mode.

        ``script`` (the default) reads the chain keys' pod bitmaps in one EVALSHA per shard and walks
        them exactly (kv_preflight/index/presence.py); ``linear`` walks llm-d's entries exactly (the reference);
        ``gallop`` bisects llm-d's entries (layout 2's lookup, for the benchmark); ``pipeline`` (single
        node) sends llm-d's own pipelined HKEYS and walks in Python.
        """
        if not request_keys:
            return Lookup([])
        if mode in ("script", "bits"):
            return await self._lookup_bits(request_keys, pods)
        if mode == "pipeline" and not self.cluster:
            return Lookup(longest_prefix(await self.fields_per_key(request_keys, stop_at_gap=False), pods))
        found, foreign = await self.backend.lookup(request_keys, pods, mode)
        self.foreign_reads += foreign
        return found

    async def _lookup_bits(self, request_keys: Sequence[int], pods: Sequence[str] | None) -> Lookup:
        try:
            await self.pod_names()  # at most one read per NAMES_TTL_S, before any lookup needs it
        except VALKEY_ERRORS:
            # The numbering's shard is down (a cluster with no replica to take over): the names last read
            # serve (numbers change only when pods are forgotten); with none yet, the entries name the pods.
            if not self._names:
                return await self._lookup_entries(request_keys, pods)
        found, foreign = await self.backend.lookup_bits(request_keys, self._names_for)
        self.foreign_reads += foreign
        if found is None:  # key 1 holds entries someone else wrote: llm-d's entries decide
            return await self._lookup_entries(request_keys, pods)
        if pods is not None:
            asked = set(pods)
            found = Lookup([m for m in found.matches if m.pod_id in asked], found.unanswered_from,
                           found.group_bits)
        return found

    async def _lookup_entries(self, request_keys: Sequence[int], pods: Sequence[str] | None) -> Lookup:
        found, foreign = await self.backend.lookup(request_keys, pods, "linear")
        self.foreign_reads += foreign
        return found

    async def _names_for(self, nums: Iterable[int] | int, epoch: str = "") -> dict[int, str]:
        """The names, read again when a number is unknown or the epoch changed; ``nums`` may be a bitmap
        (an int: a thousand pods at a key are one AND, not a thousand dict probes)."""
        names = self._names
        if isinstance(nums, int):
            unknown = bool(nums & ~self._names_mask)
        else:
            unknown = any(n not in names for n in nums)
        if (epoch and epoch != self._names_epoch) or unknown:
            try:
                names = await self.pod_names(refresh=True)  # a pod numbered since the names were read
            except VALKEY_ERRORS:
                pass  # its bits are ignored until the names can be read
        return names

    async def fields_per_key(self, request_keys: Sequence[int], *, stop_at_gap: bool = True) -> list[list[bytes]]:
        """llm-d's Lookup: pipelined HKEYS; with ``stop_at_gap`` trimmed at the first empty key."""
        def fill(pipe) -> None:
            for k in request_keys:
                pipe.hkeys(request_key_name(k))

        replies = await read_pipeline(self.client, fill)
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
        try:
            raw = await self.client.hgetall(PODS_KEY)
        except AttributeError as exc:  # redis-py's cluster client, on a node whose connection died under it
            raise RedisConnectionError(f"connection lost reading the registry: {exc}") from None
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def pod_info(self, pod_id: str) -> PodInfo:
        return (await self.pod_infos([pod_id]))[0]

    async def pod_infos(self, pod_ids: Sequence[str], chunk: int = 500) -> list[PodInfo]:
        """Several pods' metadata, pipelined ``chunk`` pods per round trip (bounded replies)."""
        out: list[PodInfo] = []
        for i in range(0, len(pod_ids), chunk):
            part = pod_ids[i:i + chunk]
            replies = await self._read_commands([("HGETALL", pod_meta_key(p)) for p in part])
            for p, meta in zip(part, replies):
                if isinstance(meta, list):  # the lean connection answers HGETALL flat
                    meta = dict(zip(meta[::2], meta[1::2]))
                out.append(pod_info_from(p, meta))
        return out

    async def presence(self, request_keys: Sequence[int]) -> list[dict[str, bytes]]:
        """Each request key's presence hash (field -> bitmap, counts stripped), every field: what the engine's
        rule for a hybrid model's other KV cache groups reads (kv_preflight/predictor/scoring/groups.py)."""
        replies = await self._read_commands([("HGETALL", presence_key(k)) for k in request_keys])
        out: list[dict[str, bytes]] = []
        for r in replies:
            if isinstance(r, Exception):
                out.append({})
                continue
            items = r.items() if isinstance(r, dict) else zip(r[::2], r[1::2])
            out.append({text(f): presence_value(v)[1] for f, v in items})
        return out

    async def pod_numbers(self, pods: Iterable[str]) -> dict[str, int]:
        """Pods' numbers (their bit in every bitmap), from the names the lookup read."""
        by_name = {name: num for num, name in (await self.pod_names()).items()}
        return {p: by_name[p] for p in pods if p in by_name}

    async def meta_fields(self, pod_ids: Sequence[str], fields: Sequence[str], chunk: int = 1000
                          ) -> list[list[Any] | None]:
        """Some fields of several pods' meta (HMGET each, pipelined ``chunk`` pods per round trip); None for a
        pod whose meta is of a foreign type."""
        out: list[list[Any] | None] = []
        for i in range(0, len(pod_ids), chunk):
            replies = await self._read_commands([("HMGET", pod_meta_key(p), *fields) for p in pod_ids[i:i + chunk]])
            out.extend(None if isinstance(r, Exception) else r for r in replies)
        return out

    async def scoring_infos(self, pod_ids: Sequence[str], chunk: int = 1000) -> list[ScoringInfo]:
        """Several pods' ScoringInfo, pipelined ``chunk`` pods per round trip: one HMGET each."""
        out: list[ScoringInfo] = []
        for i in range(0, len(pod_ids), chunk):
            part = pod_ids[i:i + chunk]
            replies = await self._read_commands([("HMGET", pod_meta_key(p), "engine_block_size", "incomplete", "groups")
                                                 for p in part])
            out.extend(scoring_info_from(p, r) for p, r in zip(part, replies))
        return out

    async def _read_commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        return await self.backend.read_commands(commands)

    async def pods(self) -> list[PodInfo]:
        return await self.pod_infos(sorted(await self.pod_ids()))

    async def counters(self) -> dict[str, int]:
        raw = await self.client.hgetall(COUNTERS_KEY)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def key_count(self) -> int:
        """Keys in the index (summed over a cluster's primaries)."""
        return await self.backend.key_count()


__all__ = [
    "VALKEY_ERRORS", "give_numbers", "ApplyResult", "Lookup", "DEFAULT_TIER", "block_slot", "encode_mutations", "ClearPod", "Index", "LayoutError", "MarkIncomplete", "Mutation", "PodEntry", "PodInfo", "PodMatch", "ScoringInfo", "RedisError",
    "RemoveBlock", "ResponseError", "StoreBlock", "block_slot", "encode_entry", "engine_key_name", "longest_prefix",
    "make_entry", "parse_entry", "pod_meta_key", "request_key_name", "tier_of",
]
