"""A pod cleared without its state log (``kv-preflight index clear --pod P --scan``): for a pod whose log does not
read (a hand edit, a bug, another build's format: ``PodLogError``), whose blocks, and so whose entries, no log
names. Its entries are found by scanning the keyspace instead (SCAN on every primary of a cluster), in time
proportional to the whole index, not to the pod.

The order keeps every entry of the pod flagged, whatever runs beside it:

1. **Claim**: the pod is flagged and its generation moved (lua/scan_pod.lua), so a writer that still plans from the
   state it held before the log went bad is answered "stale", loads the log, and refuses the batch as every other
   writer does; on a cluster its outbox is then run, so no change of the pod is still on its way.
2. **Request keys**: each one whose llm-d entries name the pod, or whose presence hash holds its bit, loses them
   (lua/scan_clear.lua, one key at a time in its slot): the pod's entries (every tier and KV cache group; a
   data-parallel rank's only where no sibling rank's bit is left, as its own writes do), its bit in every field.
3. **Engine keys**: every ``engine:<key>`` none of whose request keys holds an entry any more loses them (llm-d's
   own pruning rule, as a batch's removal applies it): the pod's, and any such left by anyone; another pod's
   store of the same block in between gets its request keys back (the cluster's round C and D, cluster/writes.py).
4. **Release**: the state log is deleted, if the generation is still the claim's, and the pod cleared as
   ``index clear`` clears a readable one (an empty state written, its seqs kept) and flagged until its engine's
   next reset, as ``index clear`` leaves it.

Until 4 the log still does not read, so the pod's batches are refused and it stays flagged: a run cut short
(Ctrl-C, a kill, a lost connection) leaves the pod as it was, less some of its entries, and may be run again.
After 4 the log reads, and another run is refused (``LogReads``): ``index clear`` is the way then.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_preflight.index import scripts
from kv_preflight.index.backend import evalsha_pipeline, read_pipeline
from kv_preflight.index.entries import parse_entry, text
from kv_preflight.index.layout import (ENGINE_KEY_MATCH, REQUEST_KEY_MATCH, is_request_key_name, pod_meta_key,
                                       pod_state_key, presence_key)
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.index.presence import mask_of, presence_value
from kv_preflight.index.rank_pods import base_pod, family_bits
from kv_preflight.index.transfer import held_blocks

if TYPE_CHECKING:
    from kv_preflight.index.index import Index

SCAN_COUNT = 1000  # keys asked per SCAN call, and handled per pipeline
PROGRESS_EVERY_S = 2.0  # how often a long scan reports (and at most every PROGRESS_EVERY_KEYS keys)
PROGRESS_EVERY_KEYS = 100_000
CLEARED_REASON = ("cleared by hand (index clear --scan: its state log did not read): the engine may still hold "
                  "blocks the index no longer lists; exact again at its next reset")
CLAIM_REASON = ("being cleared by a scan (index clear --scan): its state log does not read; a scan cut short "
                "leaves it so, and may be run again")


class LogReads(Exception):
    """The pod's state log reads: ``index clear`` clears it from its log; a scan is for one that does not."""

    def __init__(self, pod_id: str):
        super().__init__(f"pod {pod_id}: its state log reads: `index clear --pod {pod_id}` clears it from its log "
                         "(--scan is for a pod whose state log does not read)")
        self.pod_id = pod_id


class Moved(Exception):
    """Another writer moved the pod while it was scanned (another scan, an import): nothing released."""


@dataclass
class ScanTally:
    """How far a scan got and what it removed (``progress`` is given it as it goes)."""

    pod_id: str
    keys_total: int = 0  # keys in the index when the scan began (every kind: what SCAN walks)
    request_keys_scanned: int = 0
    keys_held: int = 0  # request keys where the pod had an entry or a bit
    fields_removed: int = 0  # the pod's llm-d entries deleted
    bits_cleared: int = 0  # presence fields the pod's bit was cleared in
    engine_keys_scanned: int = 0
    engine_members_removed: int = 0  # request keys pruned from engine:<key> (llm-d's rule)
    phase: str = "request keys"
    done: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("phase", "done")}


Progress = Callable[[ScanTally], None]


async def clear_by_scan(index: "Index", pod_id: str, *, progress: Progress | None = None,
                        count: int = SCAN_COUNT) -> ScanTally:
    """Clear a pod whose state log does not read (the module docstring: the steps and why in that order)."""
    try:
        await held_blocks(index.writer, pod_id)
    except PodLogError:
        pass
    else:
        raise LogReads(pod_id)
    tally = ScanTally(pod_id, keys_total=await index.key_count())
    report = _Reporter(tally, progress)
    client = index.client
    own_keys = [pod_meta_key(pod_id), pod_state_key(pod_id)]
    pod_script = client.register_script(scripts.SCAN_POD)
    gen = text(await pod_script(keys=own_keys, args=["claim", f"scan{os.urandom(4).hex()}", CLAIM_REASON]))
    index.writer.forget(pod_id)
    await index.drain_outbox(pod_id)  # (a cluster's changes of the pod still on their way, run now)
    num = await client.hget(pod_meta_key(pod_id), "num")
    num = int(text(num)) if num is not None and text(num).isdigit() else None
    names = await index.numbering.pod_names(refresh=True)
    siblings = family_bits(pod_id, {name: n for n, name in names.items()})
    head = [num // 8 + 1 if num is not None else 0, 1 << (num % 8) if num is not None else 0, siblings,
            "1" if not siblings and base_pod(pod_id) == pod_id else "0"]
    clear_key = client.register_script(scripts.SCAN_CLEAR)
    batch: list[bytes] = []
    async for name in client.scan_iter(match=REQUEST_KEY_MATCH, count=count, _type="hash"):
        if is_request_key_name(name):
            batch.append(name)
        if len(batch) >= count:
            await _clear_keys(client, clear_key, batch, base_pod(pod_id), num, head, tally)
            batch = []
            report.tick()
    await _clear_keys(client, clear_key, batch, base_pod(pod_id), num, head, tally)
    batch = []
    tally.phase = "engine keys"
    report.tick(force=True)
    async for name in client.scan_iter(match=ENGINE_KEY_MATCH, count=count, _type="zset"):
        batch.append(name)
        if len(batch) >= count:
            await _prune_engine_keys(client, batch, tally)
            batch = []
            report.tick()
    await _prune_engine_keys(client, batch, tally)
    if not await pod_script(keys=own_keys, args=["release", gen]):
        raise Moved(f"pod {pod_id}: another writer moved it while it was scanned; nothing released (run again)")
    # flagged first: a clearing that fails after its pod step ("try again", Index.clear_pod) leaves it flagged too
    await index.meta.mark_incomplete(pod_id, CLEARED_REASON)
    await index.clear_pod(pod_id)  # an empty state, as a clear writes it: the log reads again
    tally.done = True
    return tally


class _Reporter:
    def __init__(self, tally: ScanTally, progress: Progress | None):
        self.tally, self.progress = tally, progress
        self.at, self.keys = time.monotonic(), 0

    def tick(self, *, force: bool = False) -> None:
        keys = self.tally.request_keys_scanned + self.tally.engine_keys_scanned
        if self.progress is not None and (force or time.monotonic() - self.at >= PROGRESS_EVERY_S
                                          or keys - self.keys >= PROGRESS_EVERY_KEYS):
            self.progress(self.tally)
            self.at, self.keys = time.monotonic(), keys


async def _clear_keys(client, script, names: Sequence[bytes], base: str, num: int | None, head: list[Any],
                      tally: ScanTally) -> None:
    """Request keys read (their entries, their presence hash: one slot each), and those where the pod has an
    entry or a bit cleared of it (lua/scan_clear.lua decides again on what it finds there)."""
    if not names:
        return
    tally.request_keys_scanned += len(names)

    def fill(pipe) -> None:
        for name in names:
            pipe.hkeys(name)
            pipe.hgetall(presence_key(text(name)))

    replies = await read_pipeline(client, fill)
    keys, args = [], []
    for i, name in enumerate(names):
        fields, bits = replies[2 * i], replies[2 * i + 1]
        if isinstance(fields, Exception):  # a foreign-typed key (a LIST where a request key would be): not ours
            continue
        entries: list[Any] = []
        for f in fields:
            e = parse_entry(f)
            if e is not None and not e.Speculative and e.PodIdentifier == base:
                entries += [f, f"{e.DeviceTier}|{e.GroupIdx}", e.DeviceTier]
        if not entries and not (num is not None and isinstance(bits, dict) and _holds_bit(bits, num)):
            continue
        keys.append([text(name), presence_key(text(name))])
        args.append([*head, *entries])
    if keys:
        for deleted, cleared, _ in await evalsha_pipeline(client, script, keys, args):
            tally.fields_removed += int(deleted)
            tally.bits_cleared += int(cleared)
        tally.keys_held += len(keys)


async def _write(client, fill) -> list[Any]:
    """A pipeline of writes (each idempotent: a run cut short is run again whole), error replies in place."""
    async with client.pipeline(transaction=False) as pipe:
        fill(pipe)
        return await pipe.execute(raise_on_error=False)


def _holds_bit(bits: dict, num: int) -> bool:
    """Pod ``num``'s bit in any field of a presence hash as read (HGETALL: field -> "count:bitmap")."""
    return bool(mask_of({f: presence_value(raw)[1] for f, raw in bits.items()}) >> num & 1)


async def _prune_engine_keys(client, names: Sequence[bytes], tally: ScanTally) -> None:
    """llm-d's pruning rule on engine keys: one none of whose request keys holds an entry loses them; a request key
    that holds one again right after (another pod stored the block meanwhile) is put back, at its position."""
    if not names:
        return
    tally.engine_keys_scanned += len(names)
    members = await read_pipeline(client, lambda pipe: [pipe.zrange(n, 0, -1, withscores=True) for n in names])
    held = [(n, m) for n, m in zip(names, members) if isinstance(m, list) and m]
    rks = [rk for _, m in held for rk, _ in m]
    lens = await read_pipeline(client, lambda pipe: [pipe.hlen(rk) for rk in rks])
    empty = dict(zip(rks, (n == 0 for n in lens)))  # (an error reply, a foreign-typed key: not empty)
    gone = [(n, m) for n, m in held if all(empty[rk] for rk, _ in m)]
    if not gone:
        return
    removed = await _write(client, lambda pipe: [pipe.zrem(n, *[rk for rk, _ in m]) for n, m in gone])
    tally.engine_members_removed += sum(r for r in removed if isinstance(r, int))
    again = [(n, rk, score) for n, m in gone for rk, score in m]
    lens = await read_pipeline(client, lambda pipe: [pipe.hlen(rk) for _, rk, _ in again])
    back = [(n, rk, score) for (n, rk, score), k in zip(again, lens) if isinstance(k, int) and k > 0]
    if back:
        await _write(client, lambda pipe: [pipe.zadd(n, {rk: score}) for n, rk, score in back])
        tally.engine_members_removed -= len(back)


__all__ = ["CLEARED_REASON", "LogReads", "Moved", "ScanTally", "clear_by_scan"]
