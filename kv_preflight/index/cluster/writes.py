"""Valkey Cluster: a batch applied without cross-slot scripts, exactly once, surviving a kill -9 or a failover.

A batch touches keys on many shards, so no script can apply it atomically. The guarantees are kept
another way (docs/architecture.md, "Valkey Cluster"):

1. **Pod step** (lua/pod_step.lua), one script in the pod's slot (every per-pod key carries the ``{<pod>}``
   hash tag): the seq and generation checks and the pod's own writes (its state log, seq, counters) happen
   atomically, and the batch's changes to the keys every pod shares are written to the pod's outbox in the
   same step.
2. **Changes**, in rounds, each pipelined per shard and the shards in parallel:
   A. each request key's change (lua/effects.lua: its llm-d entry and its presence bit, in its slot); each
      shard says which request keys it left with no entry at all;
   B. ``engine:<ek>`` gains a stored block's request keys (ZADD, after A: the key holds the entry first), and
      loses those of a block let go whose request keys all came back empty from A (ZREM: llm-d's rule), in
      the run's order;
   C. for each such ZREM, its request keys are looked at again (HLEN): another pod that stored the same block
      between A and B wrote its entry before its ZADD, so a key that holds an entry again means that ZADD may
      have run before our ZREM, and
   D. ``engine:<ek>`` gets its request keys back.
   Every change is idempotent (a set bit set again, an entry written again, a ZREM of what is gone), so
   running an outbox entry twice, or after a failover half ran it, changes nothing.
3. **Ack**: the outbox entry is deleted once every shard it touched has it on a replica (the barrier), and
   only if the slot map did not move during the run (a run stalled across a failover wrote to the old master;
   asked after it, the promoted replica would confirm writes it never had). Else it stays: while the slot map
   is the one it ran by, the chores only ask the barrier again each second (``Kept``: a replica down for
   minutes leaves thousands of entries, and running them all again each second cost as much as the outbox
   held); once the map moved, it runs again on the primaries serving its keys now.

An ingester killed between 1 and 3 leaves the entry; the next pod step of any ingester for that pod
answers "pending" (the entry is older than the takeover time) or "busy" (younger: its writer is
presumably running it), and the caller runs the entries first (``drain``: none while another writer's entry is
young, its writer alive); every ingester also runs its pods' stale entries each second. So nothing is lost and,
since the counts live only in the pod step, a retry never changes counts.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from typing import Any, NamedTuple

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kv_preflight.index import hooks, scripts
from kv_preflight.index.backend import VALKEY_ERRORS, evalsha_pipeline
from kv_preflight.index.cluster.barrier import ReplicationBarrier
from kv_preflight.index.cluster.drain_lease import BUSY, EMPTY, DrainLease
from kv_preflight.index.cluster.round_a import run_round_a
from kv_preflight.index.cluster.routing import REDIRECTS, Shards, by_primary
from kv_preflight.index.cluster.window import Late, Renewable, in_time, window_end
from kv_preflight.index.cluster.outbox_ops import (OutboxEntry, _engine_add, _engine_round, _foreign, _native,
                                                   _raced, _run_keys, decode_entry, outbox_payload,
                                                   read_payload)
from kv_preflight.index.entries import ApplyResult, apply_result, text
from kv_preflight.index.layout import ENGINE_PREFIX, pod_meta_key, pod_outbox_key
from kv_preflight.index.pod_state import KeyChange
from kv_preflight.index.writer import Prepared

log = logging.getLogger("kvpf.index")
TAKEOVER_MS = 2000  # an outbox entry older than this is run by whoever applies the pod's next batch


class Touched(NamedTuple):
    """What a run wrote, for its ack: the keys (per name prefix, the values: request keys, engine keys), the
    slot map it wrote by (``Shards.map_mark``; None: nothing written) and that map's content
    (``Shards.map_digest``)."""

    keys: list[tuple[str, list[int]]]
    mark: Any
    digest: Any = None


class Kept(NamedTuple):
    """An entry whose changes ran whole and that stays only until a replica confirms them: the slot map they
    ran by (``Shards.map_digest``) and the primaries they went to, each by name (redis-py makes new node
    objects each time it reads the map) and incarnation (``ReplicationBarrier.incarnations``: run id and
    replication id). While the map and every incarnation hold, those primaries still have what the run wrote,
    and running it again would write the same: the chores only ask the barrier again."""

    digest: Any
    nodes: tuple[tuple[str, tuple[str, str]], ...]


class ClusterWrites:
    """The write path of the module docstring."""

    def __init__(self, client: RedisCluster, shards: Shards, *, writer: str, takeover_ms: int = TAKEOVER_MS):
        self.client = client
        self.shards = shards
        self.writer = writer
        self.takeover_ms = takeover_ms
        self._pod_step = client.register_script(scripts.POD_STEP)
        self._effects = client.register_script(scripts.EFFECTS)
        self._drain_lease = client.register_script(scripts.DRAIN_LEASE)
        self.barrier = ReplicationBarrier(client)
        self.unreplicated = 0  # runs whose changes a replica had not confirmed in time (kept in the outbox)
        self.readded = 0  # engine keys given back their request keys in round D (a store raced our ZREM)
        self.malformed = 0  # outbox entries that could not be decoded (logged and deleted, never run)
        self.late_runs = 0  # runs this writer left to a drain: it came to them past their window (``send``)
        # pods with entries of this writer left to a drain that has not run them yet: their next entries are left
        # too (run ahead of those, they would be kept as run whole and never run again after them)
        self._left: set[str] = set()
        self.confirmed_late = 0  # entries of ours deleted when a replica confirmed them later, not run again
        self._kept: dict[str, dict[str, Kept]] = {}  # pod -> outbox field -> what its run wrote (``Kept``)

    def writer_arg(self) -> str:
        return f"{self.writer}@{self.takeover_ms}"

    # ---- step 1 and the loop

    async def send(self, preps: Sequence[Prepared]) -> list[ApplyResult]:
        """Pod steps (pipelined, each in its pod's slot), then the changes of the applied ones on their
        shards, then the acks. A pod whose outbox holds another writer's entry is retried after that
        entry ran ("pending": run it now) or its writer had time to ("busy")."""
        writer = self.writer_arg()
        keys = [p.keys for p in preps]
        planned = [OutboxEntry(p.num or 0, p.sibs, p.changes) for p in preps]  # run as they are, not decoded
        args = [p.head + [writer, "1" if p.gap else "0", outbox_payload(o) if o.changes else ""]
                for p, o in zip(preps, planned)]
        pods = [p.pod for p in preps]
        results: list[ApplyResult | None] = [None] * len(preps)
        todo = list(range(len(preps)))
        deadline = time.monotonic() + 2 * self.takeover_ms / 1000 + 5
        while todo:
            # this writer's window on the entries its steps write (cluster/window.py): past it, they are left in
            # the outbox, to run in order at the next drain (its chores, within a second), or taken over meanwhile
            until = window_end(self.takeover_ms)
            replies = await self._pod_steps([keys[i] for i in todo], [args[i] for i in todo])
            entries: list[tuple[str, str, bytes]] = []
            to_run: list[OutboxEntry] = []
            ackable: list[tuple[str, str, bytes]] = []
            held_back: set[str] = set()  # pods with an older entry of ours still there: ack in order
            written: dict[str, int] = {}  # per pod, entries this round wrote (a pod's steps run in order)
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
                results[i] = apply_result(r[:5])
                if status == "applied" and len(r) > 5 and text(r[5]):
                    entry = (pods[i], text(r[5]), args[i][-1])
                    entries.append(entry)
                    to_run.append(planned[i])
                    owners.append(i)
                    # own entries older than this round's are another run's (kept: not replicated in
                    # time, or run again by a drain): this pod's entries wait for that one, in order
                    if int(r[6]) > written.get(pods[i], 0) or pods[i] in held_back:
                        held_back.add(pods[i])
                    else:
                        ackable.append(entry)
                    written[pods[i]] = written.get(pods[i], 0) + 1
            hooks.after_step("pod_step", len(entries))  # (kv_preflight/index/hooks.py: nothing, but in a crash test)
            if self._left and entries:  # behind entries left to a drain: left too, to run after them, in order
                kept_on = [k for k, e in enumerate(entries) if e[0] not in self._left]
                entries, to_run, owners = ([xs[k] for k in kept_on] for xs in (entries, to_run, owners))
                ackable = [e for e in ackable if e[0] not in self._left]
            if entries:
                try:
                    foreign, first, touched = await self.run(to_run, until=until)
                except Late as exc:
                    self.late_runs += 1
                    self._left.update(e[0] for e in entries)
                    log.warning("pods %s: a batch's changes left to the next drain: %s",
                                sorted({e[0] for e in entries})[:5], exc)
                    entries = []
            if entries:
                hooks.after_step("effects", len(entries))
                # Deleted only once replicated (else they run again after a failover); a pod's
                # entries behind one of ours still there wait for the next drain, in order.
                nodes = await self._written_to(touched)
                acked = not ackable or (nodes is not None and await self._confirm_and_delete(ackable, nodes))
                if not acked:
                    self.unreplicated += 1
                await self._keep([e for e in entries if not acked or e not in ackable], nodes, touched)
                if foreign:
                    await self._flag_foreign(entries, foreign, first)
                    for i in owners:
                        res = results[i]
                        assert res is not None
                        results[i] = ApplyResult(res.status, res.last_seq, res.foreign_writes + foreign, first,
                                                 res.gen)
            ran = 0
            for pod in sorted(drain):  # nothing runs while a live writer's entry is young: "busy" until it is not
                ran += await self.drain(pod, others_older_than_ms=self.takeover_ms)
            if again:
                if time.monotonic() > deadline:
                    raise RedisConnectionError(f"pods {sorted(blocked)[:5]} stayed busy: another ingester's "
                                               "outbox entries did not run")
                if not ran:
                    await asyncio.sleep(0.05)
            todo = again
        return [r for r in results if r is not None]

    async def _pod_steps(self, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> list[Any]:
        """The pod steps, pipelined per primary on its lean connection, primaries in parallel; a step the
        primary refused as not its slot's (MOVED/ASK/TRYAGAIN during resharding or a failover), and every step
        of a primary that did not answer, goes again through redis-py's routing, in order. Running one again is
        safe: the seq check answers "dup" for a batch already applied, and a pod's later batches fail on the
        same slot as its earlier ones, so order within a pod holds."""
        await self.shards.ready()
        by_node, routed = by_primary(self.client, (k[0] for k in keys))  # a pod's keys share its slot
        out: list[Any] = [None] * len(keys)
        script = self._pod_step

        async def on_node(node, idx: list[int]) -> None:
            fast = self.shards.fast_for(node)
            if fast is None:
                routed.extend(idx)
                return
            commands = [("EVALSHA", script.sha, len(keys[i]), *keys[i], *args[i]) for i in idx]
            try:
                async with asyncio.timeout(fast.timeout_s):
                    replies = await fast.pipeline(commands)
                    if any(isinstance(r, ResponseError) and str(r).startswith("NOSCRIPT") for r in replies):
                        await fast.execute("SCRIPT", "LOAD", script.script)  # none ran: all again
                        replies = await fast.pipeline(commands)
            except (*VALKEY_ERRORS, TimeoutError):
                await self.shards.reread_map()
                routed.extend(idx)  # the seq check makes a step that did run answer "dup" when sent again
                return
            for i, r in zip(idx, replies):
                if isinstance(r, ResponseError) and str(r).split(" ", 1)[0] in REDIRECTS:
                    routed.append(i)
                elif isinstance(r, Exception):
                    raise r
                else:
                    out[i] = r

        await asyncio.gather(*(on_node(n, idx) for n, idx in by_node.values()))
        if routed:
            routed.sort()
            for i, r in zip(routed, await evalsha_pipeline(self.client, script, [keys[i] for i in routed],
                                                            [args[i] for i in routed])):
                out[i] = r
        return out

    # ---- step 2: the changes, in rounds

    async def run(self, entries: Sequence[OutboxEntry], *,
                  until: float | Renewable | None = None) -> tuple[int, str, "Touched"]:
        """Run outbox entries' changes (as ``decode_entry`` gives them, or as planned), in order, in rounds
        A-D (module docstring). Returns how many writes hit a key of a foreign type (skipped: each stands
        alone), the first such error, and the keys touched, for the barrier (per name prefix, the values:
        request keys, engine keys). ``until``: the monotonic time after which no round is sent (``Late`` is
        raised; what ran is idempotent, and the whole entry runs again at a drain)."""
        if not entries:
            return 0, "", Touched([], None)
        await in_time(until, "A")
        await self.shards.ready()
        mark = self.shards.map_mark()  # the slot map the run writes by (``_written_to``)
        digest = self.shards.map_digest()
        changes = entries[0].changes if len(entries) == 1 else list(chain.from_iterable(e.changes for e in entries))
        # Round A runs each shard's share in order, and an engine key's drop is judged where it stands among
        # them (a probe of each of its request keys: empty at that point?), as a single node judges it: a run
        # of several batches (a drain, a pipelined run) ends the same as the batches one by one.
        key_ops, whose, rk_changes = _native("run_keys", entries) or _run_keys(entries)  # rk_changes: the barrier's
        foreign, first, empty_at = await self._round_a(key_ops, whose, until)
        # Round B in the run's order: an engine key that is dropped and stored again (or the reverse) within
        # one run ends as its last change says, as on a single node.
        round_b, round_b_eks, drops = _native("engine_round", changes, empty_at, ENGINE_PREFIX) or \
            _engine_round(changes, empty_at)
        await in_time(until, "B")
        f, fst = _foreign(await self.shards.commands(round_b, numbered=(ENGINE_PREFIX, round_b_eks), resend=False)) \
            if round_b else (0, "")
        foreign, first = foreign + f, first or fst
        if drops:
            # Rounds C and D: a request key of a dropped block that holds an entry again may have had its
            # engine key's ZADD run before our ZREM (another writer stored the block meanwhile): it gets its
            # request keys back. An entry this run itself wrote after the drop explains itself (a later
            # store, of this block or another engine key's with the same request keys, e.g. a salted twin)
            # and is no such race.
            rks = list(set(chain.from_iterable(d.rks for _, d in drops)))  # in any order: each is one HLEN
            await in_time(until, "C")
            lens = await self.shards.commands(list(zip(repeat("HLEN"), rks)), numbered=("", rks), resend=True)
            back = {rk for rk, n in zip(rks, lens) if isinstance(n, int) and n > 0}
            readd = []
            readd_eks = []
            if back:  # another writer stored the block meanwhile, or this run did (often, under shared prompts)
                found = _native("raced", changes, drops, back)
                for j, d in found if found is not None else _raced(changes, drops, back):
                    readd.append(_engine_add(d.ek, d.rks))
                    readd_eks.append(d.ek)
            if readd:
                await in_time(until, "D")
                self.readded += len(readd)
                f, fst = _foreign(await self.shards.commands(readd, numbered=(ENGINE_PREFIX, readd_eks), resend=False))
                foreign, first = foreign + f, first or fst
        return foreign, first, Touched([("", rk_changes), (ENGINE_PREFIX, round_b_eks)], mark, digest)

    async def _round_a(self, key_ops: Sequence[Any], whose: Sequence[OutboxEntry],
                       until: float | Renewable | None = None) -> tuple[int, str, dict[int, int]]:
        return await run_round_a(self.client, self.shards, self._effects, key_ops, whose, until)

    # ---- step 3, and entries left behind

    async def _written_to(self, touched: "Touched") -> list[Any] | None:
        """The primaries a run wrote to, for its ack; None when that is not known now: a touched key's slot
        has no primary, or the slot map moved since the run began: the primaries asked now may not be those
        written to (a run stalled across a failover wrote to the old master; its promoted replica, asked now,
        has no replica of its own to wait for and would confirm writes it never had). Then the entries are
        kept, to run again later, as when a replica does not confirm in time."""
        if touched.mark is not None and self.shards.map_moved(touched.mark):
            return None
        if touched.mark is not None and self.shards.routed_since(touched.mark):
            # some commands went through redis-py's routing (TLS), which may have followed a redirect to a
            # primary the touched keys' slots do not name in the map: every primary confirms
            return self.client.get_primaries()
        return await self.shards.primaries_of(touched.keys)

    async def _confirm_and_delete(self, entries: Sequence[tuple[str, str, bytes]], nodes: Sequence[Any]) -> bool:
        if not await self.barrier.confirm(nodes):
            return False
        await self._delete(entries)
        return True

    async def _delete(self, entries: Sequence[tuple[str, str, bytes]]) -> None:
        # on the primaries' lean connections (redis-py's cluster pipeline spent ~0.5 us of an engine block here)
        for r in await self.shards.commands([("HDEL", pod_outbox_key(pod), field) for pod, field, _ in entries]):
            if isinstance(r, Exception):
                raise r
        self._unkeep(entries)

    def _unkeep(self, entries: Sequence[tuple[str, str, bytes]]) -> None:
        for pod, field, _ in entries:
            self._kept.get(pod, {}).pop(field, None)

    async def _keep(self, entries: Sequence[tuple[str, str, bytes]], nodes: Sequence[Any] | None,
                    touched: "Touched") -> None:
        """Entries that ran whole and stay (``_engine_keys_done``), remembered with the primaries they went to
        (``Kept``), unless those are not known now: ``nodes`` None, or a primary silent or no master now. Those
        run again at the next drain. (A primary that restarted between the run and this look is not looked for:
        back without its data, its slot markers say so and every pod is rebuilt; back with what it acknowledged,
        nothing was lost. docs/durability.md)"""
        await self._engine_keys_done(entries)
        await self._remember(entries, nodes, touched)

    async def _remember(self, entries: Sequence[tuple[str, str, bytes]], nodes: Sequence[Any] | None,
                        touched: "Touched") -> None:
        if not entries:
            return
        found = await self.barrier.incarnations(nodes) if nodes is not None else None
        if found is None or any(v is None for v in found.values()):
            self._unkeep(entries)
            return
        kept = Kept(touched.digest, tuple((name, v) for name, v in found.items() if v is not None))
        for pod, field, _ in entries:
            self._kept.setdefault(pod, {})[field] = kept

    async def _confirm_kept(self, pod: str) -> bool:
        """While a replica is down, our entries stay by the thousand; running them all again every second
        (the chores) would cost Valkey and this process as much as the outbox holds, each second, for as long
        as the outage lasts. Entries that ran whole under the slot map in force now are on their primaries
        already: only the barrier is asked again, and they are deleted once it confirms. True when the pod's
        outbox held only such entries (confirmed or not); False when something must run: another writer's
        entry, one of ours not known to have run whole, a slot map that moved since (a failover: the promoted
        replica may lack their changes), or a primary that restarted, was promoted or demoted since, or does
        not answer (it may have failed over with no command of ours to find out, a quiet engine's: the slot
        map is read again too)."""
        kept = self._kept.get(pod)
        if not kept:
            return False
        fields = [text(f) for f in await self.client.hkeys(pod_outbox_key(pod))]
        present = set(fields)
        for f in [f for f in kept if f not in present]:  # confirmed, or run and deleted by another writer
            del kept[f]
        if not fields:
            self._kept.pop(pod, None)
            return True
        records = [kept.get(f) for f in fields]
        if any(r is None for r in records):
            return False
        distinct = list({id(r): r for r in records}.values())  # a run's entries share one
        digest = self.shards.map_digest()
        if any(r.digest != digest for r in distinct):
            return False
        primaries = {n.name: n for n in self.client.get_primaries()}
        wanted = [(name, inc) for r in distinct for name, inc in r.nodes]  # runs of one node's incarnations
        if not {name for name, _ in wanted} <= primaries.keys():
            return False
        nodes = list({name: primaries[name] for name, _ in wanted}.values())

        found = await self.barrier.incarnations(nodes)
        if not all(found[name] is not None and found[name] == inc for name, inc in wanted):
            # restarted, promoted or demoted since, or silent (failed over?): what the runs wrote may not be
            # there; they run again, and the slot map is read again in case it moved
            self._kept.pop(pod, None)
            await self.shards.reread_map()
            return False
        if not await self.barrier.confirm(nodes):
            return True
        await self._delete([(pod, f, b"") for f in fields])
        self.confirmed_late += len(fields)
        log.info("%s: %d outbox entries confirmed by a replica late, deleted (their changes had run)", pod,
                 len(fields))
        return True

    def left_to_drain(self, pod: str) -> bool:
        """A batch of this writer's left its changes to a drain (``Late``) that has not run them yet."""
        return pod in self._left

    def forget(self, pods: Iterable[str]) -> None:
        """Pods let go: what ran of their entries is another writer's to find out now (it runs them)."""
        for pod in pods:
            self._kept.pop(pod, None)
            self._left.discard(pod)

    async def drain(self, pod: str, *, older_than_ms: int = 0, others_older_than_ms: int | None = None) -> int:
        """Run the entries left in a pod's outbox, oldest first, all of them or none: every entry of this writer
        (which is not running any other batch meanwhile), and other writers' entries (a crashed or stalled
        writer's) once every one of them is at least ``older_than_ms`` old (Valkey's clock). Another writer's
        young entry says that writer is alive: its batch is on its way, and its older entries, kept for a replica,
        have run already and ran before its newer ones; run again now, after those, they would undo the newer
        ones' removals. So nothing runs (that writer runs its own; the pod's steps answer "busy" meanwhile).
        ``others_older_than_ms``: the age for other writers' entries alone, this writer's own all run again (not
        only asked the barrier, as with ``older_than_ms``): a drain before a clearing or after a pod step's
        "pending", which must not run and delete a live writer's young entry (run here and deleted, the clearing
        went at once and that writer's changes landed after it, entries the cleared pod's state no longer lists).
        Only one drain of a pod runs at a time, the one that holds its lease (cluster/drain_lease.py): another
        returns 0, and the pod's steps answer "busy" until it is done. Returns the entries run."""
        others = older_than_ms if others_older_than_ms is None else others_older_than_ms
        if older_than_ms and await self._confirm_kept(pod):
            return 0
        lease = DrainLease(self._drain_lease, pod, self.writer_arg(), self.takeover_ms)
        async with lease as took:
            if took == EMPTY:
                self.forget((pod,))  # nothing of ours there: none kept, none left
                return 0
            if took == BUSY:
                return 0  # another drain runs them (its writer's, or this process's other client)
            try:
                return await self._drain_held(pod, others, lease)
            except Late as exc:  # its lease lapsed while it ran: what ran is idempotent, the entries stay
                self.late_runs += 1
                log.warning("pod %s: a drain stopped: %s", pod, exc)
                return 0

    async def _drain_held(self, pod: str, others: int, until: Renewable) -> int:
        raw = await self.client.hgetall(pod_outbox_key(pod))
        if not raw:  # (emptied since the lease was taken: by a confirmation, or a drain whose lease had lapsed)
            self.forget((pod,))
            return 0
        entries = []
        for f, v in raw.items():
            parsed = decode_entry(f, v)
            if parsed is None:  # its changes never run, though the pod step that wrote it moved the pod's state
                self.malformed += 1  # past them: the pod's entries may lack them, and its answers say so
                log.error("pod %s: outbox entry %r is malformed (%d bytes); deleted without running it, the pod "
                          "flagged incomplete", pod, f[:80], len(v))
                await self.client.hset(pod_meta_key(pod), mapping={"incomplete": 1, "incomplete_reason":
                                       "an outbox entry of no shape this build reads was deleted unrun"})
                await self.client.hdel(pod_outbox_key(pod), f)
                continue
            entries.append((parsed[0], f.decode(), v, parsed[1]))
        entries.sort(key=lambda e: (e[0], e[1]))
        mine = self.writer_arg()
        theirs = [int(ms) for w, ms in (e[1].split("|", 2)[1:] for e in entries) if w != mine]  # written at (ms)
        if others and theirs:
            sec, usec = await self.client.time()
            if sec * 1000 + usec // 1000 - max(theirs) < others:
                return 0  # another writer's entry too young: that writer is alive and runs its own
        whole = len(entries) == len(raw)  # every entry there (none malformed)
        todo = [(pod, f, v) for _, f, v, _ in entries]
        foreign, first, touched = await self.run([entry for *_, entry in entries], until=until)
        if whole:
            self._left.discard(pod)  # what was left ran, in order: the pod's next entries run as they come
        if foreign:  # as a batch's own run flags them (``send``)
            await self._flag_foreign(todo, foreign, first)
        nodes = await self._written_to(touched)
        if todo and (nodes is None or not await self._confirm_and_delete(todo, nodes)):
            await self._engine_keys_done(todo)
            if whole and nodes is not None:
                todo = await self._adopt(pod, todo)
            await self._remember(todo, nodes, touched)
        return len(entries)

    async def _adopt(self, pod: str, entries: Sequence[tuple[str, str, bytes]]) -> Sequence[tuple[str, str, bytes]]:
        """Another writer's entries this one ran and no replica confirmed (a replica down when their writer
        stopped, or the fleet moved the pod): renamed to this writer (lua/adopt.lua), so its next pod steps
        see its own entries and apply, and the chores confirm them later. Left as they were (and returned so)
        when they are all ours already, or when the outbox changed meanwhile."""
        mine = self.writer_arg()
        renamed = []
        for p, f, v in entries:
            n, writer, ms = f.split("|", 2)
            renamed.append((p, f if writer == mine else f"{n}|{mine}|{ms}", v))
        if all(a[1] == b[1] for a, b in zip(entries, renamed)):
            return entries
        args = [x for a, b in zip(entries, renamed) for x in (a[1], b[1])]
        if not await self.client.eval(scripts.ADOPT, 1, pod_outbox_key(pod), *args):
            return []
        log.warning("%s: took over %d outbox entries of another writer, run but not confirmed by a replica yet",
                    pod, len(entries))
        return renamed

    async def _engine_keys_done(self, entries: Sequence[tuple[str, str, bytes]]) -> None:
        """Entries that ran whole but stay in the outbox (not yet on a replica, or behind an earlier one of
        their pod) run again later, after other pods' batches. Their request keys' changes are the same then
        (each pod's own entry and bit, in the pod's order), but an engine key's drop would be judged anew
        (are its request keys empty at that later point?), and an add could undo a drop of the same entries'
        that was already judged. So what stays keeps only the request keys' changes (compare-and-set, so an
        entry someone else has meanwhile run and deleted stays gone). A failover that then loses an engine
        key's change leaves ``engine:<ek>`` a member too many or too few: llm-d's own event handling reads it,
        its lookups do not, and the block's next change writes it again."""
        for pod, field, payload in entries:
            entry = read_payload(payload)  # one written or read (and checked) by this run: never None
            kept = [c for c in entry.changes if type(c) is KeyChange] if entry is not None else []
            if entry is None or len(kept) == len(entry.changes):
                continue
            await self.client.eval(scripts.CAS_FIELD, 1, pod_outbox_key(pod), field, payload,
                                   outbox_payload(entry._replace(changes=kept)))

    async def _flag_foreign(self, entries: Sequence[tuple[str, str, bytes]], n: int, first: str) -> None:
        """Changes that hit a key of a foreign type stand alone (skipped); their pods are flagged."""
        pipe = self.client.pipeline(transaction=False)
        for pod in {e[0] for e in entries}:
            pipe.hset(pod_meta_key(pod), mapping={"incomplete": 1, "incomplete_reason":
                                                  f"{n} write(s) hit a key of a foreign type ({first})"})
            pipe.hincrby(pod_meta_key(pod), "foreign_keys", n)
        await pipe.execute()

    async def close(self) -> None:
        await self.barrier.close()


__all__ = ["ClusterWrites", "Kept", "TAKEOVER_MS", "Touched"]
