"""Valkey Cluster: the sharded lookup, in at most three sequential rounds.

Every shard runs the lookup script over the chain's keys it owns, the shards in parallel; ``merge_shards``
ends each pod's prefix at the first key any shard lacks it on (docs/architecture.md, "Read semantics").
"""
from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from kv_preflight.index import scripts
from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.cluster.merge import Unanswered, merge_shards, pod_bisectable, sent_bitmaps
from kv_preflight.index.cluster.routing import Shards, by_primary
from kv_preflight.index.entries import Lookup, PodMatch, better_tier, parse_entry, text
from kv_preflight.index.layout import LOOKUP_NAMES, pod_meta_key, pod_outbox_key, presence_key, request_key_name
from kv_preflight.index.presence import (BitsReply, GroupBits, NamesFor, TierRuns, chain_group_bits, chain_of_one_tier,
                                         mask_of, numbers_in, parse_bits_reply, prefix_from_bits, prefix_of_one_tier,
                                         presence_value, split_fields, tier_in)
from kv_preflight.keys.chain import pack_keys

# A shard walks its keys exactly (every field read, as the linear walk) while that reads at most this many fields,
# then bisects (kv_preflight/index/lua/lookup.lua). 0: bisect from the shard's first key (layout 2's galloping
# lookup). Measured (docs/benchmarks.md): an exact walk of up to 512 fields cost the 32K-token predict p50
# 10.5 ms against 6.1 ms, for an exactness the bisection lacks only while a batch is half applied (its effects on
# some shards, not yet on others), where either answer lies between the index before and after that batch.
# ``mode="linear"`` walks exactly.
EXACT_BUDGET = 0


class ClusterLookup:
    """The lookups of a Valkey Cluster (``lookup``: over llm-d's entries; ``lookup_bits``: the default)."""

    def __init__(self, client: RedisCluster, shards: Shards):
        self.client = client
        self.shards = shards
        self._lookup = client.register_script(scripts.LOOKUP)
        self._lookup_bits = client.register_script(scripts.LOOKUP_BITS)
        # first request key of a chain -> the pods a shard bisected on it last time: their meta is read beside
        # the shards' round when the chain comes again (a prompt's prefix is looked up many times), so the
        # check that they may be bisected costs no round of its own (bounded, oldest dropped first)
        self._bisected_at: dict[int, frozenset[str]] = {}
        self.gap_walks = 0  # pods a lookup walked key by key rather than bisected (orphan keys, a pending gap)
        # default lookups that read after the walk (a 4th round): a tier the merge wanted and no round had read
        # (a shard failed the walk, which moves the cut), or the keys of a shard whose walk found a key moved
        # (resharding); tests check it stays 0 otherwise
        self.late_reads = 0

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
            reply = await self.shards.script_on(node, self._lookup, args)
            held = {text(reply[p]): (int(reply[p + 1]), text(reply[p + 2])) for p in range(2, len(reply), 3)}
            return int(reply[0]), bool(reply[1]), held

        shards: list[tuple[list[int], dict[str, tuple[int, str]]]] = []
        reread: list[int] = []
        foreign = 0
        for idx, res in await self._each_shard(by_node, shard, unanswered):
            if res[1]:
                reread.extend(idx)  # a key moved since the map was read: all its keys, through the routing
                self.shards.forget_table()
                foreign += res[0]
            else:
                shards.append((idx, res[2]))
                foreign += res[0]
        read = await self._read_routed(request_keys, sorted(reread), pods, unanswered) if reread else {}
        return await self._merged(request_keys, shards, read, unanswered, pods), foreign


    async def lookup_bits(self, request_keys: Sequence[int], names: NamesFor) -> tuple[Lookup | None, int]:
        """The default lookup: lookup_bits.lua on every shard over the keys it owns, the shards in parallel;
        each sends its keys' bitmaps (put back in chain order and walked here once, when every shard did or
        holds nobody at its first key; a hybrid model's other groups' bitmaps then come with the answer,
        ``Lookup.group_bits``, as on a single node, so its groups' rules need no read of their own) or, where
        few pods hold its first key, per pod how many of its keys the pod holds from its first (bisected
        there), and ``merge_shards`` ends each pod's prefix at the first key any shard lacks it on.

        A bisected pod's count is exact only when its keys are closed under "parent" (pod meta "orphan_keys"
        is 0, kv_preflight/index/pod_state.py) at every version a shard may show (no outbox entry left from a step taken
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

        The pod names (``names``) are a cache: a number given since the last read reads ``kvpf:{nums}:byid``
        again at once, an unknown one below it at most once a second (``Numbering.names_for``). A shard that does not answer cuts every prefix at its first key (counts are then lower
        bounds, never silently short). Two events during a resharding or a failover cost a 4th round,
        counted in ``late_reads``: a shard failing the walk (the cut moves, and the merge may want a tier no
        round read) and a walk finding a key moved that round 1 did not read (its shard's keys are then
        read through the routing). None when a shard's first key holds entries that are not ours (walk
        llm-d's entries then)."""
        by_node, unanswered = await self._keys_by_node(request_keys)
        guess = self._bisected_at.get(request_keys[0])
        early = asyncio.ensure_future(self.pods_with_gaps(guess)) if guess else None

        async def shard(node, idx: list[int], how: str = "") -> tuple[Any, BitsReply]:
            args = [len(idx), how, *LOOKUP_NAMES, *(request_keys[i] for i in idx)]
            return node, parse_bits_reply(await self.shards.script_on(node, self._lookup_bits, args))

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
                self.shards.forget_table()
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
        read_groups: dict[int, GroupBits] = {}
        read_entries: dict[int, dict[str, str]] = {}
        if reread and not bisected:  # no pod's meta to read: the reread is round 2 alone
            read_bits, read_entries, read_groups = await self._read_keys(request_keys, sorted(reread), unanswered)
            reread = []
        if all(sent_bitmaps(res) for _, res in replies) and not read_entries:
            # Every shard sent its keys' bitmaps (a prefix many pods hold), or holds nobody at its first key:
            # put them back in chain order and walk once, as a single node does, rather than walking each
            # shard's keys and merging per pod (three walks of a thousand pods). A key a shard did not send
            # lies past the first key nobody holds on that shard, where every prefix has ended, so it reads
            # as empty. Only the pods at the chain's first key can match: their names are the ones read.
            sent = [(idx, res) for idx, res in replies if res.kind == 0]
            if not read_bits and all(res.flat is not None for _, res in sent):  # one tier a key: in C
                if unanswered.none_answered(len(request_keys)):
                    raise unanswered.error()
                # (no key sent a hybrid model's other group: no group bitmaps, as on a single node)
                tiers, maps = chain_of_one_tier(len(request_keys), ((idx, res.flat) for idx, res in sent))
                cut = min(unanswered) if unanswered else None
                first = int.from_bytes(maps[0], "little") if cut != 0 else 0
                known = await names(first, epoch) if first else {}
                if early is not None:
                    _abandon(early)  # nothing was bisected: no pod's state matters
                return Lookup(prefix_of_one_tier(tiers, maps, known, cut), cut, unanswered_why=unanswered.why), foreign
            per_key: list[dict[str, bytes] | None] = [None] * len(request_keys)
            for idx, res in sent:
                for i, bits in zip(idx, res.reads):
                    per_key[i] = bits
            for i, bits in read_bits.items():
                per_key[i] = bits
            if unanswered.none_answered(len(request_keys)):
                raise unanswered.error()
            cut = min(unanswered) if unanswered else None
            first = mask_of(per_key[0]) if per_key[0] and cut != 0 else 0
            known = await names(first, epoch) if first else {}
            if early is not None:
                _abandon(early)  # nothing was bisected: no pod's state matters
            matches = prefix_from_bits(per_key, known, cut=cut)
            # A hybrid model's other groups' bitmaps came with the keys (each shard's own, as the single node's
            # reply has them): handed over for the groups' rules, as far as the longest prefix reaches
            groups = [(idx, res.groups) for idx, res in sent if res.groups is not None]
            if read_groups:
                groups.append((sorted(read_groups), [read_groups[i] for i in sorted(read_groups)]))
            group_bits = chain_group_bits(groups, max((m.blocks for m in matches), default=0)) if groups else None
            return Lookup(matches, cut, group_bits, unanswered.why), foreign
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
                read_bits, read_entries, _ = await rereading
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
            self.shards.forget_table()
            bits_at, entries_at, _ = await self._read_keys(request_keys, moved, unanswered)
            read.update(await as_read(bits_at, entries_at))
        return await self._merged(request_keys, shards, read, unanswered, None, known_tiers, late=True), foreign


    async def _walk(self, shard, bisected: Sequence[tuple[Any, list[int], BitsReply]], gapped: set[str],
                    known: Mapping[int, str], shards: list[tuple[list[int], dict[str, tuple[int, str | TierRuns]]]],
                    with_bits: list[tuple[list[int], list[dict[str, bytes]]]], unanswered: Unanswered) -> list[int]:
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
                unanswered.note(idx, r)  # not answered now: cut there (a lower bound, said so)
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
        which then shows that version). One pipelined read per shard holding their meta, in parallel (the
        meta and the outbox's length), and the outbox's fields only of a pod with a "gap_entry" and entries
        left, in a second: while a replica is down a pod's outbox keeps thousands of entries, and reading
        them all for every pod made each lookup read them all. A pod whose shard does not answer (or moved
        meanwhile) is one too: never a guess."""
        pods = list(pods)
        groups, unserved = by_primary(self.client, (pod_meta_key(p) for p in pods))
        out: set[str] = {pods[i] for i in unserved}
        by_node = {name: (node, [pods[i] for i in idx]) for name, (node, idx) in groups.items()}

        async def on(node, commands: list[tuple[str, ...]]) -> list[Any]:
            fast = self.shards.fast_for(node)
            if fast is not None:
                async with asyncio.timeout(fast.timeout_s):
                    return await fast.pipeline(commands)
            return [await self.client.execute_command(*c, target_nodes=node) for c in commands]

        async def one(node, part: list[str]) -> list[str]:
            """The pod's gaps among ``part``; raises when the shard did not answer."""
            res = await on(node, [c for p in part for c in (("HMGET", pod_meta_key(p), "orphan_keys", "gap_entry",
                                                                  "orphan_at", "batches"),
                                                                 ("HLEN", pod_outbox_key(p)))])
            gapped, unsure = [], []
            for j, pod in enumerate(part):
                meta, n = res[2 * j], res[2 * j + 1]
                if isinstance(meta, Exception) or isinstance(n, Exception) or not pod_bisectable(meta, ()):
                    gapped.append(pod)
                elif meta[1] is not None and int(n) > 0:  # a gap_entry, and entries left: are they later?
                    unsure.append((pod, meta))
            if unsure:
                fields = await on(node, [("HKEYS", pod_outbox_key(pod)) for pod, _ in unsure])
                gapped += [pod for (pod, meta), f in zip(unsure, fields)
                           if isinstance(f, Exception) or not pod_bisectable(meta, f)]
            return gapped

        results = await asyncio.gather(*(one(n, part) for n, part in by_node.values()), return_exceptions=True)
        for (_, part), res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, (*VALKEY_ERRORS, TimeoutError)):
                    raise res
                out.update(part)
                continue
            out.update(res)
        return out


    async def _read_keys(self, request_keys: Sequence[int], positions: list[int], unanswered: Unanswered
                         ) -> tuple[dict[int, dict[str, bytes]], dict[int, dict[str, str]], dict[int, GroupBits]]:
        """Keys read one by one through the cluster's routing (MOVED/ASK followed): position -> its
        bitmaps where its fields are exactly ours, else position -> pod -> tier from its entries (a key
        of a foreign type: a miss); and position -> its other groups' bitmaps where it has some (a hybrid
        model's, as a shard's reply has them). Keys not answered go to ``unanswered``."""
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for i in positions:
                    pipe.hgetall(presence_key(request_keys[i]))
                    pipe.hkeys(request_key_name(request_keys[i]))
                replies = await pipe.execute(raise_on_error=False)
        except VALKEY_ERRORS as exc:
            replies = [exc] * (2 * len(positions))
        bits_at: dict[int, dict[str, bytes]] = {}
        entries_at: dict[int, dict[str, str]] = {}
        groups_at: dict[int, GroupBits] = {}
        for j, i in enumerate(positions):
            bits, entries = replies[2 * j:2 * j + 2]
            wrong = [r for r in (bits, entries) if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE")]
            failed = [r for r in (bits, entries) if isinstance(r, Exception) and r not in wrong]
            if failed:
                unanswered.note((i,), failed[0])
            elif wrong:  # a key of a foreign type: a miss
                entries_at[i] = {}
            elif len(entries) == sum(presence_value(v)[0] for v in bits.values()):
                bits_at[i], other = split_fields([x for f, v in bits.items() for x in (f, presence_value(v)[1])])
                if other:
                    groups_at[i] = other
            else:  # not exactly ours: the entries decide
                at = entries_at[i] = {}
                for f in entries:
                    e = parse_entry(f)
                    if e is not None and not e.Speculative and better_tier(e.DeviceTier, at.get(e.PodIdentifier)):
                        at[e.PodIdentifier] = e.DeviceTier
        return bits_at, entries_at, groups_at


    async def _merged(self, request_keys: Sequence[int],
                      shards: Sequence[tuple[list[int], Mapping[str, tuple[int, str | TierRuns]]]],
                      read: dict[int, dict[str, str]], unanswered: Unanswered, pods: Sequence[str] | None,
                      known: Callable[[Iterable[tuple[str, int]]], Mapping[tuple[str, int], str | None]] | None = None,
                      late: bool = False) -> Lookup:
        """The shards' answers merged (``merge_shards``), cut at the first key no shard answered for; on a
        layout that is not a prefix per pod, the tier at such a pod's last key: from ``known`` (pod, position)
        -> tier (None: keep the shard's) where it has them, else read (``late``: that read is a 4th round,
        counted in ``late_reads``)."""
        if unanswered.none_answered(len(request_keys)):
            raise unanswered.error()
        cut = min(unanswered) if unanswered else len(request_keys)
        matches, tiers_wanted = merge_shards(len(request_keys), shards, read, cut)
        if tiers_wanted:
            tiers = dict(known(tiers_wanted)) if known is not None else {}
            rest = {pair for pair in tiers_wanted if pair not in tiers}
            if rest:
                if late:
                    self.late_reads += 1
                at = await self._read_routed(request_keys, sorted({i for _, i in rest}), pods, Unanswered())
                tiers.update(((pod, i), at.get(i, {}).get(pod)) for pod, i in rest)
            matches = [m if not tiers.get((m.pod_id, m.blocks - 1))
                       else PodMatch(m.pod_id, m.blocks, tiers[(m.pod_id, m.blocks - 1)]) for m in matches]
        return Lookup(matches, min(unanswered) if unanswered else None, unanswered_why=unanswered.why)


    @staticmethod
    async def _each_shard(by_node: dict[str, tuple[Any, list[int]]], shard, unanswered: Unanswered) -> list[tuple[list[int], Any]]:
        """``shard(node, positions)`` on every primary at once; the positions of a shard that did not
        answer go to ``unanswered`` (any other error is raised)."""
        results = await asyncio.gather(*(shard(n, idx) for n, idx in by_node.values()), return_exceptions=True)
        out = []
        for (_, idx), res in zip(by_node.values(), results):
            if isinstance(res, BaseException):
                if not isinstance(res, VALKEY_ERRORS):
                    raise res
                unanswered.note(idx, res)
            else:
                out.append((idx, res))
        return out


    async def _keys_by_node(self, request_keys: Sequence[int]) -> tuple[dict[str, tuple[Any, list[int]]], Unanswered]:
        """The chain's positions per primary, from the slot map (positions whose slot no node serves now
        are returned apart: unanswered). Slots are computed in C through a slot -> primary table built
        once per slot map (kv_preflight/index/slots.py)."""
        by_node, unserved = await self.shards.request_keys_by_primary(request_keys)
        unanswered = Unanswered()
        if unserved:
            unanswered.note(unserved, "no node serves their slots")
        return by_node, unanswered


    async def _read_routed(self, request_keys: Sequence[int], positions: list[int], pods: Sequence[str] | None,
                           unanswered: Unanswered) -> dict[int, dict[str, str]]:
        """Keys read whole (HKEYS) through the cluster's routing (MOVED/ASK followed): position -> pod -> tier
        (gpu preferred). Keys not answered go to ``unanswered``."""
        wanted = set(pods) if pods else None
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for i in positions:
                    pipe.hkeys(request_key_name(request_keys[i]))
                replies = await pipe.execute(raise_on_error=False)
        except VALKEY_ERRORS as exc:
            replies = [exc] * len(positions)
        out: dict[int, dict[str, str]] = {}
        for i, r in zip(positions, replies):
            if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
                r = []  # a key of a foreign type is a miss
            if isinstance(r, Exception):
                unanswered.note((i,), r)
                continue
            at = out.setdefault(i, {})
            for f in r:
                e = parse_entry(f)
                if e is None or e.Speculative or (wanted is not None and e.PodIdentifier not in wanted):
                    continue
                if better_tier(e.DeviceTier, at.get(e.PodIdentifier)):
                    at[e.PodIdentifier] = e.DeviceTier
        return out



class _NotOurs(Exception):
    """A shard's first key holds entries that are not ours (lookup_bits.lua's "whole"): walk llm-d's."""


def _abandon(task: "asyncio.Future[Any]") -> None:
    """Let a read nobody needs any more finish on its own, its outcome retrieved when it does. Cancelling it
    would leave its replies' futures on the lean connection to fail unretrieved when it closes (seen as
    "connection to valkey dropped: closed by the client" in an event loop's exception handler)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


__all__ = ["ClusterLookup", "EXACT_BUDGET"]
