"""A plan's changes as changes.lua's arguments (kv_preflight/index/lua/changes.lua): one op per command in the
common case, the general form where an entry and a bit do not move together. Pure; key names from layout.py."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kv_preflight.index.layout import engine_key_name, presence_key
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange


def mine(num: int) -> bytes:
    """A presence value holding pod ``num``'s bit alone, counted once ("1:" then the bitmap; bytes, since a
    str would go out as UTF-8)."""
    return b"1:" + bytes(num // 8) + bytes((1 << (num % 8),))


def key_ops(rk: int, field: str, entry: int, bit: str, bit_delta: int, num: int, own: bytes | None = None) -> list[Any]:
    """One request key's change (a KeyChange's fields) as changes.lua ops. ``own``: ``mine(num)``, if made."""
    if bit and entry == bit_delta and entry:
        value = own if own is not None else mine(num)
        if entry > 0:
            return ["E", rk, field, "B", presence_key(rk), bit, value]
        return ["e", rk, field, "b", presence_key(rk), bit, value]
    if not bit and not bit_delta and entry:
        return ["E" if entry > 0 else "e", rk, field]
    return ["K", rk, presence_key(rk), field, entry, bit, bit_delta, num // 8 + 1, 1 << (num % 8)]


def change_args(changes: Sequence[Any], num: int | None) -> list[Any]:
    """changes.lua's arguments for a plan's changes, in order."""
    n = num or 0
    own = mine(n)
    out: list[Any] = []
    for c in changes:
        if isinstance(c, KeyChange):
            out += key_ops(c.rk, c.field, c.entry, c.bit, c.bit_delta, n, own)
        elif isinstance(c, EngineAdd):
            out += ["Z", engine_key_name(c.ek), len(c.rks), *c.rks]
        elif isinstance(c, EngineDrop):
            out += ["X", engine_key_name(c.ek), len(c.rks), *c.rks]
    return out


__all__ = ["change_args", "key_ops", "mine"]
