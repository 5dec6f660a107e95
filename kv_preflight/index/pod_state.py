"""One pod's private index state, held in the writer's memory, and the plan of a batch against it. Pure.

Layout 4 keeps in Valkey, per request key, only what every reader needs (llm-d's entry, ``engine:<key>``, and
the pod bitmaps the lookup reads, ``kv_preflight/index/layout.py``). What only the pod's writer needs (which
engine blocks the pod holds, in which KV cache group and tier, with how many physical copies, which request keys
each links, the reference counts behind each entry and each bit, the orphan count, the tokens a block that
ends mid request key left for its child) lives here, in the ingester's memory, and is persisted per pod as one
compact log (``kvpf:{<pod>}:state``: a snapshot and the batches since, see ``encode_snapshot``). Every writer of
a pod (its batches, clears, resets, imports, the CLI) plans against this state at a generation ``gen`` and the
apply script runs the plan only if the pod is still at that generation (optimistic concurrency), so a plan made
from a stale copy is refused, never half applied.

``PodState.plan(mutations)`` moves the state past a batch and returns the commands' intent (``Plan``): per
request key an entry and a bit change, per engine key an add or a conditional drop; the backends turn these
into Valkey commands. Planning changes the state in place, in time proportional to the batch (a copy per batch
would cost the pod's whole state, thousands of blocks, for every batch of a few dozen): the writer plans each
pod's batches on the state its earlier batches lead to, and if one of them is not applied it drops the state
and loads it again from the log (kv_preflight/index/writer.py), which is rare (another writer, a gap, a lost
connection). ``clone`` gives a copy for callers that need the state before.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kv_preflight.engines.hit_rules import GroupSpec, longest_hit, prefix_group
from kv_preflight.index.entries import CHAIN_ROOT, Carry, ClearPod, MarkIncomplete, Mutation, RemoveBlock, StoreBlock, parse_entry
from kv_preflight.index.rank_pods import base_pod

UNKNOWN = None  # a block's parent when not known (an import of an older export): the orphan count is unknown


class KeyChange(NamedTuple):
    """One request key's change for this pod: its llm-d entry (``entry`` +1 write, -1 delete, 0 none, of
    ``field``) and its bit (``bit_delta`` on the bitmap named ``bit``: ``<tier>`` for the pod's prefix group,
    ``<tier>|<group>`` for its other KV cache groups, see ``PodState.bit_name``)."""

    rk: int
    field: str
    entry: int
    bit: str
    bit_delta: int


class EngineAdd(NamedTuple):
    """``engine:<ek>`` gains the block's request keys, at their positions (llm-d's ZSET)."""

    ek: int
    rks: tuple[int, ...]


class EngineDrop(NamedTuple):
    """The pod no longer holds ``ek``: its request keys leave ``engine:<ek>`` once none of them holds an entry
    (llm-d's own rule for pruning an engine key)."""

    ek: int
    rks: tuple[int, ...]


Change = KeyChange | EngineAdd | EngineDrop


@dataclass
class Plan:
    """A batch planned against a pod's state: the changes in order, the state after it (``after``, to commit
    once applied) and what the pod's meta gets."""

    changes: list[Change] = field(default_factory=list)
    after: "PodState | None" = None
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    reannounced: int = 0
    flags: list[str] = field(default_factory=list)  # MarkIncomplete reasons, in order
    cleared_flags: bool = False  # a clear made the pod exact again (its flags go)


class _Block(msgspec.Struct, gc=False):
    """One held block. Scalars only, so never tracked by Python's cycle collector (gc=False): a pod state
    holds one per engine block, and the collector's passes over them cost the ingester much of its CPU
    (kv_preflight/collector.py has the figures)."""

    field: str
    rks: tuple[int, ...]
    parent: int | None
    copies: int = 1

    def copy(self) -> "_Block":
        return _Block(self.field, self.rks, self.parent, self.copies)


BlockKey = tuple[int, str, int]  # (engine key, tier, group)


class PodState:
    """A pod's private state (see the module docstring). ``groups``: KV cache group -> spec (learned from the
    engine's events, or given); the prefix group (full attention, else group 0) is the one whose keys the
    lookup may bisect, so the orphan count is kept over it."""

    def __init__(self, groups: Mapping[int, GroupSpec] | None = None, engine_block_size: int | None = None,
                 pod_id: str | None = None):
        self.pod_id = pod_id
        self._tiers: dict[str, str | None] = {}  # entry field -> the tier a lookup counts it on (None: not at all)
        self.blocks: dict[BlockKey, _Block] = {}
        self.tiers: set[str] = set()  # the tiers the pod has stored blocks on
        self.entry_refs: dict[tuple[int, str], int] = {}  # (rk, field) -> blocks linking them
        self.bit_refs: dict[tuple[int, str], int] = {}  # (rk, bit name) -> blocks linking them
        self.ek_slots: dict[tuple[int, int], int] = {}  # (ek, group) -> tiers holding it there
        self.ek_refs: dict[int, int] = {}  # ek -> slots (tier, group) holding it
        self.rk_links: dict[int, int] = {}  # rk -> the pod's blocks linking it (any field)
        # Engine keys the pod let go of while another of its blocks still linked their request keys (two
        # engine keys, one request key: the keys' entries stay, so llm-d's rule keeps engine:<ek>): dropped
        # from engine:<ek> once the pod links none of their keys (``waiting``: rk -> such engine keys).
        self.deferred: dict[int, tuple[int, ...]] = {}
        self.waiting: dict[int, set[int]] = {}
        self.held: dict[int, int] = {}  # rk -> prefix-group blocks linking it (any tier)
        self.known: dict[int, int] = {}  # rk -> those of its links that know its parent
        self.kids: dict[int, int] = {}  # rk -> held keys naming it as their parent
        self.parent_of: dict[int, int] = {}  # rk -> its parent (CHAIN_ROOT: a chain's first), held keys known
        self.unknown = 0  # held keys whose parent is not known
        self.orphans = 0  # held keys whose parent is not held (exact while unknown == 0)
        self._groups: dict[int, GroupSpec] = dict(groups or {})
        self._prefix = prefix_group(self._groups)  # kept with the groups: asked for every block planned
        self._bits: dict[tuple[str, int], str] = {}  # (entry field, group) -> bit_of's answer, while the groups stay
        self.engine_block_size = engine_block_size
        # Whether a parentless run of held blocks from a chain's start may be vLLM re-announcing reused blocks
        # (``_reannounced``): only when clients ask vLLM for kv_cache_report_mode "full" (ingest
        # --kv-cache-report-mode full). Otherwise such a run is a second physical copy: concurrent requests
        # that computed one prefix at once store it from block 0 twice, and each copy is evicted in turn.
        self.reannouncements = False
        # Engine key -> what a held block left unkeyed (``Carry``: E not a multiple of C), which its child's first
        # key needs; given with the batch that stores the block, gone with the block's last copy (``_carry``),
        # persisted with the blocks (kv_preflight/index/pod_log.py).
        self.carries: dict[int, Carry] = {}

    # ---- copies

    def clone(self) -> "PodState":
        other = PodState(self.groups, self.engine_block_size, self.pod_id)
        other.reannouncements = self.reannouncements
        other._tiers = self._tiers
        other.blocks = {k: b.copy() for k, b in self.blocks.items()}
        other.tiers = set(self.tiers)
        other.entry_refs = dict(self.entry_refs)
        other.bit_refs = dict(self.bit_refs)
        other.ek_slots = dict(self.ek_slots)
        other.ek_refs = dict(self.ek_refs)
        other.rk_links = dict(self.rk_links)
        other.deferred = dict(self.deferred)
        other.waiting = {rk: set(v) for rk, v in self.waiting.items()}
        other.held = dict(self.held)
        other.known = dict(self.known)
        other.kids = dict(self.kids)
        other.parent_of = dict(self.parent_of)
        other.unknown, other.orphans = self.unknown, self.orphans
        other.carries = dict(self.carries)
        return other

    # ---- what the lookup and meta need

    @property
    def groups(self) -> Mapping[int, GroupSpec]:
        return self._groups

    @groups.setter
    def groups(self, groups: Mapping[int, GroupSpec]) -> None:
        self._groups = dict(groups)
        self._prefix = prefix_group(self._groups)
        self._bits = {}

    @property
    def prefix_group(self) -> int:
        return self._prefix

    @property
    def orphan_count(self) -> int | None:
        """Held keys of the prefix group whose parent is not held; None when some parent is not known."""
        return None if self.unknown else self.orphans

    def __len__(self) -> int:
        return len(self.blocks)

    def block_keys(self, ek: int) -> tuple[tuple[int, ...], int | None] | None:
        """A held block's request keys and parent, in whichever tier or group the pod holds ``ek`` (the same
        keys in each: vLLM hashes tokens, not groups or tiers). Asked for a batch's parents and partial events'
        blocks, so the commonest place, the GPU tier of the prefix group, is tried first."""
        b = self.blocks.get((ek, "gpu", self._prefix))
        if b is not None:
            return b.rks, b.parent
        if not self.ek_refs.get(ek):
            return None
        for group in sorted({0, *self.groups}):
            if self.ek_slots.get((ek, group)):
                for tier in self.tiers:
                    b = self.blocks.get((ek, tier, group))
                    if b is not None:
                        return b.rks, b.parent
        return None

    def field_tier(self, fld: str) -> str | None:
        """The tier a lookup counts an entry field on for this pod, as every reader parses it (llm-d's
        PodEntry): None for a speculative, unparseable or other pod's entry, which gets no bit, so the
        bitmaps say exactly what the entries say."""
        t = self._tiers.get(fld, "")
        if t == "":
            e = parse_entry(fld)
            # a data-parallel rank's entries name its pod (kv_preflight/index/rank_pods.py)
            t = None if e is None or e.Speculative or (self.pod_id is not None and e.PodIdentifier != base_pod(self.pod_id)) \
                else e.DeviceTier
            self._tiers[fld] = t
        return t

    def bit_of(self, fld: str, group: int) -> str:
        """The presence field of a block with entry ``fld`` in ``group`` ("" for none)."""
        bit = self._bits.get((fld, group))
        if bit is None:
            tier = self.field_tier(fld)
            bit = self._bits[(fld, group)] = "" if tier is None else self.bit_name(tier, group)
        return bit

    def bit_name(self, tier: str, group: int) -> str:
        """The presence field a block of ``group`` on ``tier`` sets the pod's bit in: ``<tier>`` for the
        prefix group (what every lookup walks), ``<tier>|<group>`` for a hybrid model's other groups (what
        the engine's rule reads beside it). Named per pod, so pods of different models share one bitmap."""
        return tier if group == self.prefix_group else f"{tier}|{group}"

    def set_groups(self, groups: Mapping[int, GroupSpec], out: "Plan | None" = None) -> None:
        """Learn group specs. If that moves the prefix group, the pod's bits move to the fields the new one
        names (changes in ``out``) and the orphan count is rebuilt over it."""
        if all(self._groups.get(g) == spec for g, spec in groups.items()):
            return  # the specs a pod's every batch repeats: nothing learnt (and the bit names' cache kept)
        before = self.prefix_group
        if before == self._prefix_of({**self.groups, **groups}):
            self.groups = {**self.groups, **groups}
            return
        names = {}
        for (ek, tier, group), b in self.blocks.items():
            names[(b.field, group)] = self.bit_of(b.field, group)
        self.groups = {**self.groups, **groups}
        moved: dict[tuple[int, str], tuple[str, int]] = {}  # (rk, old name) -> (new name, refs)
        for (ek, tier, group), b in self.blocks.items():
            old, new = names[(b.field, group)], self.bit_of(b.field, group)
            if old != new and old and new:
                for rk in b.rks:
                    moved[(rk, old)] = (new, self.bit_refs.get((rk, old), 0))
        for (rk, old), (new, refs) in moved.items():
            self.bit_refs.pop((rk, old), None)
            if out is not None:
                out.changes.append(KeyChange(rk, "", 0, old, -1))
        for (rk, old), (new, refs) in moved.items():
            self.bit_refs[(rk, new)] = refs
            if out is not None:
                out.changes.append(KeyChange(rk, "", 0, new, +1))
        self._reindex_prefix()

    @staticmethod
    def _prefix_of(groups: Mapping[int, GroupSpec]) -> int:
        return prefix_group(groups)

    def _reindex_prefix(self) -> None:
        self.held.clear()
        self.known.clear()
        self.kids.clear()
        self.parent_of.clear()
        self.unknown = self.orphans = 0
        pg = self.prefix_group
        for (ek, tier, group), b in self.blocks.items():
            if group == pg and self.field_tier(b.field) is not None:
                for j, rk in enumerate(b.rks):
                    self._prefix_link(rk, b.parent if j == 0 else b.rks[j - 1], +1)

    # ---- planning

    def plan(self, mutations: Sequence[Mutation], groups: Mapping[int, GroupSpec] | None = None,
             carries: Mapping[int, Carry] | None = None) -> Plan:
        """The changes ``mutations`` make; this state moves past them (``after`` is this state). ``carries``:
        engine key -> what the batch's stored blocks left unkeyed (``Carry``), kept for those still held after
        it."""
        st = self
        out = Plan(after=st)
        if groups:
            st.set_groups(groups, out)
        i = 0
        n = len(mutations)
        while i < n:
            if _plan_blocks is not None:  # the stores and removals up to the next mutation Python handles, in C
                i = _plan_blocks(st, out, mutations, i, st.reannouncements, _PLAN_TYPES)
                if i >= n:
                    break
            m = mutations[i]
            if isinstance(m, StoreBlock):
                if m.parentless and m.parent in (CHAIN_ROOT, UNKNOWN) and st.reannouncements:
                    j = _run_end(mutations, i)
                    run = mutations[i:j]
                    if st._reannounced(run):
                        out.reannounced += len(run)
                        i = j
                        continue
                    for s in run:
                        st._store(s, out)
                    i = j
                    continue
                st._store(m, out)
            elif isinstance(m, RemoveBlock):
                st._remove(m, out)
            elif isinstance(m, ClearPod):
                st._clear(out)
                out.cleared += 1
                out.flags = []
                out.cleared_flags = True
            elif isinstance(m, MarkIncomplete):
                out.flags.append(m.reason)
            i += 1
        if carries or self.carries:
            self._carry(mutations, carries)
        return out

    def clear_plan(self) -> Plan:
        """Every entry, bit and engine-key link of the pod removed (index clear, engine restart); in place."""
        st = self
        out = Plan(after=st)
        st._clear(out)
        return out

    def _reannounced(self, run: Sequence[StoreBlock]) -> bool:
        """Whether a parentless run of blocks from a chain's start is vLLM re-announcing blocks a request reused
        (``kv_cache_report_mode`` "full": ``BlockPool.emit_cached_block_events``, always from block 0, no parent)
        rather than caching blocks it computed again (``cache_full_blocks`` with nothing cached before, also
        from block 0 with no parent: a request whose cache hit was 0, so each held hash gets a second physical
        copy; on a hybrid model this happens whenever a sliding-window group cut the hit). A re-announcement
        covers exactly the blocks vLLM found as a hit, so it is one when the engine's rule, on the pod's
        state before it, finds every block of the run a hit. (One case stays ambiguous: a prompt of exactly
        one engine block whose block is cached is recomputed, since the last token always is; it reads as a
        re-announcement.)"""
        if not all((s.engine_key, s.tier, s.group) in self.blocks for s in run):
            return False
        ebs = self.engine_block_size or 1
        groups = self.groups or {run[0].group: GroupSpec()}
        eks = [s.engine_key for s in run]
        slots = self.ek_slots

        def held(g: int, i: int) -> bool:
            return i < len(eks) and slots.get((eks[i], g), 0) > 0

        return longest_hit(groups, held, len(run) * ebs + 1, ebs) == len(run) * ebs

    def _store(self, m: StoreBlock, out: Plan) -> None:
        bk = (m.engine_key, m.tier, m.group)
        held = self.blocks.get(bk)
        if held is not None:
            held.copies += 1  # another physical copy of a held hash (its eviction comes once per copy)
            out.stored += 1
            return
        parent = m.parent  # None: not known (UNKNOWN)
        rks = tuple(m.request_keys)
        fld = m.entry_field
        self.blocks[bk] = _Block(fld, rks, parent)
        self.tiers.add(m.tier)
        self._link_engine(m.engine_key, m.group, rks, out)
        bit = self.bit_of(fld, m.group)
        prefix = m.group == self._prefix
        link = self._link
        for rk in rks:  # each key's parent: the block's parent, then the key before it
            link(rk, fld, bit, +1, out, prefix, parent)
            parent = rk
        out.stored += 1

    def _remove(self, m: RemoveBlock, out: Plan) -> None:
        bk = (m.engine_key, m.tier, m.group)
        held = self.blocks.get(bk)
        if held is None:
            return
        out.removed += 1
        if held.copies > 1:
            held.copies -= 1
            return
        self._drop(bk, held, out)

    def _drop(self, bk: BlockKey, held: _Block, out: Plan) -> None:
        del self.blocks[bk]
        ek, tier, group = bk
        fld = held.field
        bit = self.bit_of(fld, group)
        prefix = group == self._prefix
        link = self._link
        parent = held.parent
        for rk in held.rks:
            link(rk, fld, bit, -1, out, prefix, parent)
            parent = rk
        self._unlink_engine(ek, group, held.rks, out)

    def _carry(self, mutations: Sequence[Mutation], carries: Mapping[int, Carry] | None) -> None:
        """After a batch: a carry is kept exactly while its block is held (in any tier or group). Those of
        blocks the batch removed go, and the batch's stores' own (``carries``) come in where their block is
        still held at its end: a function of the batch alone, so its log entry replays to the same carries
        (kv_preflight/index/pod_log.py records one per store, as here)."""
        kept, refs = self.carries, self.ek_refs
        for m in mutations:
            if isinstance(m, StoreBlock):
                if carries:
                    c = carries.get(m.engine_key)
                    if c is not None and refs.get(m.engine_key):
                        kept[m.engine_key] = c
            elif isinstance(m, RemoveBlock) and m.engine_key in kept and not refs.get(m.engine_key):
                del kept[m.engine_key]

    def _clear(self, out: Plan) -> None:
        self.carries.clear()
        for bk in list(self.blocks):
            self._drop(bk, self.blocks[bk], out)
        # nothing held: the orphan count is known again (0)
        self.held.clear()
        self.known.clear()
        self.kids.clear()
        self.parent_of.clear()
        self.unknown = self.orphans = 0

    def _link_engine(self, ek: int, group: int, rks: tuple[int, ...], out: Plan) -> None:
        self.ek_slots[(ek, group)] = self.ek_slots.get((ek, group), 0) + 1
        n = self.ek_refs.get(ek, 0)
        self.ek_refs[ek] = n + 1
        if n == 0:
            self._undefer(ek)
            if rks:
                out.changes.append(EngineAdd(ek, rks))

    def _undefer(self, ek: int) -> None:
        for rk in self.deferred.pop(ek, ()):
            left = self.waiting.get(rk)
            if left is not None:
                left.discard(ek)
                if not left:
                    del self.waiting[rk]

    def _unlink_engine(self, ek: int, group: int, rks: tuple[int, ...], out: Plan) -> None:
        k = (ek, group)
        left = self.ek_slots[k] - 1
        if left:
            self.ek_slots[k] = left
        else:
            del self.ek_slots[k]
        n = self.ek_refs[ek] - 1
        if n:
            self.ek_refs[ek] = n
        else:
            del self.ek_refs[ek]
            links = self.rk_links
            if (links.get(rks[0]) if len(rks) == 1 else any(links.get(rk) for rk in rks)):
                self._defer(ek, rks)
            elif rks:
                out.changes.append(EngineDrop(ek, rks))

    def _defer(self, ek: int, rks: tuple[int, ...]) -> None:
        self.deferred[ek] = rks
        for rk in rks:
            self.waiting.setdefault(rk, set()).add(ek)

    def _release(self, rk: int, out: Plan) -> None:
        """``rk`` lost its last link: the engine keys waiting on it drop once none of their keys is linked."""
        for ek in sorted(self.waiting.pop(rk)):
            rks = self.deferred.get(ek)
            if rks is not None and not any(self.rk_links.get(k) for k in rks):
                self._undefer(ek)
                out.changes.append(EngineDrop(ek, rks))

    def _link(self, rk: int, fld: str, bit: str, d: int, out: Plan, prefix: bool, parent: int | None) -> None:
        """One more (or one fewer) of the pod's blocks links ``rk`` with entry ``fld`` and bitmap ``bit``:
        the entry and the bit follow the first link and the last unlink."""
        links = self.rk_links.get(rk, 0) + d
        if links > 0:
            self.rk_links[rk] = links
        else:
            self.rk_links.pop(rk, None)
        ek_ = (rk, fld)
        n = self.entry_refs.get(ek_, 0) + d
        entry = 0
        if n <= 0:
            self.entry_refs.pop(ek_, None)
            entry = -1
        else:
            self.entry_refs[ek_] = n
            entry = 1 if n == 1 and d > 0 else 0
        bit_delta = 0
        if bit:
            kb = (rk, bit)
            b = self.bit_refs.get(kb, 0) + d
            if b <= 0:
                self.bit_refs.pop(kb, None)
                bit_delta = -1
            else:
                self.bit_refs[kb] = b
                bit_delta = 1 if b == 1 and d > 0 else 0
        if entry or bit_delta:
            out.changes.append(KeyChange(rk, fld, entry, bit, bit_delta))
        if prefix and bit:
            self._prefix_link(rk, parent, d)
        if links <= 0 and rk in self.waiting:
            self._release(rk, out)

    # ---- the orphan count (held keys of the prefix group whose parent it does not hold)
    # Counted per link (a block of the prefix group linking a key, on any tier): a key is held while it has a
    # link; its parent is known while one of its links knows it (a key's parent is fixed by its chain, so
    # links that know it agree), so the count is a function of the blocks alone and a restored state has it.

    def _prefix_link(self, rk: int, parent: int | None, d: int) -> None:
        links = self.held.get(rk, 0)
        known = self.known.get(rk, 0)
        if d > 0:
            self.held[rk] = links + 1
            if parent is not UNKNOWN:
                self.known[rk] = known + 1
            if links == 0:
                self.orphans -= self.kids.get(rk, 0)  # its held children had it as a missing parent
                if parent is UNKNOWN:
                    self.unknown += 1
                else:
                    self._add_parent(rk, parent)
            elif known == 0 and parent is not UNKNOWN:
                self.unknown -= 1
                self._add_parent(rk, parent)
            return
        if links <= 1:
            self.held.pop(rk, None)
            self.known.pop(rk, None)
            self.orphans += self.kids.get(rk, 0)  # its held children lose their parent
            if known:
                self._drop_parent(rk)
            else:
                self.unknown -= 1
            return
        self.held[rk] = links - 1
        if parent is not UNKNOWN:
            if known <= 1:
                self.known.pop(rk, None)
                self._drop_parent(rk)
                self.unknown += 1
            else:
                self.known[rk] = known - 1

    def _add_parent(self, rk: int, parent: int) -> None:
        self.parent_of[rk] = parent
        if parent != CHAIN_ROOT:
            self.kids[parent] = self.kids.get(parent, 0) + 1
            if not self.held.get(parent):
                self.orphans += 1

    def _drop_parent(self, rk: int) -> None:
        parent = self.parent_of.pop(rk)
        if parent != CHAIN_ROOT:
            k = self.kids[parent] - 1
            if k:
                self.kids[parent] = k
            else:
                del self.kids[parent]
            if not self.held.get(parent):
                self.orphans -= 1

    # ---- what a lookup of the pod's own holdings needs (export, inspect)

    def stores(self) -> Iterable[StoreBlock]:
        """Every block as the StoreBlock that recreates it, once per physical copy (index export)."""
        for (ek, tier, group), b in self.blocks.items():
            s = StoreBlock(ek, tier, b.field, b.rks, group, False, b.parent)
            for _ in range(b.copies):
                yield s


try:  # the loop of ``plan`` over stores and removals, in C (kv_preflight/index/_write_path.c); the methods above are
    # its reference and stand in when it is not built
    from kv_preflight.index._write_path import plan_blocks as _plan_blocks
except ImportError:  # pragma: no cover - no compiler at install time
    _plan_blocks = None
_PLAN_TYPES = (StoreBlock, RemoveBlock, _Block, KeyChange, EngineAdd, EngineDrop)


def _run_end(mutations: Sequence[Mutation], i: int) -> int:
    """The end of the parentless run that starts at ``i``: one event's blocks (same slot, each chained to the
    block before it)."""
    first = mutations[i]
    assert isinstance(first, StoreBlock)
    j = i + 1
    prev = first
    while j < len(mutations):
        m = mutations[j]
        if not (isinstance(m, StoreBlock) and m.parentless and m.parent != CHAIN_ROOT and m.tier == first.tier
                and m.group == first.group and prev.request_keys and m.parent == prev.request_keys[-1]):
            break
        prev = m
        j += 1
    return j


__all__ = ["Change", "EngineAdd", "EngineDrop", "KeyChange", "Plan", "PodState"]
