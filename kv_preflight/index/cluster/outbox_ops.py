"""What a Valkey Cluster's outbox entry holds, and the pure parts of running it (kv_preflight/index/cluster/writes.py
runs it). An entry is a batch's changes as its plan made them (pod_state.py's ``KeyChange``, ``EngineAdd``,
``EngineDrop``) with the pod's bit position and its sibling ranks' bits once (``OutboxEntry``): the rounds read the
changes themselves, as a single node's script arguments are made from them, so a cluster's batch takes no more
shapes on its way to Valkey than a single node's. Here: an entry to bytes and back (``outbox_payload``;
``decode_entry`` checks every item, as an entry is read from Valkey and anything may be there), a key change as
effects.lua's arguments, and each round's commands (``_run_keys``: round A's key changes and probes;
``_engine_round``: round B's ZADD and ZREM; ``_raced``: round D's re-adds). The per-change loops are in C
(kv_preflight/index/_write_path.c) when built; the Python functions here are their reference
(tests/unit/test_cluster_run_ops.py holds them equal)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from redis.exceptions import ResponseError

from kv_preflight.index.changes import Probe
from kv_preflight.index.changes import key_ops as lua_key_ops
from kv_preflight.index.layout import ENGINE_PREFIX, engine_key_name
from kv_preflight.index.pod_state import Change, EngineAdd, EngineDrop, KeyChange

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
try:  # a run's per-change loops in C (kv_preflight/index/_write_path.c); the Python functions here are their reference
    from kv_preflight.index import _write_path as _c
except ImportError:  # pragma: no cover - no compiler at install time
    _c = None
_TYPES = (KeyChange, EngineAdd, EngineDrop, Probe)
_U64 = 2**64
MAX_NUM = 2**24  # no pod's bit position (its presence value alone would be 2 MB): an entry naming one is malformed


class OutboxEntry(NamedTuple):
    """An outbox entry: a batch's changes to the keys every pod shares, as its plan made them, and what they need
    of the pod, once: its bit position (``num``) and its sibling data-parallel ranks' bits (``sibs``,
    kv_preflight/index/rank_pods.py ``family_bits``; b"" for a pod without: changes.lua's ``G``)."""

    num: int
    sibs: bytes
    changes: Sequence[Change]


def outbox_payload(entry: OutboxEntry) -> bytes:
    """The entry as its pod step stores it, msgpack ``[num, sibs, changes, drops]``: each change the array of its
    fields (a KeyChange's five; an engine key's add or drop: ``[ek, [rks]]``) and ``drops`` the positions of the
    drops among them, since an add and a drop have the same fields."""
    changes = entry.changes
    return _enc.encode((entry.num, entry.sibs, changes, [j for j, c in enumerate(changes) if type(c) is EngineDrop]))


def _is_key(x: Any) -> bool:
    """A request key or an engine key: a uint64 (llm-d's; msgpack decodes an int as exactly int, a bool as bool)."""
    return type(x) is int and 0 <= x < _U64


def _entry(raw: Any) -> OutboxEntry | None:
    """A decoded payload as the OutboxEntry ``outbox_payload`` wrote, every item checked; None for anything else (a
    hand edit, a bug, a previous build's entry: a list of ops, ``["K", rk, ...]``)."""
    if not (type(raw) is list and len(raw) == 4 and type(raw[0]) is int and 0 <= raw[0] < MAX_NUM
            and type(raw[1]) is bytes and len(raw[1]) <= MAX_NUM // 8 and type(raw[2]) is list
            and type(raw[3]) is list and all(type(j) is int for j in raw[3])):
        return None
    num, sibs, items, drops = raw
    dropped = set(drops)
    changes: list[Change] = []
    for j, c in enumerate(items):
        if type(c) is list and len(c) == 5 and _is_key(c[0]) and type(c[1]) is str and type(c[2]) is int \
                and type(c[3]) is str and type(c[4]) is int:
            changes.append(KeyChange(*c))
        elif type(c) is list and len(c) == 2 and _is_key(c[0]) and type(c[1]) is list and c[1] \
                and all(_is_key(rk) for rk in c[1]):
            changes.append((EngineDrop if j in dropped else EngineAdd)(c[0], tuple(c[1])))
        else:
            return None
    # the drops' positions exactly as written: each on an engine key's change, once, in order
    return OutboxEntry(num, sibs, changes) if [j for j, c in enumerate(changes) if type(c) is EngineDrop] == drops \
        else None


def decode_entry(field: bytes, payload: bytes) -> tuple[int, OutboxEntry] | None:
    """An outbox entry's order number and content, or None when either is malformed (the field is
    "<n>|<writer>|<ms>", both numbers decimal)."""
    parts = field.split(b"|", 2)
    entry = read_payload(payload) if len(parts) == 3 and parts[2].isdigit() else None
    try:
        return None if entry is None else (int(parts[0]), entry)
    except ValueError:
        return None


def read_payload(payload: bytes) -> OutboxEntry | None:
    """An outbox entry's content, or None when it is malformed."""
    try:
        return _entry(_dec.decode(payload))
    except msgspec.DecodeError:
        return None


def key_op_args(op: KeyChange | Probe, pod: Sequence[Any]) -> list[Any]:
    """A key change of an entry, or a drop's probe of one request key, as effects.lua's arguments (changes.lua's
    ops for it); ``pod``: the change's entry (its pod's bit position and sibling bits)."""
    if type(op) is Probe:
        return ["q", op.rk, op.at]
    if pod[1]:  # a rank of a pod with data-parallel ranks: its siblings' bits first
        return ["G", pod[1], *lua_key_ops(*op, pod[0], general=True)]
    return lua_key_ops(*op, pod[0])


def _native(name: str, *args: Any) -> Any:
    """``_write_path.<name>(*args, types)``, a C twin of a function below; None when it is not built, or when it
    leaves the input to the Python reference (anything but the usual shapes)."""
    return None if _c is None else getattr(_c, name)(*args, _TYPES)


def _run_keys(entries: Sequence[OutboxEntry]) -> tuple[list[KeyChange | Probe], list[OutboxEntry], list[int]]:
    """``run``'s first pass (the reference of ``_write_path.run_keys``), over the entries' changes in order (``j``
    counts them across the entries): the key changes as they are and a ``Probe(rk, j)`` per distinct request key
    of each engine key's drop; per such op, the entry it came from (its pod); the key changes' request keys."""
    key_ops: list[KeyChange | Probe] = []
    whose: list[OutboxEntry] = []
    rk_changes: list[int] = []
    j = 0
    for entry in entries:
        for c in entry.changes:
            kind = type(c)  # the three NamedTuples, exactly (a hot loop: one type test, not isinstance's chain)
            if kind is KeyChange:
                key_ops.append(c)
                whose.append(entry)
                rk_changes.append(c[0])
            elif kind is EngineDrop:
                rks = c[1]
                for rk in rks if len(rks) == 1 else set(rks):
                    key_ops.append(Probe(rk, j))
                    whose.append(entry)
            j += 1
    return key_ops, whose, rk_changes


def _engine_round(changes: Sequence[Change], empty_at: dict[int, int]) -> \
        tuple[list[tuple[Any, ...]], list[int], list[tuple[int, EngineDrop]]]:
    """``run``'s round B (the reference of ``_write_path.engine_round``) over a run's changes: per add its ZADD,
    per drop whose every distinct request key was empty where it stands its ZREM; the engine keys, the drops
    (j, drop)."""
    round_b: list[tuple[Any, ...]] = []
    round_b_eks: list[int] = []
    drops: list[tuple[int, EngineDrop]] = []
    prefix = ENGINE_PREFIX
    for j, c in enumerate(changes):
        kind = type(c)
        if kind is EngineAdd:
            ek, rks = c
            round_b.append(("ZADD", prefix + str(ek), 0, rks[0]) if len(rks) == 1 else _engine_add(ek, rks))
            round_b_eks.append(ek)
        elif kind is EngineDrop:
            ek, rks = c
            if empty_at.get(j, 0) == (1 if len(rks) == 1 else len(set(rks))):
                drops.append((j, c))
                round_b.append(("ZREM", prefix + str(ek), *rks))
                round_b_eks.append(ek)
    return round_b, round_b_eks, drops


def _raced(changes: Sequence[Change], drops: Sequence[tuple[int, EngineDrop]], back: set[int]) -> \
        list[tuple[int, EngineDrop]]:
    """Round D (the reference of ``_write_path.raced``): the drops one of whose request keys holds an entry
    again (``back``) that no store of this run after the drop explains: another writer raced the ZREM."""
    stored_at: dict[int, int] = {}
    for j, c in enumerate(changes):
        if type(c) is KeyChange and c.rk in back and c.entry > 0:
            stored_at[c.rk] = j
    return [(j, d) for j, d in drops if any(rk in back and stored_at.get(rk, -1) < j for rk in d.rks)]


def _engine_add(ek: int, rks: Sequence[int]) -> tuple[Any, ...]:
    """``engine:<ek>`` gains a block's request keys at their positions (llm-d's ZSET): the ZADD."""
    return ("ZADD", engine_key_name(ek), *(x for pos, rk in enumerate(rks) for x in (pos, rk)))


def _foreign(replies: Sequence[Any]) -> tuple[int, str]:
    """Plain commands' replies: how many hit a key of a foreign type, the first error; others raise."""
    if not any(issubclass(t, Exception) for t in set(map(type, replies))):
        return 0, ""  # the usual replies (a type test per kind, not per engine block)
    n, first = 0, ""
    for r in replies:
        if isinstance(r, ResponseError) and str(r).startswith("WRONGTYPE"):
            n += 1
            first = first or str(r)[:120]
        elif isinstance(r, Exception):
            raise r
    return n, first


__all__ = ["ENGINE_PREFIX", "MAX_NUM", "OutboxEntry", "decode_entry", "key_op_args", "outbox_payload", "read_payload"]
