"""Pod numbers: each pod's bit in the presence bitmaps (kv_preflight/index/presence.py), given fleet-wide
(kv_preflight/index/lua/nums.lua), kept in the pod's meta, and freed when the pod is forgotten (reused only
NUM_REUSE_MS later); and the other way round, pod number -> pod, which a lookup reads to name the bits it
found (``Numbering``: one per Index, read at most every NAMES_TTL_S)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kv_preflight.index import scripts
from kv_preflight.index.backend import VALKEY_ERRORS, read_pipeline
from kv_preflight.index.entries import text
from kv_preflight.index.layout import NUM_REUSE_MS, NUMS_BYID_KEY, NUMS_KEYS, NUMS_NEXT_KEY, pod_meta_key

log = logging.getLogger("kvpf.index")

NAMES_TTL_S = 5.0  # how long a lookup trusts its pod number -> pod map (numbers are reused only after NUM_REUSE_MS)
# An unknown number below the numbering's next (a reused one, or a bit nobody holds: a pod lost with its shard's
# data and numbered anew) reads the names again at most this often; one at or past it (a pod numbered since the
# names were read) at once
UNNAMED_RECHECK_S = 1.0


async def give_numbers(client, pod_ids: Sequence[str], copies: Sequence[str] = ()) -> dict[str, int]:
    """Each pod's number (its bit in the presence bitmaps), given fleet-wide if it has none
    (kv_preflight/index/lua/nums.lua), and kept in its meta, where the apply script reads it (the pod's slot on a
    cluster). Idempotent. ``client``: redis-py, single node or cluster.

    ``copies`` (a cluster's, ``IndexBackend.numbering_copies``): keys on the other shards that keep the
    numbering's high-water mark. The shard holding the numbering may come back without its data while the
    others keep the bits of the numbers it gave: a pod whose meta survived gets its own number back (its bits
    are under it; the rebuild's clearing uses it), and no new number is given below the copies' mark (a pod
    whose meta was lost too has bits under a number nobody is given again)."""
    def fill(pipe) -> None:
        for pod in pod_ids:
            pipe.hget(pod_meta_key(pod), "num")

    held = await read_pipeline(client, fill)
    for r in held:
        if isinstance(r, Exception):  # its own number unknown, a new one could be given: not now
            raise r
    # each copy on its own: a shard down (its copy unread) must not stop a pod being numbered; any copy carries
    # the mark, and all are raised together. None read: the floor is not known, and no number is given blind.
    marks = await _on_each_copy(client, copies, lambda pipe, key: pipe.hget(key, "next"))
    unread = _only_valkey_errors(marks)
    if copies and len(unread) == len(copies):
        raise unread[0]
    floor = max([0, *map(_mark_of, marks)])
    args: list[Any] = ["give", NUM_REUSE_MS, floor]
    for pod, h in zip(pod_ids, held):
        args += [pod, text(h) if h is not None else ""]
    script = client.register_script(scripts.NUMS)
    *nums, next_num = [int(n) for n in await script(keys=list(NUMS_KEYS), args=args)]
    async with client.pipeline(transaction=False) as pipe:
        for pod, n in zip(pod_ids, nums):
            pipe.hset(pod_meta_key(pod), "num", n)
        await pipe.execute()
    # raised where read and behind (a copy whose shard just failed is not tried again now: each failed
    # pipeline costs redis-py's retries, which reset the client's connections)
    behind = [k for k, m in zip(copies, marks) if not isinstance(m, BaseException) and _mark_of(m) < next_num]
    failed: list[BaseException] = []
    if behind:
        done = await _on_each_copy(client, behind, lambda pipe, key: pipe.execute_command(
            "EVAL", scripts.MAX_FIELD, 1, key, "next", next_num))  # (rare: EVAL, no script to load first)
        failed = _only_valkey_errors(done)
        if len(failed) == len(behind) and max(map(_mark_of, marks)) < next_num:
            raise failed[0]  # no copy has the mark: the caller tries again (the pods' numbers are theirs by now)
    lagging = unread + failed
    if lagging:  # a shard down: its copies lag; the others carry the mark, and a later give raises them
        log.warning("the pod numbering's high-water mark was not copied to %d of %d keys now (%s: %s)",
                    len(lagging), len(copies), type(lagging[0]).__name__, lagging[0])
    return dict(zip(pod_ids, nums))


async def _on_each_copy(client, copies: Sequence[str], command) -> list[Any]:
    """``command(pipeline, key)`` for each copy, one pipeline per primary (a cluster's; one for a single node), the
    primaries in parallel; replies in order, a shard's failure in place of its copies' replies (a shard down
    fails its own copies only)."""
    node_of = getattr(client, "get_node_from_key", None)
    groups: dict[str, list[int]] = {}
    for i, key in enumerate(copies):
        try:
            name = node_of(key).name if node_of is not None else ""
        except VALKEY_ERRORS:  # no primary serves its slot now: its pipeline fails alone
            name = f"?{i}"
        groups.setdefault(name, []).append(i)
    out: list[Any] = [None] * len(copies)

    async def run(idx: list[int]) -> None:
        try:
            async with client.pipeline(transaction=False) as pipe:
                for i in idx:
                    command(pipe, copies[i])
                replies = await pipe.execute(raise_on_error=False)
        except VALKEY_ERRORS as exc:
            replies = [exc] * len(idx)
        for i, r in zip(idx, replies):
            out[i] = r

    await asyncio.gather(*(run(idx) for idx in groups.values()))
    return out


def _mark_of(reply: Any) -> int:
    """A copy's mark from its HGET reply; -1 for none (absent, unread, not a number of ours)."""
    return int(reply) if isinstance(reply, bytes | str) and _is_number(text(reply)) else -1


def _is_number(s: str) -> bool:
    """A pod number as nums.lua writes one (ASCII digits, at most 9: "²" is a digit to str.isdigit)."""
    return s.isascii() and s.isdigit() and len(s) <= 9


def _only_valkey_errors(results: Sequence[Any]) -> list[BaseException]:
    """The Valkey errors among gathered results; any other exception is raised (a bug is not a shard down)."""
    failed = [r for r in results if isinstance(r, BaseException)]
    for exc in failed:
        if not isinstance(exc, VALKEY_ERRORS):
            raise exc
    return failed


class Numbering:
    """The fleet-wide numbering as one process reads it: pod number -> pod for its lookups, pods' numbers
    for the predictor's group reads, and a forgotten pod's number freed."""

    def __init__(self, client):
        self.client = client
        self._names: dict[int, str] = {}  # pod number -> pod, for the lookup (read at most NAMES_TTL_S ago)
        self._names_at = -1e9
        self._names_lock = asyncio.Lock()
        self._names_epoch = ""  # the numbering's epoch those names were read under (kv_preflight/index/lua/nums.lua)
        self._names_next = 0  # the numbering's next new number when those names were read
        self._names_mask = 0  # bit n set: number n is in self._names
        self._by_name: tuple[dict[int, str] | None, dict[str, int]] = (None, {})  # (names it was made from, pod -> num)
        self._nums_script = client.register_script(scripts.NUMS)

    @property
    def names(self) -> dict[int, str]:
        """The names last read, without reading ({} before the first read)."""
        return self._names

    def forget_names(self) -> None:
        """Read the names again at the next lookup (after the index lost its data)."""
        self._names, self._names_at = {}, -1e9

    async def pod_names(self, *, refresh: bool = False) -> dict[int, str]:
        """Pod number -> pod, read again when older than NAMES_TTL_S (a freed number is reused only
        NUM_REUSE_MS later, long after every reader has dropped its old name)."""
        if refresh or time.monotonic() - self._names_at > NAMES_TTL_S:
            asked = time.monotonic()
            async with self._names_lock:  # one read for every lookup waiting (one connection, not one each)
                if self._names_at < asked:
                    async with self.client.pipeline(transaction=False) as pipe:  # one slot: {nums}
                        # next first: a number given between the two reads is then at or past it (named at once)
                        pipe.hmget(NUMS_NEXT_KEY, ["epoch", "next"])
                        pipe.hgetall(NUMS_BYID_KEY)
                        (epoch, next_num), raw = await pipe.execute()
                    self._names = {int(k): text(v) for k, v in raw.items() if text(k).isdigit()}
                    self._names_mask = sum(1 << n for n in self._names)  # which numbers are named, as bits
                    self._names_epoch = text(epoch) if epoch else ""
                    self._names_next = int(next_num) if next_num is not None and _is_number(text(next_num)) else 0
                    self._names_at = time.monotonic()
        return self._names

    async def names_for(self, nums: Iterable[int] | int, epoch: str = "") -> dict[int, str]:
        """The names, read again when the epoch changed or a number is unknown: at once for one at or past the
        numbering's next when the names were read (a pod numbered since), at most every UNNAMED_RECHECK_S for one
        below it (reused, or a bit nobody holds, which a lookup may meet on every key); ``nums`` may be a bitmap
        (an int: a thousand pods at a key are one AND, not a thousand dict probes)."""
        names = self._names
        if isinstance(nums, int):
            unnamed = nums & ~self._names_mask
            unknown, new = bool(unnamed), bool(unnamed >> self._names_next)
        else:
            unnamed_nums = [n for n in nums if n not in names]
            unknown, new = bool(unnamed_nums), any(n >= self._names_next for n in unnamed_nums)
        if unknown and not new and time.monotonic() - self._names_at < UNNAMED_RECHECK_S:
            unknown = False  # bits nobody holds, met again within the second: not read for each lookup
        if (epoch and epoch != self._names_epoch) or unknown:
            try:
                names = await self.pod_names(refresh=True)  # a pod numbered since the names were read
            except VALKEY_ERRORS:
                pass  # its bits are ignored until the names can be read
        return names

    async def pod_numbers(self, pods: Iterable[str]) -> dict[str, int]:
        """Pods' numbers (their bit in every bitmap), from the names the lookup read."""
        names = await self.pod_names()
        if self._by_name[0] is not names:  # pod -> number, made once per read of the names
            self._by_name = (names, {name: num for num, name in names.items()})
        by_name = self._by_name[1]
        return {p: by_name[p] for p in pods if p in by_name}

    async def free(self, pod_id: str) -> None:
        """Give a forgotten pod's number back (its bits must all be clear): another pod may have it after
        NUM_REUSE_MS."""
        await self._nums_script(keys=list(NUMS_KEYS), args=["free", NUM_REUSE_MS, pod_id])


__all__ = ["NAMES_TTL_S", "UNNAMED_RECHECK_S", "Numbering", "give_numbers"]
