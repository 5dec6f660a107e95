"""Per pod, its prefix of a chain from the chain keys' pod bitmaps (pure but for ``read_group_bits``; layout 4).

Each request key has, per tier, a bitmap of the pods holding it in their prefix group (``kvpf:{<rk>}``,
field ``<tier>``, written with the key's entries: kv_preflight/index/lua/changes.lua), and for a hybrid model's
other KV cache groups one per tier and group (field ``<tier>|<group>``: ``GroupBits``, which the engine's rule
reads, kv_preflight/engines/hit_rules.py). lookup_bits.lua answers in one of two ways (``BitsReply``):
where many pods hold the chain's first key, every key's bitmaps, which ``prefix_from_bits`` walks here
exactly as the linear walk over llm-d's entries does (``entries.longest_prefix``: the keys a pod holds
from the first, up to the first it lacks, its tier at the last one gpu first): a running AND of integers,
so a fleet-wide prefix held by 1,000 pods costs 125 bytes a key to read and a few integer operations a
key to walk, rather than a probe per pod and key; where few pods do, per pod its count, bisected there.
``read_group_bits`` reads keys' presence hashes whole, for a hybrid model's other groups (through a backend)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from kv_preflight.index.entries import DEFAULT_TIER, PodMatch, better_tier
from kv_preflight.index.layout import presence_key

try:
    from kv_preflight import _speedups
except ImportError:  # no compiler at install: the walk below does it all
    _speedups = None

TierBits = Mapping[str, bytes]  # tier -> bitmap, one request key's
# A pod's tier along the keys a shard walked it on, where it changes: (tier, keys held through it) per run
TierRuns = tuple[tuple[str, int], ...]
# Pod numbers -> pods, for the numbers given under a numbering's epoch ("": not known); the callee reads
# its map again if a number is unknown or the epoch is not the one its names were read under.
# (the numbers as an iterable, or as one bitmap: an int).
NamesFor = Callable[[Iterable[int] | int, str], Awaitable[Mapping[int, str]]]


class ReadsCommands(Protocol):
    """What ``read_group_bits`` reads through: a backend (kv_preflight/index/backend.py ``read_commands``)."""

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]: ...


_TIER_NAMES = {b"gpu": "gpu", b"cpu": "cpu", b"disk": "disk"}  # decoded once, not once per key
# A key's bitmaps of a hybrid model's other groups: (tier, group) -> bitmap
GroupBits = Mapping[tuple[str, int], bytes]


def _name(raw: bytes | str) -> str:
    return raw if isinstance(raw, str) else _TIER_NAMES.get(raw) or raw.decode()


def presence_value(raw: bytes | str) -> tuple[int, bytes]:
    """A presence hash's value ``<n>:<bitmap>`` as (n, bitmap)."""
    b = raw if isinstance(raw, bytes) else raw.encode("latin-1")
    head, _, bitmap = b.partition(b":")
    return (int(head) if head.isdigit() else 0), bitmap


def bits_of(flat: Sequence[bytes | str]) -> dict[str, bytes]:
    """One key's prefix-group bitmaps from a flat field list (field, bitmap, ...: values already stripped
    of their counts) as tier -> bitmap; a hybrid model's other groups' fields are left out."""
    out = {}
    for i in range(0, len(flat) - 1, 2):
        name = _name(flat[i])
        if "|" not in name:
            out[name] = flat[i + 1]
    return out


def group_bits_of(flat: Sequence[bytes | str]) -> dict[tuple[str, int], bytes]:
    """One key's other-group bitmaps from the same flat list: (tier, group) -> bitmap."""
    out = {}
    for i in range(0, len(flat) - 1, 2):
        name = _name(flat[i])
        if "|" in name:
            tier, _, g = name.partition("|")
            if g.isdigit():
                out[(tier, int(g))] = flat[i + 1]
    return out


def split_fields(flat: Sequence[bytes | str]) -> tuple[dict[str, bytes], dict[tuple[str, int], bytes]]:
    """``bits_of`` and ``group_bits_of`` of one key's flat field list in one pass (a hybrid pod's keys have
    both kinds of field, and a fleet-wide reply has one list per key)."""
    tiers: dict[str, bytes] = {}
    groups: dict[tuple[str, int], bytes] = {}
    for i in range(0, len(flat) - 1, 2):
        name = _name(flat[i])
        if "|" not in name:
            tiers[name] = flat[i + 1]
        else:
            tier, _, g = name.partition("|")
            if g.isdigit():
                groups[(tier, int(g))] = flat[i + 1]
    return tiers, groups


@dataclass(frozen=True)
class BitsReply:
    """lookup_bits.lua's reply: ``kind`` 0, every key's bitmaps (``reads``, from the first key, to the
    first key nobody holds); 1, per pod (number, keys held from the first, tier) (``counts``); 2, a key
    read holds entries that are not ours: walk llm-d's entries instead. ``epoch``: the pod numbering's
    (empty where its slot is on another node), so names read under an earlier numbering are read again.
    ``walked``: pods walked key by key rather than bisected (their orphan count not known to be 0).
    ``runs``: a cluster shard's walk ("w:"), per walked pod whose tier changes along its keys there, its
    tier runs (``counts`` then gives its tier at the last key). ``flat``: kind 0 where every key has one
    tier or none, each key's tier name and bitmap as two lists straight from the reply (``one_tier_reads``);
    ``reads`` is then built only when asked for (a fleet-wide prefix walks ``flat`` in C)."""

    foreign: int
    moved: bool
    kind: int
    epoch: str
    counts: list[tuple[int, int, str]]
    walked: int = 0
    runs: dict[int, TierRuns] = field(default_factory=dict)
    flat: tuple[list[bytes | str], list[bytes]] | None = None
    parsed: list[dict[str, bytes]] | None = None  # kind 0 with a key of several fields: ``reads``
    groups: list[dict[tuple[str, int], bytes]] | None = None  # kind 0: each key's other-group bitmaps

    @cached_property
    def reads(self) -> list[dict[str, bytes]]:
        if self.parsed is not None:
            return self.parsed
        if self.flat is not None:
            return [{_name(t): b} if t else {} for t, b in zip(*self.flat)]
        return []


def _str(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def parse_bits_reply(reply: Sequence[Any]) -> BitsReply:
    foreign, moved, kind, epoch = int(reply[0]), bool(int(reply[1])), int(reply[2]), _str(reply[3])
    walked = int(reply[4])
    if kind == 0:
        flat = one_tier_reads(reply)
        if flat is not None:
            return BitsReply(foreign, moved, 0, epoch, [], flat=flat)
        reads = []
        groups = []
        for i in range(5, len(reply) - 1, 2):
            name, bits = reply[i], reply[i + 1]
            if isinstance(name, list):  # several fields: the key's flat hash
                tiers, other = split_fields(name)
                reads.append(tiers)
                groups.append(other)
            else:
                reads.append(bits_of([name, bits]) if name else {})
                groups.append(group_bits_of([name, bits]) if name else {})
        return BitsReply(foreign, moved, 0, epoch, [], parsed=reads,
                         groups=groups if any(groups) else None)
    counts = []
    runs: dict[int, TierRuns] = {}
    for i in range(5, len(reply) - 2, 3):
        num, held, tier = int(reply[i]), int(reply[i + 1]), reply[i + 2]
        if isinstance(tier, list):  # a walked pod's runs: tier, keys held through it, ...
            runs[num] = tuple((_name(tier[j]), int(tier[j + 1])) for j in range(0, len(tier) - 1, 2))
            tier = runs[num][-1][0]
        counts.append((num, held, _name(tier)))
    return BitsReply(foreign, moved, kind, epoch, counts, walked, runs)


def tier_in_runs(runs: TierRuns, j: int) -> str:
    """A pod's tier at the ``j``-th key (from 0) a shard holds it on, from its runs there."""
    for tier, through in runs:
        if j < through:
            return tier
    return runs[-1][0]


def tier_in(bits: Mapping[str, bytes | int], num: int) -> str | None:
    """Pod ``num``'s tier at one key from its bitmaps (gpu where it holds it there, else the first other
    tier by name: entries.better_tier's rule), None where it does not hold it."""
    best = None
    for tier, bitmap in bits.items():
        if as_int(bitmap) >> num & 1 and better_tier(tier, best):
            best = tier
    return best


def numbers_in(bits: Mapping[str, bytes | int]) -> list[int]:
    """Every pod number with a bit in one key's bitmaps."""
    return numbers(mask_of(bits))


def mask_of(bits: Mapping[str, bytes | int]) -> int:
    """One key's bitmaps, every tier's ORed, as an int."""
    mask = 0
    for b in bits.values():
        mask |= as_int(b)
    return mask


def as_int(bitmap: bytes | int) -> int:
    return bitmap if isinstance(bitmap, int) else int.from_bytes(bitmap, "little")


_BYTE_BITS = [tuple(b for b in range(8) if v >> b & 1) for v in range(256)]


def numbers(mask: int) -> list[int]:
    """The set bits of ``mask``, lowest first (many: a byte at a time; a 1,000-bit mask is 125 bytes)."""
    out: list[int] = []
    if mask <= 0:
        return out
    if mask.bit_count() < 16:  # a few pods (a key where some stop): one step per pod
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out
    for at, byte in enumerate(mask.to_bytes((mask.bit_length() + 7) // 8, "little")):
        if byte:
            base = 8 * at
            out.extend(base + b for b in _BYTE_BITS[byte])
    return out


def _tiers_at(bits: Mapping[str, int], stopped: int) -> dict[str, int]:
    """The stopped pods by their tier at the key they last held: gpu where they hold it there, else the
    first other tier by name (entries.better_tier's rule)."""
    if len(bits) == 1:
        ((tier, b),) = bits.items()
        return {tier: stopped & b}
    out: dict[str, int] = {}
    left = stopped
    for tier in sorted(bits, key=lambda t: (t != DEFAULT_TIER, t)):
        here = left & bits[tier]
        if here:
            out[tier] = here
            left &= ~here
    return out


def _as_dict(names: Mapping[int, str]) -> dict[int, str]:
    return names if type(names) is dict else dict(names)


def one_tier_reads(reply: Sequence[Any]) -> tuple[list[bytes | str], list[bytes]] | None:
    """A many-pods reply (kind 0) whose every key has at most one tier, as two lists straight from the
    reply: each key's tier name ("" where nobody holds it) and its bitmap (b""); None for any other reply.
    The single node's fleet-wide prefix reads these without a dict per key (``prefix_of_one_tier``)."""
    if _speedups is None or len(reply) < 6 or int(reply[2]) != 0:
        return None
    tiers = reply[5::2]
    if list in map(type, tiers):  # a key with several fields sent its flat hash
        return None
    if any(b"|" in t if isinstance(t, bytes) else "|" in t for t in tiers):  # a hybrid model's other group
        return None
    maps = reply[6::2]
    if len(maps) != len(tiers) or not all(type(b) is bytes for b in maps):
        return None
    return tiers, maps


def one_tier_of_reads(reads: Sequence[Mapping[str, bytes]]) -> tuple[list[bytes | str], list[bytes]] | None:
    """Parsed per-key tier bitmaps as ``one_tier_reads``'s two lists when every key has at most one tier: a
    hybrid model's fleet-wide reply, its other groups' fields set apart, walks in C as a plain one's does."""
    if _speedups is None or any(len(r) > 1 for r in reads):
        return None
    tiers: list[bytes | str] = [next(iter(r)) if r else "" for r in reads]
    maps = [next(iter(r.values())) if r else b"" for r in reads]
    if not all(type(b) is bytes for b in maps):
        return None
    return tiers, maps


def prefix_of_one_tier(tiers: Sequence[bytes | str], maps: Sequence[bytes], names: Mapping[int, str],
                       cut: int | None = None) -> list[PodMatch]:
    """``prefix_from_bits`` over ``one_tier_reads``'s lists (every pod), the walk in C; ``cut`` as there."""
    end = len(maps) if cut is None else min(cut, len(maps))
    tier_at = [_name(t) if t else DEFAULT_TIER for t in tiers[:end]]
    return _speedups.prefix_matches(maps, end, _as_dict(names), tier_at, PodMatch)


def chain_of_one_tier(n: int, parts: Iterable[tuple[Sequence[int], tuple[Sequence[bytes | str], Sequence[bytes]]]]
                      ) -> tuple[list[bytes | str], list[bytes]]:
    """Cluster shards' ``flat`` answers (their chain positions, their keys' tier names and bitmaps) put
    back in chain order as the two lists of an ``n``-key chain; a key no shard sent reads as held by
    nobody (it lies past the first key nobody holds on its shard, where every prefix has ended)."""
    tiers: list[bytes | str] = [b""] * n
    maps: list[bytes] = [b""] * n
    for idx, (names, bitmaps) in parts:
        for i, name, bits in zip(idx, names, bitmaps):
            tiers[i] = name
            maps[i] = bits
    return tiers, maps


def chain_group_bits(parts: Iterable[tuple[Sequence[int], Sequence[GroupBits]]], longest: int
                     ) -> list[dict[tuple[str, int], bytes]]:
    """A cluster's other-group bitmaps (a hybrid model's: ``BitsReply.groups`` per shard, each on its keys'
    chain positions, ascending) put back in chain order, the chain's first ``longest`` keys: the longest prefix
    any pod has in its prefix group, past which no group's rule reads (it bounds each pod's hit). A key no part
    gives reads as held by no other group (a shard sends every key up to its first key nobody holds, so every
    key before ``longest`` that has such bitmaps is given). Each key's mapping is its own (a caller may keep it)."""
    out: list[dict[tuple[str, int], bytes]] = [{} for _ in range(longest)]
    for idx, groups in parts:
        for i, bits in zip(idx, groups):
            if i >= longest:
                break
            if bits:
                out[i] = dict(bits)
    return out


def prefix_from_bits(per_key: Sequence[Mapping[str, bytes | int] | None], names: Mapping[int, str],
                     wanted: Mapping[int, str] | None = None, cut: int | None = None) -> list[PodMatch]:
    """Per pod, how many leading keys of the chain it holds, from each key's bitmaps in chain order.

    ``per_key``: position -> tier -> bitmap (None or empty: nobody holds it; positions past the end
    count as empty too); ``names``: pod number -> pod; ``wanted``: the same, only the pods asked for
    (None: every pod); ``cut``: the first position that was not read (a shard down), where every
    prefix stops (counts are then lower bounds). Bits of numbers with no name are ignored.
    """
    end = len(per_key) if cut is None else min(cut, len(per_key))
    if _speedups is not None and wanted is None:
        one = _one_tier(per_key, end)
        if one is not None:  # the common case, in C: the per-pod part of a prefix a whole fleet holds
            maps, tier_at = one
            return _speedups.prefix_matches(maps, end, _as_dict(names), tier_at, PodMatch)
    alive = -1  # every pod, until key 1 says which
    if wanted is not None:
        alive = 0
        for n in wanted:
            alive |= 1 << n
    last_bits: dict[str, int] = {}
    out: list[PodMatch] = []
    add = out.append
    name_of = names.get

    def emit(mask: int, held: int) -> None:
        for tier, part in _tiers_at(last_bits, mask).items():
            for n in numbers(part):
                pod = name_of(n)
                if pod is not None:
                    add(PodMatch(pod, held, tier))

    for i in range(end):
        tiers = per_key[i]
        if not tiers:
            bits, present = {}, 0
        elif len(tiers) == 1:  # one tier (the common case): no per-tier loop
            ((tier, raw),) = tiers.items()
            present = raw if isinstance(raw, int) else int.from_bytes(raw, "little")
            bits = {tier: present}
        else:
            bits = {t: as_int(b) for t, b in tiers.items()}
            present = 0
            for b in bits.values():
                present |= b
        if i > 0:
            stopped = alive & ~present
            if stopped:
                emit(stopped, i)
        alive &= present
        if not alive:
            return out
        last_bits = bits
    if end > 0:
        emit(alive, end)
    return out


def _one_tier(per_key: Sequence[Mapping[str, bytes | int] | None], end: int
              ) -> tuple[list[bytes | None], list[str]] | None:
    """Each key's one bitmap and its tier, where every key up to ``end`` has at most one tier given as
    bytes (else None: the general walk)."""
    maps: list[bytes | None] = []
    tiers: list[str] = []
    for i in range(end):
        bits = per_key[i]
        if not bits:
            maps.append(None)
            tiers.append(DEFAULT_TIER)
        elif len(bits) == 1:
            ((tier, raw),) = bits.items()
            if not isinstance(raw, bytes):
                return None
            maps.append(raw)
            tiers.append(tier)
        else:
            return None
    return maps, tiers


async def read_group_bits(backend: ReadsCommands, request_keys: Sequence[int]) -> list[GroupBits]:
    """Each request key's other-group bitmaps ((tier, group) -> bitmap, counts stripped), read from its presence
    hash: what the engine's rule for a hybrid model's other KV cache groups reads
    (kv_preflight/predictor/scoring/groups.py), where the lookup did not hand them over (``Lookup.group_bits``)."""
    replies = await backend.read_commands([("HGETALL", presence_key(k)) for k in request_keys])
    out: list[GroupBits] = []
    for r in replies:
        if isinstance(r, Exception):
            out.append({})
            continue
        items = r.items() if isinstance(r, dict) else zip(r[::2], r[1::2])
        out.append(group_bits_of([x for f, v in items for x in (f, presence_value(v)[1])]))
    return out


__all__ = ["BitsReply", "GroupBits", "chain_group_bits", "group_bits_of", "presence_value", "read_group_bits", "NamesFor", "TierBits", "TierRuns", "as_int", "bits_of", "mask_of", "numbers",
           "numbers_in", "chain_of_one_tier", "one_tier_reads", "parse_bits_reply", "prefix_from_bits", "prefix_of_one_tier", "tier_in",
           "tier_in_runs"]
