"""The write path: batches planned against each pod's state in memory, sent guarded by the pod's generation.

Every writer of a pod (an ingester's batches, a reset, ``index clear``, an import) loads the pod's private
state (kv_preflight/index/pod_state.py) from its log in Valkey once, plans each batch against it, and sends the
plan with the generation it was made at; the apply script runs it only if the pod is still at that generation.
Another writer in between (a second ingester on the same engine, the CLI) moves the generation, the plan comes
back "stale", and the pod is loaded again and planned again, so plans never mix two writers' views. A
generation is "<n>:<writer>": the count of the pod's applied batches and who applied the last, so two writers
that each applied one batch after the same state never pass for one another.

Plans move the pod's state in memory as they are made (kv_preflight/index/pod_state.py: a copy per batch would
cost the whole state each time), so the state held is the one the batches sent lead to. A batch that does not
apply (stale, a gap, a restart, a lost connection) leaves it ahead of Valkey: the pod is then dropped and loaded
again from its log before its next plan.

The state is written back per batch as one log entry (the batch's mutations), and as a snapshot from time to
time (when the log has grown past a third of it), in the same script as the batch.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index.backend import evalsha_pipeline
from kv_preflight.index.changes import change_args
from kv_preflight.index.entries import ApplyResult, Carry, ClearPod, MarkIncomplete, Mutation, text
from kv_preflight.index.layout import pod_keys
from kv_preflight.index.pod_log import encode_delta, encode_snapshot, restore
from kv_preflight.index.pod_state import Plan, PodState

MAX_RETRIES = 4  # plans sent again after "stale" (another writer moved the pod) before giving up
SNAPSHOT_EVERY_BYTES = 4096  # the log is folded into a snapshot once it exceeds this, or an eighth of the snapshot
SNAPSHOT_EVERY_BATCHES = 256
# A snapshot is written in chunks of this many bytes (fields "s", "s:1", ...): with the string's 6-byte header
# each fills the allocator's 8 KB size class exactly, where one 35 KB value took a 40 KB class.
SNAPSHOT_CHUNK = 8186

# The apply script's answers that are the writer's own business (the ingester never sees them)
STALE, REPLAN = "stale", "replan"


def gen_count(gen: str) -> int:
    head, _, _ = gen.partition(":")
    return int(head) if head.isdigit() else 0


@dataclass
class PodCache:
    """A pod's state as this writer last knew it committed."""

    state: PodState
    gen: str
    num: int | None
    snap_bytes: int = 0
    log_bytes: int = 0
    log_batches: int = 0
    groups_json: str = ""


@dataclass
class Prepared:
    """One batch, planned: the script's KEYS and header arguments, its changes, and what to commit."""

    pod: str
    keys: tuple[str, ...]
    head: list[Any]
    changes: list[Any]
    plan: Plan
    new_gen: str
    snapshot: bool
    log_size: int
    groups_json: str
    num: int | None = None
    sibs: bytes = b""  # the bits of the pod's sibling data-parallel ranks (kv_preflight/index/rank_pods.py)
    # the pod's keys have a gap (orphan keys, or their count not known) before or after this batch: on a
    # cluster the lookup must not bisect the pod while its changes travel (pod_step.lua's gap_entry)
    gap: bool = False

    def script_args(self) -> list[Any]:
        """apply.lua's arguments (a single node: the changes run in the same script)."""
        return self.head + change_args(self.changes, self.num, self.sibs)


@dataclass
class _Tentative:
    state: PodState
    gen: str
    log_bytes: int
    log_batches: int
    snap_bytes: int
    groups_json: str


def merge(first: Plan, second: Plan) -> Plan:
    """Two plans in a row as one (a reset: the clear, then the batch)."""
    return Plan(changes=first.changes + second.changes, after=second.after, stored=first.stored + second.stored,
                removed=first.removed + second.removed, cleared=first.cleared + second.cleared,
                reannounced=first.reannounced + second.reannounced, flags=second.flags,
                cleared_flags=first.cleared_flags or second.cleared_flags)


class PodWriter:
    """Plans and sends batches for the pods this process writes (see the module docstring)."""

    def __init__(self, client, *, cluster: bool, writer: str | None = None, reannouncements: bool = False):
        self.client = client
        self.cluster = cluster
        self.reannouncements = reannouncements  # PodState.reannouncements, for every pod this writer plans
        self.writer = writer or os.urandom(4).hex()
        self.pods: dict[str, PodCache] = {}
        self.heads: dict[str, _Tentative] = {}  # per pod, the state its batches in flight lead to
        # pod -> its sibling data-parallel ranks' bits (kv_preflight/index/rank_pods.py), for pods that have any
        self.sibs: dict[str, bytes] = {}

    # ---- loading

    async def load(self, pod_ids: Sequence[str]) -> None:
        """Load pods' states from their logs (meta and log read in one step, so they agree)."""
        if not pod_ids:
            return
        script = self.client.register_script(_READ_POD)
        replies = await evalsha_pipeline(self.client, script, [pod_keys(p) for p in pod_ids], [[] for _ in pod_ids])
        for p, r in zip(pod_ids, replies):
            self.pods[p] = self._cache_from(p, r[0], r[1])
            self.heads.pop(p, None)

    def _cache_from(self, pod_id: str, meta_flat: Sequence[Any], state_flat: Sequence[Any]) -> PodCache:
        meta = {text(meta_flat[i]): meta_flat[i + 1] for i in range(0, len(meta_flat) - 1, 2)}
        chunks: dict[int, bytes] = {}  # the snapshot's chunks ("s", "s:1", ...: kv_preflight/index/lua/pod_write.lua)
        deltas = []
        log_bytes = 0
        for i in range(0, len(state_flat) - 1, 2):
            name, value = text(state_flat[i]), state_flat[i + 1]
            if name == "s":
                chunks[0] = value
            elif name.startswith("s:") and name[2:].isdigit():
                chunks[int(name[2:])] = value
            elif name.startswith("d:"):
                deltas.append(value)
                log_bytes += len(value)
        snap = b"".join(chunks[i] for i in sorted(chunks)) if 0 in chunks else None
        snap_bytes = len(snap) if snap else 0
        state, _ = restore(snap, deltas, pod_id, reannouncements=self.reannouncements)
        ebs = meta.get("engine_block_size")
        if ebs and text(ebs).isdigit() and state.engine_block_size is None:
            state.engine_block_size = int(text(ebs))
        num = meta.get("num")
        return PodCache(state, text(meta.get("gen", b"0")), int(text(num)) if num is not None else None,
                        snap_bytes, log_bytes, len(deltas), text(meta.get("groups", b"")))

    def forget(self, pod_id: str) -> None:
        """Load the pod again before its next plan."""
        self.pods.pop(pod_id, None)
        self.heads.pop(pod_id, None)

    def set_num(self, pod_id: str, num: int) -> None:
        cache = self.pods.get(pod_id)
        if cache is not None:
            cache.num = num

    # ---- planning

    def prepare_run(self, batches: Sequence[Mapping[str, Any]]) -> list[Prepared]:
        """Plan batches in order, each pod's on top of what this writer has sent for it and not yet heard
        back about (as if it applied: a plan that did not is answered "stale", planned again)."""
        out = []
        for b in batches:
            pod = b["pod_id"]
            t = self.heads.get(pod)
            if t is None:
                c = self.pods[pod]
                t = _Tentative(c.state, c.gen, c.log_bytes, c.log_batches, c.snap_bytes, c.groups_json)
            try:
                prep = self._prepare(b, t)
            except BaseException:
                self.forget(pod)  # a plan cut short left the state half moved
                raise
            if prep.snapshot:
                self.heads[pod] = _Tentative(prep.plan.after, prep.new_gen, 0, 0, prep.log_size, prep.groups_json)
            else:
                self.heads[pod] = _Tentative(prep.plan.after, prep.new_gen, t.log_bytes + prep.log_size,
                                             t.log_batches + 1, t.snap_bytes, prep.groups_json)
            out.append(prep)
        return out

    def settle(self, preps: Sequence[Prepared], results: list[ApplyResult]) -> list[int]:
        """Commit what applied; return the positions to plan and send again: per pod, from its first batch
        answered "stale" or "replan" on (the later ones' answers were about a state that never was)."""
        redo: list[int] = []
        failed: set[str] = set()
        for i, (prep, r) in enumerate(zip(preps, results)):
            if prep.pod in failed:
                redo.append(i)
                continue
            if r.status == "applied" or (r.gen and r.gen == prep.new_gen):
                # (a batch sent again after a lost connection finds the generation it made itself: it applied)
                self.commit(prep, r)
                if r.status != "applied":
                    results[i] = ApplyResult("applied" if r.status == STALE else r.status, r.last_seq, r.foreign_writes,
                                             r.detail, r.gen)
                continue
            # Not applied: the state planned past this batch (and any after it) is not what Valkey holds, so
            # the pod is loaded again before its next plan (a dup: another writer applied it).
            self.forget(prep.pod)
            if r.status in (STALE, REPLAN, "nonum"):
                failed.add(prep.pod)
                redo.append(i)
        return redo

    def lost(self, preps: Sequence[Prepared]) -> None:
        """The batches' fate is not known (the connection failed): their pods are loaded again."""
        for prep in preps:
            self.forget(prep.pod)

    def _prepare(self, b: Mapping[str, Any], t: _Tentative) -> Prepared:
        pod = b["pod_id"]
        mode = b.get("mode", "check")
        mutations: Sequence[Mutation] = b.get("mutations", ())
        groups: Mapping[int, GroupSpec] | None = b.get("groups")
        carries: Mapping[int, Carry] | None = b.get("carries")  # (what its stores left unkeyed: PodState.carries)
        before = t.state.orphan_count  # (planning moves the state)
        if mode in ("clear", "reset_if"):
            plan = t.state.clear_plan()
            # a clearing that leaves the pod flagged in its own step (a rebuild's: not exact until its replay is in)
            plan.flags += [m.reason for m in mutations if type(m) is MarkIncomplete]
            logged: list[Mutation] = [ClearPod()]
        elif mode == "reset":
            first = t.state.clear_plan()
            plan = merge(first, first.after.plan(mutations, groups, carries))
            logged = [ClearPod(), *mutations]
        else:
            plan = t.state.plan(mutations, groups, carries)
            logged = list(mutations)
        ebs = b.get("engine_block_size")
        after = plan.after
        assert after is not None
        if ebs:
            after.engine_block_size = ebs
        n = gen_count(t.gen) + 1
        new_gen = f"{n}:{self.writer}"
        delta = encode_delta(n, logged, groups, ebs, carries)
        snapshot = (t.log_bytes + len(delta) > max(SNAPSHOT_EVERY_BYTES, t.snap_bytes // 8)
                    or t.log_batches + 1 >= SNAPSHOT_EVERY_BATCHES)
        value = encode_snapshot(after, n) if snapshot else delta
        chunks = [value[i:i + SNAPSHOT_CHUNK] for i in range(0, len(value), SNAPSHOT_CHUNK)] if snapshot else [value]
        state_field = "s" if snapshot else f"d:{n}"
        orphans = after.orphan_count
        groups_json = json.dumps({str(g): [s.kind, s.block_size, s.sliding_window, s.attention_chunk_size, s.eagle]
                                  for g, s in sorted(after.groups.items())}, separators=(",", ":"))
        meta: list[Any] = ["blocks", len(after), "orphan_keys", "" if orphans is None else orphans]
        if groups_json != t.groups_json:
            meta += ["groups", groups_json]
        counters = [(k, v) for k, v in (("stored", plan.stored), ("removed", plan.removed),
                                        ("cleared", plan.cleared if mode != "reset" else 0),
                                        ("reannounced", plan.reannounced)) if v]
        head = [b.get("rank", 0), b.get("seq", 0), repr(float(b.get("ts", 0.0))), mode, t.gen, repr(time.time()),
                b.get("model", ""), "" if not ebs else ebs, state_field, chunks[0], len(chunks) if snapshot else 0,
                new_gen, len(meta) // 2, *meta, len(counters), *[x for kv in counters for x in kv],
                len(plan.flags), *plan.flags, "1" if plan.cleared_flags else "0", *chunks[1:]]
        gap = before is None or before > 0 or orphans is None or orphans > 0
        return Prepared(pod, pod_keys(pod, cluster=self.cluster), head, plan.changes, plan, new_gen, snapshot,
                        len(value), groups_json, self.pods[pod].num, self.sibs.get(pod, b""), gap)

    def commit(self, prep: Prepared, result: ApplyResult) -> None:
        c = self.pods.get(prep.pod)
        if c is None:
            return
        c.state = prep.plan.after  # type: ignore[assignment]
        c.gen = prep.new_gen
        c.groups_json = prep.groups_json
        if prep.snapshot:
            c.snap_bytes, c.log_bytes, c.log_batches = prep.log_size, 0, 0
        else:
            c.log_bytes += prep.log_size
            c.log_batches += 1


# A pod's meta and state log, read in one step (so the log is the one the meta's generation names); a key of
# a foreign type reads as empty (the apply script refuses the batch with the reason, before any write).
_READ_POD = """
local function all(k)
  local r = redis.pcall('HGETALL', k)
  if type(r) == 'table' and r.err then return {} end
  return r
end
return {all(KEYS[1]), all(KEYS[2])}
"""


__all__ = ["MAX_RETRIES", "REPLAN", "STALE", "PodCache", "PodWriter", "Prepared", "gen_count",
           "merge"]
