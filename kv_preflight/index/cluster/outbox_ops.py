"""What a Valkey Cluster's outbox entry holds, and the pure parts of running it (kv_preflight/index/cluster/writes.py
runs it): a plan's changes as the entry's ops and back (``change_ops``, ``decode_entry``, checked op by op: an
entry is read from Valkey, so anything may be there), a K op as effects.lua's arguments, and each round's
commands from the ops (``_run_keys``: round A's keys and probes; ``_engine_round``: round B's ZADD and ZREM;
``_raced``: round D's re-adds). The per-op loops are in C (kv_preflight/index/_write_path.c) when built; the Python
functions here are their reference (tests/unit/test_cluster_run_ops.py holds them equal)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from kv_preflight.index.changes import key_ops as lua_key_ops
from kv_preflight.index.layout import ENGINE_PREFIX, engine_key_name
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange

_dec = msgspec.msgpack.Decoder()
try:  # a run's per-op loops in C (kv_preflight/index/_write_path.c); the Python functions here are their reference
    from kv_preflight.index import _write_path as _c
except ImportError:  # pragma: no cover - no compiler at install time
    _c = None
_CHANGE_TYPES = (KeyChange, EngineAdd, EngineDrop)


def change_ops(changes: Sequence[Any], num: int | None, sibs: bytes = b"") -> list[Any]:
    """A plan's changes as the outbox entry's ops (what ``decode_entry`` gives back), self-contained (the pod's
    bit position included) so any ingester can run them again: ``change_ops_py``, in C when built. ``sibs``: the pod's sibling data-parallel ranks' bits (kv_preflight/index/rank_pods.py), carried
    by each K op as a ninth item (changes.py ``shard_args`` sends them as changes.lua's ``G``)."""
    if sibs:
        return [op + [sibs] if op[0] == "K" else op for op in change_ops_py(changes, num)]
    if _c is not None and type(changes) is list:
        n = num or 0
        done = _c.change_ops(changes, n // 8 + 1, 1 << (n % 8), _CHANGE_TYPES)
        if done is not None:
            return done
    return change_ops_py(changes, num)


def change_ops_py(changes: Sequence[Any], num: int | None) -> list[Any]:
    """The reference of ``change_ops``."""
    flat: list[Any] = []
    n = num or 0
    byte, mask = n // 8 + 1, 1 << (n % 8)
    for c in changes:
        kind = type(c)  # the three NamedTuples, exactly (a hot loop: one type test, not isinstance's chain)
        if kind is KeyChange:
            rk, fld, entry, bit, bit_delta = c
            flat.append(["K", rk, fld, entry, bit, bit_delta, byte, mask])
        elif kind is EngineAdd:
            flat.append(["Z", c.ek, list(c.rks)])
        elif kind is EngineDrop:
            flat.append(["X", c.ek, list(c.rks)])
    return flat


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _valid_op(op: Any) -> bool:
    """The three shapes ``change_ops`` writes; anything else (a hand edit, a bug, an older build's
    entry) must not reach the scripts."""
    if not isinstance(op, list) or not op:
        return False
    if op[0] == "K":
        return (len(op) in (8, 9) and _is_int(op[1]) and isinstance(op[2], str) and _is_int(op[3])
                and isinstance(op[4], str) and all(_is_int(x) for x in op[5:8])
                and (len(op) == 8 or isinstance(op[8], bytes)))
    if op[0] in ("Z", "X"):
        return len(op) == 3 and _is_int(op[1]) and isinstance(op[2], list) and all(_is_int(x) for x in op[2])
    return False


def decode_entry(field: bytes, payload: bytes) -> tuple[int, list[Any]] | None:
    """An outbox entry's order number and changes, or None when either is malformed (the field is
    "<n>|<writer>|<ms>", both numbers decimal)."""
    try:
        parts = field.split(b"|", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            return None
        n = int(parts[0])
        ops = _dec.decode(payload)
    except (ValueError, msgspec.DecodeError):
        return None
    if not isinstance(ops, list) or not all(_valid_op(op) for op in ops):
        return None
    return n, ops


def key_op_args(op: Sequence[Any]) -> list[Any]:
    """An outbox K change, or a drop's probe of one request key ("Q", rk, position), as effects.lua's
    arguments (changes.lua's ops for it)."""
    if op[0] == "Q":
        return ["q", op[1], op[2]]
    _, rk, fld, entry, bit, bitdelta, byte, mask = op[:8]
    num = (byte - 1) * 8 + mask.bit_length() - 1
    if len(op) > 8 and op[8]:  # a rank of a pod with data-parallel ranks: its siblings' bits first
        return ["G", op[8], *lua_key_ops(rk, fld, entry, bit, bitdelta, num, general=True)]
    return lua_key_ops(rk, fld, entry, bit, bitdelta, num)


def _native(name: str, *args: Any) -> Any:
    """``_write_path.<name>(*args)``, a C twin of a function below; None when it is not built, or when it
    leaves the input to the Python reference (anything but the usual shapes)."""
    return None if _c is None else getattr(_c, name)(*args)


def _run_keys(ops: Sequence[Sequence[Any]]) -> tuple[list[Sequence[Any]], list[int]]:
    """``run``'s first pass (the reference of ``_write_path.run_keys``): the K changes as they are and a probe
    ("Q", rk, j) per distinct request key of each engine key's drop, in order; the K changes' request keys."""
    key_ops: list[Sequence[Any]] = []
    rk_changes: list[int] = []
    for j, op in enumerate(ops):
        kind = op[0]
        if kind == "K":
            key_ops.append(op)
            rk_changes.append(op[1])
        elif kind == "X":
            rks = op[2]
            if len(rks) == 1:
                key_ops.append(("Q", rks[0], j))
            else:
                key_ops += [("Q", rk, j) for rk in set(rks)]
    return key_ops, rk_changes


def _engine_round(ops: Sequence[Sequence[Any]], empty_at: dict[int, int]) -> \
        tuple[list[tuple[Any, ...]], list[int], list[tuple[int, Sequence[Any]]]]:
    """``run``'s round B (the reference of ``_write_path.engine_round``): per add its ZADD, per drop whose
    every distinct request key was empty where it stands its ZREM; the engine keys, the drops (j, op)."""
    round_b: list[tuple[Any, ...]] = []
    round_b_eks: list[int] = []
    drops: list[tuple[int, Sequence[Any]]] = []
    prefix = ENGINE_PREFIX
    for j, op in enumerate(ops):
        kind = op[0]
        if kind == "Z":
            ek, rks = op[1], op[2]
            round_b.append(("ZADD", prefix + str(ek), 0, rks[0]) if len(rks) == 1 else _engine_add(ek, rks))
            round_b_eks.append(ek)
        elif kind == "X":
            rks = op[2]
            if empty_at.get(j, 0) == (1 if len(rks) == 1 else len(set(rks))):
                drops.append((j, op))
                round_b.append(("ZREM", prefix + str(op[1]), *rks))
                round_b_eks.append(op[1])
    return round_b, round_b_eks, drops


def _raced(ops: Sequence[Sequence[Any]], drops: Sequence[tuple[int, Sequence[Any]]], back: set[int]) -> \
        list[tuple[int, Sequence[Any]]]:
    """Round D (the reference of ``_write_path.raced``): the drops one of whose request keys holds an entry
    again (``back``) that no store of this run after the drop explains: another writer raced the ZREM."""
    stored_at: dict[int, int] = {}
    for j, op in enumerate(ops):
        if op[0] == "K" and op[1] in back and op[3] > 0:
            stored_at[op[1]] = j
    return [(j, op) for j, op in drops if any(rk in back and stored_at.get(rk, -1) < j for rk in op[2])]


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


__all__ = ["ENGINE_PREFIX", "change_ops", "change_ops_py", "decode_entry", "key_op_args"]
