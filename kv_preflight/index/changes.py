"""A plan's changes as changes.lua's arguments (kv_preflight/index/lua/changes.lua): one op per command in the
common case, the general form where an entry and a bit do not move together. Pure; key names from layout.py."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kv_preflight.index.layout import ENGINE_PREFIX, engine_key_name, presence_key
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange


def mine(num: int) -> bytes:
    """A presence value holding pod ``num``'s bit alone, counted once ("1:" then the bitmap; bytes, since a
    str would go out as UTF-8)."""
    return b"1:" + bytes(num // 8) + bytes((1 << (num % 8),))


def key_ops(rk: int, field: str, entry: int, bit: str, bit_delta: int, num: int, own: bytes | None = None,
            *, general: bool = False) -> list[Any]:
    """One request key's change (a KeyChange's fields) as changes.lua ops. ``own``: ``mine(num)``, if made.
    ``general``: always the K form (a pod with sibling data-parallel ranks: changes.lua's ``G``)."""
    if general:
        return ["K", rk, presence_key(rk), field, entry, bit, bit_delta, num // 8 + 1, 1 << (num % 8)]
    if bit and entry == bit_delta and entry:
        value = own if own is not None else mine(num)
        if entry > 0:
            return ["E", rk, field, "B", presence_key(rk), bit, value]
        return ["e", rk, field, "b", presence_key(rk), bit, value]
    if not bit and not bit_delta and entry:
        return ["E" if entry > 0 else "e", rk, field]
    return ["K", rk, presence_key(rk), field, entry, bit, bit_delta, num // 8 + 1, 1 << (num % 8)]


def _one_to_one(c: KeyChange) -> bool:
    """An entry and its bit (or an entry with no bit) that come or go together."""
    return c.entry != 0 and (c.bit_delta == c.entry if c.bit else c.bit_delta == 0)


def change_args(changes: Sequence[Any], num: int | None, sibs: bytes = b"") -> list[Any]:
    """See ``change_args_py`` (the reference): the same, in C for a batch's usual changes (S and R runs, engine
    keys' adds and drops). ``sibs``: the pod's sibling data-parallel ranks' bits (kv_preflight/index/rank_pods.py
    ``family_bits``); with any, the changes go in K form under changes.lua's ``G``."""
    if sibs:
        return ["G", sibs, *change_args_py(changes, num, general=True)]
    if _change_args_c is not None and type(changes) is list:
        done = _change_args_c(changes, mine(num or 0), _CHANGE_TYPES, *_PRESENCE_NAME, ENGINE_PREFIX)
        if done is not None:
            return done
    return change_args_py(changes, num)


def change_args_py(changes: Sequence[Any], num: int | None, *, general: bool = False) -> list[Any]:
    """changes.lua's arguments for a plan's changes, in order: blocks of one request key in runs of S or R ops
    (each block with its engine key's ZADD or ZREM when the plan has it beside), under the F op's field and
    bit. ``general``: every key change in K form (a pod with sibling ranks, see ``change_args``)."""
    n = num or 0
    own = mine(n)
    out: list[Any] = []
    if general:
        for c in changes:
            if isinstance(c, KeyChange):
                out += key_ops(c.rk, c.field, c.entry, c.bit, c.bit_delta, n, own, general=True)
            elif isinstance(c, EngineAdd):
                out += ["z", engine_key_name(c.ek), c.rks[0]] if len(c.rks) == 1 else \
                    ["Z", engine_key_name(c.ek), len(c.rks), *c.rks]
            elif isinstance(c, EngineDrop):
                out += ["x", engine_key_name(c.ek), c.rks[0]] if len(c.rks) == 1 else \
                    ["X", engine_key_name(c.ek), len(c.rks), *c.rks]
        return out
    reg: tuple[str, str] | None = None  # the F op's field and bit name, as last sent
    run_at = -1  # where the count of the last S or R run is
    i, count = 0, len(changes)
    while i < count:
        c = changes[i]
        nxt = changes[i + 1] if i + 1 < count else None
        if isinstance(c, EngineAdd) and len(c.rks) == 1 and isinstance(nxt, KeyChange) and nxt.rk == c.rks[0] \
                and nxt.entry > 0 and _one_to_one(nxt):
            c, ek_key, i = nxt, engine_key_name(c.ek), i + 2
        elif isinstance(c, KeyChange) and _one_to_one(c):
            ek_key = ""
            if c.entry < 0 and isinstance(nxt, EngineDrop) and nxt.rks == (c.rk,):
                ek_key, i = engine_key_name(nxt.ek), i + 2
            else:
                i += 1
        else:
            i += 1
            if isinstance(c, KeyChange):
                out += key_ops(c.rk, c.field, c.entry, c.bit, c.bit_delta, n, own)
            elif isinstance(c, EngineAdd):
                out += ["z", engine_key_name(c.ek), c.rks[0]] if len(c.rks) == 1 else \
                    ["Z", engine_key_name(c.ek), len(c.rks), *c.rks]
            elif isinstance(c, EngineDrop):
                out += ["x", engine_key_name(c.ek), c.rks[0]] if len(c.rks) == 1 else \
                    ["X", engine_key_name(c.ek), len(c.rks), *c.rks]
            continue
        op = "S" if c.entry > 0 else "R"
        if reg != (c.field, c.bit):
            reg = (c.field, c.bit)
            out += ["F", c.field, c.bit, own]
        elif run_at >= 0 and out[run_at - 1] == op and run_at + 1 + 3 * out[run_at] == len(out):
            out[run_at] += 1  # the block joins the run just before it
            out += [c.rk, presence_key(c.rk), ek_key]
            continue
        run_at = len(out) + 1
        out += [op, 1, c.rk, presence_key(c.rk), ek_key]
    return out


class Probe(NamedTuple):
    """A drop's probe of one of its request keys, among a Valkey Cluster shard's key changes: is the key left with
    no entry at this point of the run (``at``: the drop's position among the run's changes)?"""

    rk: int
    at: int


def shard_args(ops: Sequence[Any], whose: Sequence[Any]) -> tuple[list[Any], list[int], dict[int, int]]:
    """See ``shard_args_py`` (the reference): the same, in C for the usual shard's ops (s and r runs, probes)."""
    if _shard_args_c is not None:
        done = _shard_args_c(ops, whose, mine, *_PRESENCE_NAME, _SHARD_TYPES)
        if done is not None:
            return done
    return shard_args_py(ops, whose)


def shard_args_py(ops: Sequence[Any], whose: Sequence[Any]) -> tuple[list[Any], list[int], dict[int, int]]:
    """A Valkey Cluster shard's share of a run's request-key changes (outbox entries' KeyChanges and drops'
    ``Probe``s, in order; ``whose``: per op, its entry, whose ``num`` and ``sibs`` are its pod's bit position and
    sibling ranks' bits) as changes.lua's arguments: an entry and its bit that come or go together in s and r
    runs under F, as a single node's batch sends them in S and R runs but without the engine key a shard never
    gets there (the general form, one op per change, sent each change's field, bit name and value again: most of
    a shard's arguments), the rest as they are. A probe right after its key's removal in an r run is not sent:
    the r block answers it (``folds_probe``). Also, per op the script counts (``lua_op_count``), the index in
    ``ops`` of the change it runs, since a change whose key moved away is named by that position; and per r block
    that answers a probe, its position as the script counts (from 1) -> the probe's index in ``ops``."""
    out: list[Any] = []
    owners: list[int] = []
    folded: dict[int, int] = {}
    reg: tuple[str, str, int] | None = None
    owns: dict[int, bytes] = {}  # num -> mine(num): a run's ops are mostly one pod's
    run_at = -1
    sibs = b""  # the G op's sibling bits, as last sent (a pod with data-parallel ranks)
    for i, op in enumerate(ops):
        if type(op) is Probe:
            if i and folds_probe(ops[i - 1], op, whose[i - 1][1]):
                folded[len(owners)] = i  # the r block just sent (the script's op len(owners), from 1)
                continue
            out += ["q", op.rk, op.at]
            owners.append(i)
            continue
        num, pod_sibs = whose[i][0], whose[i][1]
        if pod_sibs != sibs:
            sibs = pod_sibs
            out += ["G", sibs]
            owners.append(i)
            reg = None
            run_at = -1
        rk, fld, entry, bit, bitdelta = op
        if sibs or not _runs(op):
            part = key_ops(rk, fld, entry, bit, bitdelta, num, general=bool(sibs))
            out += part
            owners += [i] * lua_op_count(part)
            continue
        name = "s" if entry > 0 else "r"
        if reg != (fld, bit, num):
            reg = (fld, bit, num)
            own = owns.get(num)
            if own is None:
                own = owns[num] = mine(num)
            out += ["F", fld, bit, own]
            owners.append(i)
        elif run_at >= 0 and out[run_at - 1] == name and run_at + 1 + 2 * out[run_at] == len(out):
            out[run_at] += 1
            out += [rk, presence_key(rk)]
            owners.append(i)
            continue
        run_at = len(out) + 1
        out += [name, 1, rk, presence_key(rk)]
        owners.append(i)
    return out, owners, folded


try:  # the usual changes' arguments in C (kv_preflight/index/_write_path.c); the Python functions are the reference
    from kv_preflight.index._write_path import change_args as _change_args_c
    from kv_preflight.index._write_path import shard_args as _shard_args_c
except ImportError:  # pragma: no cover - no compiler at install time
    _change_args_c = _shard_args_c = None
_CHANGE_TYPES = (KeyChange, EngineAdd, EngineDrop)
_SHARD_TYPES = (KeyChange, Probe)
_PRESENCE_NAME = tuple(presence_key("\0").split("\0"))  # the presence key's name around its request key


def _runs(c: KeyChange) -> bool:
    """A key change whose entry and bit come or go together (or an entry with no bit): an s or r block."""
    entry, bit, bitdelta = c[2], c[3], c[4]
    return entry != 0 and (bitdelta == entry if bit else bitdelta == 0)


def folds_probe(prev: KeyChange | Probe, probe: Probe, prev_sibs: bytes) -> bool:
    """Whether a drop's probe rides on the change just before it in a shard's ops: the removal of the same key's
    entry in an r block (not a change of a pod with sibling ranks, ``prev_sibs``: those go in the general form),
    whose answer (the key left empty, or not) is the probe's, as nothing runs on that key in between. Saves the
    probe's three arguments, which cost Valkey more than its HLEN."""
    return type(prev) is KeyChange and not prev_sibs and prev[0] == probe.rk and prev[2] < 0 and _runs(prev)


# How many arguments each changes.lua op takes, its name included (S, R, Z and X: by their count)
_ARITY = {"E": 3, "e": 3, "B": 4, "b": 4, "F": 4, "G": 2, "K": 9, "z": 3, "x": 3, "q": 3}


def lua_op_count(args: Sequence[Any]) -> int:
    """How many changes.lua ops a flat argument list holds (the script numbers them, e.g. a moved op)."""
    i = n = 0
    while i < len(args):
        op = args[i]
        if op in _ARITY:
            i += _ARITY[op]
        elif op in ("S", "R", "s", "r"):  # each block of a run is an op of its own
            blocks = int(args[i + 1])
            i += 2 + (3 if op in ("S", "R") else 2) * blocks
            n += blocks - 1
        else:  # Z, X
            i += 3 + int(args[i + 2])
        n += 1
    return n


__all__ = ["Probe", "change_args", "change_args_py", "folds_probe", "key_ops", "lua_op_count", "mine", "shard_args",
           "shard_args_py"]
