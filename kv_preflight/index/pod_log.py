"""A pod's private state as Valkey keeps it (``kvpf:{<pod>}:state``): a snapshot of its blocks, then the mutation
batches applied since, and the state they rebuild (``restore``). Pure.

The state itself and the plan of a batch against it are kv_preflight/index/pod_state.py; this module is only
their persistence, so the writer (kv_preflight/index/writer.py) writes each batch as one log entry and folds
the log into a snapshot from time to time, and any writer or reader can rebuild the state from it.
"""
from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.index.entries import CHAIN_ROOT, Carry, ClearPod, MarkIncomplete, Mutation, RemoveBlock, StoreBlock
from kv_preflight.index import pod_state as _state  # its C plan loop, read at each call (tests swap it)
from kv_preflight.index.pod_state import _PLAN_TYPES, Plan, PodState

log = logging.getLogger(__name__)

# ---- persistence: a snapshot of the blocks, then the mutation batches applied since
# Both are msgpack. A snapshot is columnar (one list per attribute, built in C in one pass over the blocks, or
# by comprehensions: a pod's thousands of blocks encode in a tenth of a millisecond, or about one) and names
# each entry field once; a delta names its fields once too (llm-d's entry JSON is ~100 bytes, a block's keys
# ~30), so the log stays small and snapshots rare.

class _Snapshot(msgspec.Struct, array_like=True):
    """Per block, in the state's order (the order blocks were stored, so a request's blocks sit in chain order):
    engine keys and request keys as packed little-endian u64s, each block's key count, its tier, group and
    field in one small int, and its parent only where it is not the previous block's last request key. About
    20 bytes a block of one request key (a msgpack tuple per block took 35)."""

    gen: int
    fields: list[str]
    groups: dict[int, tuple[str, int | None, int | None, int | None, bool]]
    engine_block_size: int | None
    tiers: list[str]
    engine_keys: bytes  # u64 per block
    request_keys: bytes  # u64 per request key, every block's in turn
    counts: list[int]  # request keys per block; one value: every block's (the usual case: a byte saved a block)
    codes: list[int]  # per block: field id << 12 | group << 4 | tier id; one value: every block's
    chained: bytes  # bit i set: block i's parent is block i-1's last request key
    parents: list[int | None]  # the other blocks' parents, in order (CHAIN_ROOT, a request key, None: unknown)
    copies: dict[int, int] = {}  # block index -> physical copies, where more than one
    deferred: list[tuple[int, list[int]]] = []  # PodState.deferred


class _Delta(msgspec.Struct, array_like=True):
    """One applied batch, as the mutations that make it (replayed through ``plan`` to rebuild the state),
    columnar as a snapshot is: per op its kind; per store or removal its engine key (packed u64) and one small
    int (field id << 12 | group << 4 | tier id; one value: every op's); per store its request keys (packed, with
    their count per store), whether it was parentless, and its parent only where it is not the previous store's
    last request key. About 18 bytes a store of one request key (a msgpack tuple per op took 37): every byte
    of it is copied into a Lua string by the apply script, which costs Valkey more than the copy."""

    gen: int
    groups: dict[int, tuple[str, int | None, int | None, int | None, bool]]
    engine_block_size: int | None
    fields: list[str]
    tiers: list[str]
    kinds: bytes  # per op: 0 store, 1 removal, 2 clear, 3 flag
    engine_keys: bytes  # u64 per store or removal
    codes: list[int]  # per store or removal
    counts: list[int]  # request keys per store; one value: every store's
    request_keys: bytes  # u64 per request key, every store's in turn
    parentless: bytes  # bit i set: store i had no parent in its event
    chained: bytes  # bit i set: store i's parent is store i-1's last request key
    parents: list[int | None]  # the other stores' parents, in order
    reasons: list[str]  # per flag


class _Carries(msgspec.Struct, array_like=True):
    """What blocks that end mid request key left unkeyed (``PodState.carries``, ``Carry``), beside a snapshot's
    blocks or a delta's stores, by position: per block or store its carry's tokens (None: it has no carry; an
    empty array: it has one, of no tokens), and the rare ids and salts by position. Only the tokens: the chain
    point they continue is the block's last request key (or, for a block that keyed none, the key it chains
    from), which the log holds already. A log entry with no carry has no such column (its bytes are those of
    the builds before carries were kept, which read a column after their own as nothing). Where engine blocks are
    smaller than a request key (SGLang's default page of 1 token), a block that completes no key leaves its
    parent's carry and its own tokens: such a carry, after its parent's, is written as its own tokens only (bit i
    of ``extends``), which keeps the column's size to what the blocks add (at E = 1, 8 bytes a block where every
    carry written whole took 31, of 18 for the rest of the block)."""

    tokens: list[tuple[int, ...] | None]
    extras: dict[int, tuple[list[str], str | None]] = {}
    extends: bytes = b""  # bit i set: tokens[i] is what carry i adds to carry i-1's


class _CarriedSnapshot(_Snapshot, array_like=True):
    """A snapshot with the held blocks' carries (``_Carries``, encoded as it is: its own msgpack element)."""

    carries: msgspec.Raw = msgspec.Raw()


class _CarriedDelta(_Delta, array_like=True):
    """A delta with its stores' carries (``_Carries``)."""

    carries: msgspec.Raw = msgspec.Raw()


try:  # a delta's and a snapshot's columns, and uint64s packed, in C (kv_preflight/_speedups.c); ``_encode_delta``,
    # ``_columns`` and the Python packing below are their references and stand in when not built
    from kv_preflight._speedups import delta_columns as _delta_columns
    from kv_preflight._speedups import pack_u64s as _pack_u64s
    from kv_preflight._speedups import snapshot_columns as _snapshot_columns
except ImportError:  # pragma: no cover - no compiler at install time
    _delta_columns = _pack_u64s = _snapshot_columns = None
_DELTA_TYPES = (StoreBlock, RemoveBlock, ClearPod, MarkIncomplete)


class PodLogError(ValueError):
    """A pod's state log that does not read (a hand edit, a bug, a build that writes another format). Nothing can
    be planned against it (its blocks are not known), so the pod's writers refuse its batches and the ingester
    flags the pod (ingester/apply.py), where the decoder's own error ended the process."""

    def __init__(self, pod_id: str | None, why: str):
        super().__init__(f"pod {pod_id}: its state log does not read ({why})"[:300])
        self.pod_id = pod_id


_enc = msgspec.msgpack.Encoder()
_snap_dec = msgspec.msgpack.Decoder(_CarriedSnapshot)
_delta_dec = msgspec.msgpack.Decoder(_CarriedDelta)
_carries_dec = msgspec.msgpack.Decoder(_Carries)


def _spec_tuple(s: GroupSpec) -> tuple[str, int | None, int | None, int | None, bool]:
    return (s.kind, s.block_size, s.sliding_window, s.attention_chunk_size, s.eagle)


def encode_snapshot(state: PodState, gen: int) -> bytes:
    """A pod's snapshot (``_Snapshot``): an ingester writes one every few batches of each pod, over the pod's
    whole state (thousands of blocks), so its per-block columns come from C where the extension is built
    (``snapshot_columns``, one pass over the blocks: about an eighth of the instructions of ``_columns``, the
    Python path, which cost a sixth of the ingester's CPU). What C refuses (what the format cannot hold, or a
    value not plainly typed) takes the Python path, the reference: it raises its own errors, in its order."""
    columns = None
    if _snapshot_columns is not None:
        try:
            columns = _snapshot_columns(state.blocks)
        except (OverflowError, TypeError, ValueError):
            pass  # the Python path below says what is wrong, or takes the odd value as it always did
    if columns is None:
        columns = _columns(state)
    fields, tiers, engine_keys, request_keys, counts, codes, chained, parents, copies = columns
    carried = _snapshot_carries(state) if state.carries else None
    return _enc.encode((_Snapshot if carried is None else _CarriedSnapshot)(
        gen, fields, {g: _spec_tuple(s) for g, s in state.groups.items()}, state.engine_block_size, tiers,
        engine_keys, request_keys, counts, codes, chained, parents, copies,
        [(ek, list(rks)) for ek, rks in state.deferred.items()], *(() if carried is None else (carried,))))


def _snapshot_carries(state: PodState) -> msgspec.Raw | None:
    """The held blocks' carries, at the first block of each engine key."""
    get = state.carries.get
    if len(state.ek_refs) == len(state.blocks):  # each engine key in one block (one tier, one group): the usual pod
        return _carry_column([get(ek) for ek, _, _ in state.blocks])
    seen: set[int] = set()
    at: list[Carry | None] = []
    for ek, _, _ in state.blocks:
        at.append(None if ek in seen else get(ek))
        seen.add(ek)
    return _carry_column(at)


def _carry_column(carries: list[Carry | None]) -> msgspec.Raw | None:
    """``_Carries`` of blocks or stores, one carry or None each, encoded; None when none has a carry."""
    n = carries.count(None)
    if n == len(carries):
        return None
    tokens = [c.tokens for c in carries] if not n else [None if c is None else c.tokens for c in carries]
    # (a comprehension, not a loop: the column is built once per snapshot of the pod's thousands of blocks)
    extending = [i for i, p, t in zip(range(1, len(tokens)), tokens, tokens[1:])
                 if p and t is not None and len(t) > len(p) and t[:len(p)] == p]
    extends = bytearray((len(tokens) + 7) >> 3) if extending else b""
    for i in reversed(extending):  # (from the last: each is cut by its predecessor's whole tokens)
        tokens[i] = tokens[i][len(tokens[i - 1]):]
        extends[i >> 3] |= 1 << (i & 7)
    return msgspec.Raw(_enc.encode(_Carries(tokens, {i: (list(c.ids), c.salt) for i, c in enumerate(carries)
                                                     if c is not None and (c.ids or c.salt is not None)},
                                            bytes(extends))))


def _read_carries(raw: msgspec.Raw, eks: Sequence[int], pod_id: str | None) -> dict[int, Carry]:
    """The carries a ``_Carries`` column gives the blocks or stores whose engine keys are ``eks``; none when the
    entry has no column (written by a build before carries were kept, or by a batch without any), or one that does
    not read (logged: never an error, as without the column a child of such a block is only an orphan, and its
    pod flagged)."""
    if not raw:
        return {}
    try:
        c = _carries_dec.decode(raw)
        if len(c.tokens) != len(eks) or any(not 0 <= i < len(eks) or c.tokens[i] is None for i in c.extras):
            raise ValueError(f"{len(c.tokens)} carries for {len(eks)} blocks")
        tokens = c.tokens
        if c.extends:
            if len(c.extends) != (len(tokens) + 7) >> 3:
                raise ValueError(f"{len(c.extends)} bytes of extensions for {len(tokens)} carries")
            tokens = list(tokens)
            for i, t in enumerate(tokens):
                if c.extends[i >> 3] >> (i & 7) & 1:
                    prev = tokens[i - 1] if i else None
                    if t is None or not prev:
                        raise ValueError(f"carry {i} continues none")
                    tokens[i] = prev + t
    except (msgspec.DecodeError, ValueError) as exc:
        log.warning("pod %s: its state log's carries do not read (%s): left out (a child of a block that ends "
                    "mid request key is an orphan, its pod flagged)", pod_id, exc)
        return {}
    out = {ek: Carry(t) for ek, t in zip(eks, tokens) if t is not None}
    for i, (ids, salt) in c.extras.items():
        out[eks[i]] = Carry(tokens[i], tuple(ids), salt)
    return out


def _columns(state: PodState) -> tuple[list[str], list[str], bytes, bytes, list[int], list[int], bytes,
                                       list[int | None], dict[int, int]]:
    """The snapshot's per-block columns (fields, tiers, engine keys, request keys, counts, codes, chained,
    parents, copies) in Python, a column at a time: each column is one comprehension or one C call (a loop
    over the blocks cost twice as much)."""
    keys = list(state.blocks)
    blocks = list(state.blocks.values())
    n = len(blocks)
    fields = [b.field for b in blocks]
    tiers = [k[1] for k in keys]
    groups = [k[2] for k in keys]
    if n and (max(groups) > 255 or min(groups) < 0):
        raise ValueError("more than 16 tiers or a group past 255: not a state this format holds")
    if len(set(fields)) == 1 and len(set(tiers)) == 1 and len(set(groups)) == 1:  # the usual pod: one code
        field_ids, tier_ids = [fields[0]], [tiers[0]]
        codes = [groups[0] << 4]
    else:
        fids: dict[str, int] = {f: i for i, f in enumerate(dict.fromkeys(fields))}
        tids: dict[str, int] = {t: i for i, t in enumerate(dict.fromkeys(tiers))}
        if len(tids) > 16:
            raise ValueError("more than 16 tiers or a group past 255: not a state this format holds")
        field_ids, tier_ids = list(fids), list(tids)
        codes = _column([fids[f] << 12 | g << 4 | tids[t] for f, t, g in zip(fields, tiers, groups)])
    counts = [len(b.rks) for b in blocks]
    rks = [rk for b in blocks for rk in b.rks]
    parents = [b.parent for b in blocks]
    # a block is chained when its parent is the previous block's last request key (not the chain's root)
    if n and min(counts) > 0:
        lasts = rks[:-1] if len(rks) == n else [b.rks[-1] for b in blocks[:-1]]
    else:
        lasts = [b.rks[-1] if b.rks else None for b in blocks[:-1]]
    flags = [False] + [p == last and p is not None and p != CHAIN_ROOT for p, last in zip(parents[1:], lasts)] \
        if n else []
    return (field_ids, tier_ids, _u64s([k[0] for k in keys]), _u64s(rks), _column(counts), codes, _bits(flags),
            [p for p, chained in zip(parents, flags) if not chained],
            {i: b.copies for i, b in enumerate(blocks) if b.copies > 1})


_BITS = bytes.maketrans(b"\x00\x01", b"01")


def _bits(flags: list[bool]) -> bytes:
    """Flags as a little-endian bit string (flag i is bit i & 7 of byte i >> 3), in C: as binary digits, most
    significant first."""
    if not flags:
        return b""
    return int(bytes(reversed(flags)).translate(_BITS), 2).to_bytes((len(flags) + 7) // 8, "little")


def _u64s(values: list[int]) -> bytes:
    """Packed little-endian u64s (in C when built: struct converts each value the slow way). A value outside
    [0, 2**64) raises struct.error either way (struct says which)."""
    if _pack_u64s is not None:
        try:
            return _pack_u64s(values)
        except (OverflowError, TypeError):
            pass
    return struct.pack(f"<{len(values)}Q", *values)


def _column(values: list[int]) -> list[int]:
    """A per-block column, as one value when every block has it (one block's list reads the same either way)."""
    return values[:1] if values and values.count(values[0]) == len(values) else values


def _per_block(column: list[int], n: int) -> list[int]:
    return column * n if len(column) == 1 else column


def encode_delta(gen: int, mutations: Sequence[Mutation], groups: Mapping[int, GroupSpec] | None,
                 engine_block_size: int | None, carries: Mapping[int, Carry] | None = None) -> bytes:
    """One applied batch as a ``_Delta`` (with its stores' ``carries``, as ``PodState.plan`` was given them: a
    ``_CarriedDelta``). Once per batch on the ingester's hot path: the per-mutation columns come from one C pass
    (``_speedups.delta_columns``, the same bytes) where it is built and the batch is ordinary; anything else (no
    C, a subclass, a key outside uint64, a group outside a byte, more than 16 tiers, ...) goes through
    ``_encode_delta``, the reference, which raises what it raises."""
    carried = _carry_column([carries.get(m.engine_key) for m in mutations if isinstance(m, StoreBlock)]) \
        if carries else None
    if _delta_columns is not None:
        cols = _delta_columns(mutations, *_DELTA_TYPES)
        if cols is not None:
            groups_ = {g: _spec_tuple(s) for g, s in (groups or {}).items()}
            if carried is None:
                return _enc.encode(_Delta(gen, groups_, engine_block_size, *cols))
            return _enc.encode(_CarriedDelta(gen, groups_, engine_block_size, *cols, carried))
    return _encode_delta(gen, mutations, groups, engine_block_size, carried)


def _encode_delta(gen: int, mutations: Sequence[Mutation], groups: Mapping[int, GroupSpec] | None,
                  engine_block_size: int | None, carried: msgspec.Raw | None = None) -> bytes:
    """``encode_delta`` a mutation at a time (the reference for ``_speedups.delta_columns``, and the fallback)."""
    fids: dict[str, int] = {}
    tids: dict[str, int] = {}
    kinds = bytearray()
    eks: list[int] = []
    codes: list[int] = []
    stores: list[StoreBlock] = []
    reasons: list[str] = []
    for m in mutations:
        if isinstance(m, StoreBlock):
            kinds.append(0)
            eks.append(m.engine_key)
            codes.append(fids.setdefault(m.entry_field, len(fids)) << 12 | m.group << 4
                         | tids.setdefault(m.tier, len(tids)))
            stores.append(m)
        elif isinstance(m, RemoveBlock):
            kinds.append(1)
            eks.append(m.engine_key)
            codes.append(m.group << 4 | tids.setdefault(m.tier, len(tids)))
        elif isinstance(m, ClearPod):
            kinds.append(2)
        else:
            kinds.append(3)
            reasons.append(m.reason)
    if len(tids) > 16 or any(not 0 <= m.group <= 255 for m in mutations if isinstance(m, (StoreBlock, RemoveBlock))):
        raise ValueError("more than 16 tiers or a group past 255: not a batch this format holds")
    rks = [rk for m in stores for rk in m.request_keys]
    flags = bytearray((len(stores) + 7) // 8)
    chained = bytearray((len(stores) + 7) // 8)
    parents: list[int | None] = []
    last: int | None = None
    for i, m in enumerate(stores):
        if m.parentless:
            flags[i >> 3] |= 1 << (i & 7)
        if m.parent is not None and m.parent == last and m.parent != CHAIN_ROOT:
            chained[i >> 3] |= 1 << (i & 7)
        else:
            parents.append(m.parent)
        last = m.request_keys[-1] if m.request_keys else None
    return _enc.encode((_Delta if carried is None else _CarriedDelta)(
        gen, {g: _spec_tuple(s) for g, s in (groups or {}).items()}, engine_block_size, list(fids), list(tids),
        bytes(kinds), _u64s(eks), _column(codes), _column([len(m.request_keys) for m in stores]),
        _u64s(rks), bytes(flags), bytes(chained), parents, reasons, *(() if carried is None else (carried,))))


def _mutations(d: _Delta) -> list[Mutation]:
    """The batch's mutations, as ``encode_delta`` was given them."""
    eks = struct.unpack(f"<{len(d.engine_keys) // 8}Q", d.engine_keys)
    rks = struct.unpack(f"<{len(d.request_keys) // 8}Q", d.request_keys)
    n_stores = d.kinds.count(0)
    codes, counts = _per_block(d.codes, len(eks)), _per_block(d.counts, n_stores)
    parents, reasons = iter(d.parents), iter(d.reasons)
    out: list[Mutation] = []
    at = store = op = 0
    last: int | None = None
    for kind in d.kinds:
        if kind == 0:
            own = rks[at:at + counts[store]]
            at += counts[store]
            code = codes[op]
            parent = last if d.chained[store >> 3] >> (store & 7) & 1 else next(parents)
            out.append(StoreBlock(eks[op], d.tiers[code & 15], d.fields[code >> 12], tuple(own), code >> 4 & 255,
                                  bool(d.parentless[store >> 3] >> (store & 7) & 1), parent))
            last = own[-1] if own else None
            store += 1
            op += 1
        elif kind == 1:
            code = codes[op]
            out.append(RemoveBlock(eks[op], d.tiers[code & 15], code >> 4 & 255))
            op += 1
        elif kind == 2:
            out.append(ClearPod())
        else:
            out.append(MarkIncomplete(next(reasons)))
    return out


def restore(snapshot: bytes | None, deltas: Iterable[bytes], pod_id: str | None = None, *,
            reannouncements: bool = False) -> tuple[PodState, int]:
    """The state a snapshot and the deltas after it describe, and the generation it is at (the deltas planned
    again as their writer planned them: ``reannouncements`` as the fleet's ingesters run). ``PodLogError`` for a
    log that does not read, whatever is wrong in it (only its carries may not read alone: ``_read_carries``)."""
    try:
        return _restore(snapshot, deltas, pod_id, reannouncements)
    except (msgspec.DecodeError, struct.error, ValueError, TypeError, IndexError, KeyError, StopIteration,
            OverflowError, RecursionError) as exc:
        raise PodLogError(pod_id, f"{type(exc).__name__}: {exc}") from exc


def _restore(snapshot: bytes | None, deltas: Iterable[bytes], pod_id: str | None,
             reannouncements: bool) -> tuple[PodState, int]:
    st = PodState(pod_id=pod_id)
    st.reannouncements = reannouncements
    gen = 0
    if snapshot:
        snap = _snap_dec.decode(snapshot)
        gen = snap.gen
        st.groups = {int(g): GroupSpec(*t) for g, t in snap.groups.items()}
        st.engine_block_size = snap.engine_block_size
        out = Plan(after=st)
        fields, tiers = snap.fields, snap.tiers
        eks = struct.unpack(f"<{len(snap.engine_keys) // 8}Q", snap.engine_keys)
        rks = struct.unpack(f"<{len(snap.request_keys) // 8}Q", snap.request_keys)
        parents = iter(snap.parents)
        at, last = 0, None
        keys = []
        stores = []
        for i, (ek, n, code) in enumerate(zip(eks, _per_block(snap.counts, len(eks)), _per_block(snap.codes, len(eks)))):
            own = rks[at:at + n]
            at += n
            parent = last if snap.chained[i >> 3] >> (i & 7) & 1 else next(parents)
            key = (ek, tiers[code & 15], code >> 4 & 255)
            keys.append(key)
            stores.append(StoreBlock(ek, key[1], fields[code >> 12], own, key[2], False, parent))
            last = own[-1] if own else None
        # stored as a batch's stores are (in C where built: a pod's load, after a restart or another writer,
        # replays its thousands of blocks)
        plan_blocks = _state._plan_blocks
        done = plan_blocks(st, out, stores, 0, False, _PLAN_TYPES) if plan_blocks is not None else 0
        for m in stores[done:]:
            st._store(m, out)
        for i, copies in snap.copies.items():
            st.blocks[keys[i]].copies = copies
        for ek, rks in snap.deferred:
            st.deferred[ek] = tuple(rks)
            for rk in rks:
                st.waiting.setdefault(rk, set()).add(ek)
        st.carries = _read_carries(snap.carries, [k[0] for k in keys], pod_id)
    for d in sorted((_delta_dec.decode(raw) for raw in deltas), key=lambda d: d.gen):
        if d.gen <= gen:
            continue
        mutations = _mutations(d)
        carries = _read_carries(d.carries, [m.engine_key for m in mutations if isinstance(m, StoreBlock)], pod_id) \
            if d.carries else None
        plan = st.plan(mutations, {int(g): GroupSpec(*t) for g, t in d.groups.items()} or None, carries)
        st = plan.after
        if d.engine_block_size:
            st.engine_block_size = d.engine_block_size
        gen = d.gen
    return st, gen


__all__ = ["PodLogError", "encode_delta", "encode_snapshot", "restore"]
