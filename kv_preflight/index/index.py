"""The index: the one interface every process applies batches and looks chains up through.

Key names come from kv_preflight/index/layout.py (layout 4, documented there, the same on a single node and on
Valkey Cluster); what travels (PodEntry fields, mutations, replies) is in kv_preflight/index/entries.py; the Lua
scripts in kv_preflight/index/lua/. What differs between the topologies, the write path and the lookup, is a
backend (kv_preflight/index/): a single node applies a batch with one script, a cluster with a pod step,
its effects and an ack. Either way a batch is applied after a seq check against the persisted seq of
(pod, dp rank), atomic with the pod's whole state change, so several ingesters on one engine converge
on exactly one application of every batch (see docs/operations.md). A key of a foreign type never
fails a batch half way: writes to keys we do not own stand alone (the pod is flagged, a counter
counts), and our own keys are checked before the first write.

What is not the apply or the lookup lives beside it, each taking the client or backend it needs: pods'
metadata and counters (pod_meta.py, ``Index.meta``), pod numbers (numbering.py, ``Index.numbering``), the
fleet's records (kv_preflight/index/fleet_store.py, ``Index.fleet``), export and import (transfer.py), the layout
check (layout_version.py), engine keys (engine_keys.py), and which backend a URL gets (connect.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index.backend import VALKEY_ERRORS, read_fields
from kv_preflight.index.cluster import ClusterBackend
from kv_preflight.index.connect import TAKEOVER_MS, IndexBackend, connect
from kv_preflight.index.single import SingleNodeBackend
from kv_preflight.index.entries import (ApplyResult, Carry, ClearPod, Lookup, MarkIncomplete, Mutation, PodMatch, RemoveBlock,
                                       StoreBlock, encode_entry, longest_prefix, make_entry, parse_entry, text, tier_of)
from kv_preflight.index.fleet_store import FleetStore, ValkeyFleetStore
from kv_preflight.index.layout import (ADAPTERS_KEY, PODS_KEY, adapter_field, engine_key_name, parse_adapter_field,
                                      pod_state_keys)
from kv_preflight.index.numbering import Numbering, give_numbers
from kv_preflight.index.presence import GroupBits, read_group_bits
from kv_preflight.index.rank_pods import RANK_SEPARATOR, base_pod, family_bits
from kv_preflight.index.pod_meta import PodMeta
from kv_preflight.index.pod_state import PodState

from kv_preflight.index.resp import FastConnection
from kv_preflight.index.transfer import held_blocks
from kv_preflight.index.writer import MAX_RETRIES, REPLAN, PodWriter, Prepared

# A writer of data-parallel ranks reads their siblings' numbers again this often: far less than a freed number's
# reuse time (layout.NUM_REUSE_MS), so a number freed and given to another pod is never taken for a sibling's
FAMILIES_TTL_S = 10.0
REGISTRY_REFRESH_S = 10.0  # a registry row this process wrote is written again after this long (_register_new)


class Index:
    """Async access to the index, on a single node or a Valkey Cluster (``from_url`` tells which).

    Every call is bounded by the client's socket timeout. ``self.backend`` does what differs between
    the topologies (applying batches, looking up chains); everything else is the same commands on
    either client (redis-py's cluster client routes each key to its shard).
    """

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, entry_format: str = "json",
                 fast: FastConnection | None = None, *, backend: IndexBackend | None = None,
                 reannouncements: bool = False):
        self.client = client
        self.entry_format = entry_format
        self._fields: dict[tuple[str, str | None, int | None], str] = {}
        if backend is None:  # a client given whole (a library user's): its kind says which backend
            backend = (ClusterBackend(client) if isinstance(client, aioredis.RedisCluster)
                       else SingleNodeBackend(client, fast))
        self.backend: IndexBackend = backend
        self.cluster = self.backend.cluster
        self.foreign_reads = 0  # request keys of a foreign type read as misses (a counter for /metrics)
        # pod -> (model, monotonic time) this Index last put in the registry: written again after
        # REGISTRY_REFRESH_S, so a row someone removed (a lost index, a forget) comes back with the pod's batches
        self._registered: dict[str, tuple[str, float]] = {}
        # (pod, adapter) -> monotonic time this Index last put it in kvpf:adapters (written again as registry rows are)
        self._adapters: dict[tuple[str, str], float] = {}
        self._numbered: set[str] = set()  # pods whose number this Index has made sure of (meta "num")
        self._nums: dict[str, int] = {}  # their numbers
        self._families: dict[str, dict[str, int]] = {}  # pod -> its data-parallel ranks' pods and numbers (>1)
        self._families_at = float("-inf")
        # the pods this process writes: their states in memory, batches planned against them
        self.writer = PodWriter(client, cluster=self.cluster, reannouncements=reannouncements)
        # pod number -> pod for the lookup, pods' numbers, a forgotten pod's number freed: kv_preflight/index/numbering.py
        self.numbering = Numbering(client)
        # fleet records, leases, load, settings, aliases, feeds: kv_preflight/index/fleet_store.py
        self.fleet: FleetStore = ValkeyFleetStore(client, self.backend)
        # the registry, pods' meta (seqs, flags, counters) and the index-wide counters: kv_preflight/index/pod_meta.py
        self.meta = PodMeta(client, self.backend)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, entry_format: str = "json",
                 cluster: bool | None = None, takeover_ms: int = TAKEOVER_MS, reannouncements: bool = False) -> "Index":
        """``cluster``: None asks the node (``INFO cluster``); a node that does not answer is taken
        for a single node, with a warning (``--valkey-cluster yes`` says so up front): the backend is
        kv_preflight/index/connect.py's choice. ``reannouncements``: PodState.reannouncements (ingest
        --kv-cache-report-mode full)."""
        client, backend = connect(url, timeout_s=timeout_s, cluster=cluster, takeover_ms=takeover_ms)
        return cls(client, entry_format, backend=backend, reannouncements=reannouncements)

    @property
    def gap_walks(self) -> int:
        """Pods the default lookup walked key by key instead of bisecting (orphan keys, or their count
        unknown: kv_preflight/index/lua/lookup_bits.lua): a counter for /metrics."""
        return self.backend.gap_walks

    @property
    def late_reads(self) -> int:
        """Cluster lookups that took a 4th round (a key moved or a shard failed mid-lookup): for /metrics."""
        return self.backend.late_reads

    def write_counts(self) -> dict[str, int]:
        """The write path's own counters, for the ingester's /metrics (each only grows; all 0 on one node, where one
        script applies a batch whole): ``unreplicated``, runs whose changes no replica confirmed in time, kept in
        the outbox; ``confirmed_late``, such entries deleted once a replica confirmed them; ``late_runs``, runs a
        writer left to a drain, come to past its entries' window (kv_preflight/index/cluster/writes.py)."""
        return self.backend.write_counts()

    @property
    def partial_reads(self) -> bool:
        """Whether one part of the index (a shard) can fail while the others answer: then a caller goes on
        with what answers, and the lookup says how far it read ("partial"), rather than failing."""
        return self.backend.partial_reads

    @property
    def label(self) -> str:
        """What a log line calls the topology ("" for a plain single node)."""
        return self.backend.label

    async def close(self) -> None:
        await self.backend.close()
        await self.client.aclose()

    async def __aenter__(self) -> "Index":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def ping(self) -> bool:
        return bool(await self.client.ping())

    def entry_field(self, pod_id: str, medium: str | None, group_idx: int | None) -> str:
        """llm-d's entry field for a pod, tier and group (asked once per stored event: kept once made)."""
        k = (pod_id, medium, group_idx)
        f = self._fields.get(k)
        if f is None:
            if len(self._fields) > 100_000:
                self._fields.clear()
            # a data-parallel rank's entries name its pod: llm-d's readers know no ranks (rank_pods.py)
            f = self._fields[k] = encode_entry(make_entry(base_pod(pod_id), medium, group_idx), self.entry_format)
        return f

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
        adapters: Iterable[str] = (),
        carries: Mapping[int, Carry] | None = None,
    ) -> ApplyResult:
        """One batch: ``mutations`` at ``seq`` of the pod's rank ``rank``; ``carries``, what its stores left unkeyed
        (engine key -> ``Carry``, kept in the pod's state for their children: ``PodState.carries``)."""
        return (await self.apply_batches([dict(pod_id=pod_id, rank=rank, seq=seq, ts=ts, model=model,
                                                engine_block_size=engine_block_size, mutations=mutations,
                                                mode=mode, groups=groups, adapters=adapters, carries=carries)]))[0]

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
        elif self._families and time.monotonic() - self._families_at > FAMILIES_TTL_S:
            await self._learn_families()  # a rank numbered by another process, a number freed and reused
        await self._load_pods(pods)
        return self.writer.prepare_run(batches)

    async def pod_state(self, pod_id: str) -> PodState:
        """The pod's state as this writer plans its batches against it, loaded from its log if it is not yet."""
        await self._load_pods([pod_id])
        return self.writer.pods[pod_id].state

    async def _load_pods(self, pods: Sequence[str]) -> None:
        """Load the pods this Index has not loaded yet, or that another writer may have moved."""
        due = [p for p in pods if p not in self.writer.pods]
        if due:
            await self.writer.load(due)
            for p in due:
                if self.writer.pods[p].num is None and p in self._nums:
                    self.writer.set_num(p, self._nums[p])

    async def ensure_numbers(self, pod_ids: Sequence[str]) -> dict[str, int]:
        """``give_numbers``, remembered: this Index does not ask again for these pods. A data-parallel rank's
        pod is numbered with it (rank 0 is there whenever a rank is), and the ranks' siblings are learnt
        (``_learn_families``)."""
        ranks = [p for p in pod_ids if RANK_SEPARATOR in p]
        wanted = list(dict.fromkeys([*pod_ids, *(base_pod(p) for p in ranks)]))
        nums = await give_numbers(self.client, wanted, self.backend.numbering_copies)
        self._numbered.update(wanted)
        self._nums.update(nums)
        for p, n in nums.items():
            self.writer.set_num(p, n)
        if ranks or any(p in self._families for p in wanted):
            await self._learn_families()
        return {p: nums[p] for p in pod_ids}

    async def _learn_families(self) -> None:
        """Each data-parallel pod's ranks and their numbers (this process's and every other's, from the
        numbering), so a rank's changes carry its siblings' bits (changes.lua's ``G``): a rank letting go of a
        block must not delete the llm-d entry its pod's other ranks still hold."""
        try:
            names = await self.numbering.pod_names(refresh=True)
        except VALKEY_ERRORS:
            names = self.numbering.names
        nums = {name: num for num, name in names.items()}
        nums.update(self._nums)
        families: dict[str, dict[str, int]] = {}
        for name, num in nums.items():
            families.setdefault(base_pod(name), {})[name] = num
        self._families = {base: fam for base, fam in families.items() if len(fam) > 1}
        self._families_at = time.monotonic()
        self.writer.sibs = {name: family_bits(name, fam) for fam in self._families.values() for name in fam}

    async def _register_new(self, batches: Sequence[dict[str, Any]]) -> None:
        """Pods this Index writes for the first time (or with a new model, or not written for
        REGISTRY_REFRESH_S) go into the fleet registry, before their batch is sent: a separate write, since no
        per-batch step may touch a fleet-wide key on a cluster. The cache never outlives what Valkey holds by
        more than that; a pod's batch at seq 0 (a new engine, or a replay from the start after the index lost
        it) always writes its row."""
        now = time.monotonic()
        new = {}
        adapters = {}
        for b in batches:
            if not b.get("model") or b.get("mode") == "clear":
                continue
            had = self._registered.get(b["pod_id"])
            if had is None or had[0] != b["model"] or now - had[1] > REGISTRY_REFRESH_S or b.get("seq") == 0:
                new[b["pod_id"]] = b["model"]
            for adapter in b.get("adapters") or ():
                at = self._adapters.get((b["pod_id"], adapter))
                if at is None or now - at > REGISTRY_REFRESH_S:
                    adapters[(b["pod_id"], adapter)] = b["model"]
        if new:
            await self.register_pods(new)
        if adapters:
            await self.register_adapters(adapters)

    async def register_pods(self, models: dict[str, str]) -> None:
        """Registry rows (pod -> model), written now."""
        if models:
            await self.client.hset(PODS_KEY, mapping=models)
            now = time.monotonic()
            self._registered.update({p: (m, now) for p, m in models.items()})

    async def register_adapters(self, adapters: Mapping[tuple[str, str], str]) -> None:
        """``kvpf:adapters`` rows ((pod, adapter) -> the pod's model), written now."""
        if adapters:
            await self.client.hset(ADAPTERS_KEY, mapping={adapter_field(p, a): m for (p, a), m in adapters.items()})
            now = time.monotonic()
            self._adapters.update({k: now for k in adapters})

    def forget_cached(self, pods: Iterable[str] | None = None) -> None:
        """Drop what this process remembers of these pods (None: of every pod) having written: their
        registry rows, numbers and in-memory states are read or written again from Valkey. After a pod was
        let go (another process may forget it), and after the index lost its data."""
        if pods is None:
            pods = set(self._registered) | set(self._numbered) | set(self.writer.pods)
            self.numbering.forget_names()
        pods = list(pods)
        gone = set(pods)
        self._adapters = {k: v for k, v in self._adapters.items() if k[0] not in gone}
        for pod in pods:
            self._registered.pop(pod, None)
            self._numbered.discard(pod)
            self._nums.pop(pod, None)
            self.writer.forget(pod)
        self.backend.forget(pods)

    async def drain_outbox(self, pod_id: str, *, stale_only: bool = False) -> int:
        """Run what a stopped writer left in a pod's outbox (cluster; nothing to do on one node): this writer's
        entries, and another writer's once every one of them is older than the takeover time (its writer is gone;
        while one is younger, nothing runs: that writer's changes are on their way, and a clearing after this
        waits for them, lua/pod_step.lua "busy"). ``stale_only``: this writer's entries kept for a replica are only
        confirmed, not run again."""
        return await self.backend.drain_outbox(pod_id, stale_only=stale_only)

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        """What stopped writers left in these pods' outboxes (only entries older than the takeover time), run,
        ``at_once`` pods side by side: per pod the entries run, or the Valkey error that stopped it (``{}`` on
        one node: it has no outbox)."""
        return await self.backend.drain_outboxes(pods, at_once=at_once)

    async def memory_usage(self) -> int | None:
        """Bytes Valkey uses (summed over the primaries of a cluster); None if it does not say."""
        try:
            return await self.backend.memory_usage()
        except (RedisError, ValueError, TypeError):
            return None

    async def reset_if_seq(self, pod_id: str, rank: int, expected_last: int, *, flag: str | None = None) -> bool:
        """Clear a restarted engine's pod, unless its seq moved on since ``expected_last`` was read. The pod reads
        exact after it (a new engine's state), unless ``flag`` gives the reason it stays flagged, in the same step (a
        rebuild's clearing: flagged again after it, the pod read exact and empty for that moment)."""
        result = await self.apply_batch(pod_id=pod_id, rank=rank, seq=expected_last, ts=0.0, model="",
                                        engine_block_size=None, mutations=(MarkIncomplete(flag),) if flag else (),
                                        mode="reset_if")
        return result.status == "applied"

    async def clear_pod(self, pod_id: str, *, forget: bool = False) -> int:
        """Remove every entry of a pod; ``forget`` also drops its metadata. Returns blocks removed."""
        await self.drain_outbox(pod_id)
        self.writer.forget(pod_id)  # planned from what Valkey holds now
        held = len(await held_blocks(self.writer, pod_id))
        await self.apply_batch(pod_id=pod_id, rank=0, seq=0, ts=0.0, model="", engine_block_size=None,
                               mutations=(), mode="clear")
        if self.backend.left_to_drain(pod_id):  # the clear's changes left to a drain (cluster/window.py): run now,
            await self.drain_outbox(pod_id)  # so a success means they ran (and ``forget`` deletes no unrun entry)
            if self.backend.left_to_drain(pod_id):
                raise RedisConnectionError(f"pod {pod_id}: the clear's changes were left to a drain that did not run "
                                           "them (this process stalled past its window, or another drain holds the "
                                           "pod's outbox); try again")
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
        await self.numbering.free(pod_id)
        fields = [f for f in map(text, await self.client.hkeys(ADAPTERS_KEY) or ())
                  if (got := parse_adapter_field(f)) is not None and got[0] == pod_id]
        if fields:
            await self.client.hdel(ADAPTERS_KEY, *fields)
        await self.client.hdel(PODS_KEY, pod_id)
        self._numbered.discard(pod_id)
        self._registered.pop(pod_id, None)
        self._adapters = {k: v for k, v in self._adapters.items() if k[0] != pod_id}

    async def reset_pod(self, pod_id: str) -> int:
        """The pod as a new engine starts it: entries cleared, seqs dropped, not incomplete. For a pod id
        published by another engine (a restarted stack) or rebuilt from its engine's seq 0: whatever its
        history (retired, flagged), what follows is judged from seq 0, so a gap is still seen and flagged.
        A pod with no seq cannot be reset through its seq (the engine never published), so its flag is
        cleared directly. Returns blocks removed."""
        held = await self.clear_pod(pod_id)
        info = await self.meta.pod_info(pod_id)
        for rank, last in sorted(info.seqs.items()):
            await self.reset_if_seq(pod_id, int(rank), last)  # the first drops every rank's seq, flags cleared
        if (await self.meta.pod_info(pod_id)).incomplete:
            await self.meta.mark_complete(pod_id)
        return held

    # ---- read path

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *, mode: str = "script") -> list[PodMatch]:
        return (await self.lookup_detailed(request_keys, pods, mode=mode)).matches

    async def lookup_detailed(self, request_keys: Sequence[int], pods: Sequence[str] | None = None, *,
                              mode: str = "script") -> Lookup:
        """Per pod, how many leading blocks of the chain it holds. One round trip in every mode.

        ``script`` (the default) reads the chain keys' pod bitmaps in one EVALSHA per shard and walks
        them exactly (kv_preflight/index/presence.py); ``linear`` walks llm-d's entries exactly (the reference);
        ``pipeline`` (single node) sends llm-d's own pipelined HKEYS and walks in Python.
        """
        if not request_keys:
            return Lookup([])
        if mode in ("script", "bits"):
            return await self._lookup_bits(request_keys, pods)
        found, foreign = await self.backend.lookup(request_keys, pods, mode)
        self.foreign_reads += foreign
        return found

    async def _lookup_bits(self, request_keys: Sequence[int], pods: Sequence[str] | None) -> Lookup:
        try:
            await self.numbering.pod_names()  # at most one read per NAMES_TTL_S, before any lookup needs it
        except VALKEY_ERRORS:
            # The numbering's shard is down (a cluster with no replica to take over): the names last read
            # serve (numbers change only when pods are forgotten); with none yet, the entries name the pods.
            if not self.numbering.names:
                return await self._lookup_entries(request_keys, pods)
        found, foreign = await self.backend.lookup_bits(request_keys, self.numbering.names_for)
        self.foreign_reads += foreign
        if found is None:  # key 1 holds entries someone else wrote: llm-d's entries decide
            return await self._lookup_entries(request_keys, pods)
        if pods is not None:  # a pod named stands for its data-parallel ranks too (rank_pods.py)
            asked = set(pods)
            found = dataclasses.replace(found, matches=[m for m in found.matches
                                                        if m.pod_id in asked or base_pod(m.pod_id) in asked])
        return found

    async def _lookup_entries(self, request_keys: Sequence[int], pods: Sequence[str] | None) -> Lookup:
        found, foreign = await self.backend.lookup(request_keys, pods, "linear")
        self.foreign_reads += foreign
        return found

    async def group_presence(self, request_keys: Sequence[int], pods: Iterable[str], *,
                             have: Sequence[GroupBits] | None = None) -> tuple[Sequence[GroupBits], dict[str, int]]:
        """The keys' other-group bitmaps and the pods' numbers (their bit in each): what a hybrid model's other KV
        cache groups' rules read (kv_preflight/predictor/scoring/groups.py). ``have``: the lookup's own read of them
        (``Lookup.group_bits``), taken when it covers the keys, so no second round."""
        if have is not None and len(have) >= len(request_keys):
            bits = have[:len(request_keys)]
        else:
            bits = await read_group_bits(self.backend, request_keys)
        return bits, await self.numbering.pod_numbers(pods)

    async def fields_per_key(self, request_keys: Sequence[int], *, stop_at_gap: bool = True) -> list[list[bytes]]:
        """llm-d's Lookup: pipelined HKEYS; with ``stop_at_gap`` trimmed at the first empty key."""
        replies, foreign = await read_fields(self.client, request_keys)
        self.foreign_reads += foreign
        if stop_at_gap:
            for i, r in enumerate(replies):
                if not r:
                    return replies[:i]
        return replies

    async def key_count(self) -> int:
        """Keys in the index (summed over a cluster's primaries)."""
        return await self.backend.key_count()


# besides the Index, values its callers import from here (their home is entries.py, backend.py, layout.py)
__all__ = ["VALKEY_ERRORS", "ApplyResult", "ClearPod", "Index", "MarkIncomplete", "PodMatch", "RemoveBlock", "StoreBlock",
           "encode_entry", "engine_key_name", "longest_prefix", "make_entry", "parse_entry", "tier_of"]
