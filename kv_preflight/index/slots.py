"""Which shard serves each request key of a chain (Valkey Cluster): pure.

A key's slot is CRC16 (XMODEM) of its name mod 16384, or of the part in braces if it has a hash tag;
request keys are llm-d's names (the key's decimal value, no tag). A lookup groups a chain's positions by
the shard serving each slot, through a table (slot -> shard index, built once per slot map): the C
routine ``_speedups.slot_groups`` does it in ~20 ns a key, where the Python twin below (the reference, and
the path without a compiler) takes ~1.5 µs, 3 ms for the 2,048 keys of a 32K-token prompt.
"""
from __future__ import annotations

from binascii import crc_hqx
from collections.abc import Mapping, Sequence

try:
    from kv_preflight import _speedups
except ImportError:  # no compiler at install: the Python path
    _speedups = None

SLOTS = 16384
UNSERVED = 255  # a slot no shard serves now (a table byte)
MAX_SHARDS = 254  # shard indexes fit a byte beside UNSERVED, with room for the "unserved" group


def key_slot(name: str | bytes) -> int:
    """Valkey Cluster's slot of a key name (hash tags honoured)."""
    raw = name.encode() if isinstance(name, str) else name
    start = raw.find(b"{")
    if start != -1:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1:end]
    return crc_hqx(raw, 0) % SLOTS


def slot_table(owner_of: Mapping[int, str]) -> tuple[bytes, list[str]]:
    """(table, shards) from slot -> the name of the primary serving it: table[slot] is that primary's
    index in ``shards``, UNSERVED where no primary serves the slot."""
    shards: list[str] = []
    index: dict[str, int] = {}
    table = bytearray([UNSERVED]) * SLOTS
    for slot, name in owner_of.items():
        at = index.get(name)
        if at is None:
            if len(shards) >= MAX_SHARDS:
                raise ValueError(f"more than {MAX_SHARDS} primaries")
            at = index[name] = len(shards)
            shards.append(name)
        table[slot] = at
    return bytes(table), shards


def canonical_table(table: bytes, shards: Sequence[str]) -> tuple[bytes, tuple[str, ...]]:
    """A ``slot_table`` with its shards in name order (pure): two reads of one slot map compare equal, whichever
    node answered and in whatever order it listed the primaries."""
    order = sorted(range(len(shards)), key=shards.__getitem__)
    recode = bytearray(range(256))
    for new, old in enumerate(order):
        recode[old] = new
    return table.translate(bytes(recode)), tuple(shards[i] for i in order)


def slot_groups(keys: Sequence[int], table: bytes, shards: int, prefix: str = "") -> list[list[int]]:
    """The positions of ``keys`` (request keys; with ``prefix``, keys named ``prefix`` and the value, such as
    ``engine:<ek>``) per shard index, plus a last list of positions whose slot no shard serves:
    ``shards + 1`` lists, each in chain order."""
    if "{" in prefix:
        raise ValueError(f"a prefix with a hash tag routes by the tag, not the value: {prefix!r}")
    if _speedups is not None:
        return _speedups.slot_groups(keys, table, shards + 1, prefix.encode())
    return slot_groups_reference(keys, table, shards, prefix)


def slot_groups_reference(keys: Sequence[int], table: bytes, shards: int, prefix: str = "") -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(shards + 1)]
    for i, k in enumerate(keys):
        at = table[crc_hqx(f"{prefix}{k}".encode(), 0) % SLOTS]
        out[at if at < shards else shards].append(i)
    return out


__all__ = ["MAX_SHARDS", "SLOTS", "UNSERVED", "canonical_table", "key_slot", "slot_groups", "slot_groups_reference", "slot_table"]
