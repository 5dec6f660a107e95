"""A hybrid model's hit: the engine's rule over each KV cache group's presence. Pure.

The index's lookup gives each pod's prefix in its prefix group (full attention: ``PodMatch.blocks``, in
request keys). A pod with several KV cache groups (a sliding-window layer beside a full-attention one, and so
on) reuses only what every group's rule accepts (kv_preflight/engines/hit_rules.py, vLLM's coordinator): the
other groups' presence is read beside the lookup (``Index.presence``), and each such pod's match is replaced
by the blocks that rule leaves, so scoring needs nothing else.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kv_preflight.engines.hit_rules import GroupSpec, longest_hit, prefix_group
from kv_preflight.index.entries import PodMatch


class GroupBits:
    """Each chain key's bitmap per KV cache group (every tier ORed), as integers, made once per key and group
    asked for: a fleet's hybrid pods test their bit in the same few keys near their prefix's end."""

    def __init__(self, presence: Sequence[Mapping[str, bytes]]):
        self.presence = presence
        self._ints: dict[tuple[int, int], int] = {}

    def __call__(self, group: int, k: int) -> int:
        got = self._ints.get((group, k))
        if got is None:
            got = 0
            if k < len(self.presence):
                end = f"|{group}"
                for f, bitmap in self.presence[k].items():
                    if f.endswith(end):
                        got |= int.from_bytes(bitmap, "little")
            self._ints[(group, k)] = got
        return got


def group_hit(groups: Mapping[int, GroupSpec], prefix_keys: int, bits: GroupBits, num: int, canonical: int,
              engine_block: int, prompt_len: int) -> int:
    """Tokens a hybrid pod reuses: ``prefix_keys``, its prefix (in request keys of ``canonical`` tokens) in its
    prefix group; ``bits``, the chain keys' other-group bitmaps; ``num``, the pod's bit. A block of a group is
    held there when the group's bit is set on the block's last key."""
    pg = prefix_group(groups)

    def held(g: int, i: int) -> bool:
        size = groups[g].block_size or engine_block
        if size % canonical:
            return False
        k = (i + 1) * size // canonical - 1
        if g == pg:
            return k < prefix_keys
        return bool(bits(g, k) >> num & 1)

    return longest_hit(groups, held, prompt_len, engine_block)


def keys_needed(matches: Iterable[PodMatch], hybrid: Mapping[str, object]) -> int:
    """How many leading chain keys the hybrid pods' rules may read (each pod's prefix bounds its hit)."""
    return max((m.blocks for m in matches if m.pod_id in hybrid), default=0)


def apply_groups(matches: Sequence[PodMatch], groups_of: Mapping[str, Mapping[int, GroupSpec]],
                 engine_blocks: Mapping[str, int | None], presence: Sequence[Mapping[str, bytes]],
                 nums: Mapping[str, int], canonical: int, prompt_len: int) -> list[PodMatch]:
    """The matches with each hybrid pod's blocks replaced by what its groups' rules leave (in request keys);
    a pod whose number is not known keeps its prefix-group match (read again next time)."""
    out = []
    bits = GroupBits(presence)
    for m in matches:
        groups = groups_of.get(m.pod_id)
        if groups is None or m.pod_id not in nums:
            out.append(m)
            continue
        ebs = engine_blocks.get(m.pod_id) or canonical
        hit = group_hit(groups, m.blocks, bits, nums[m.pod_id], canonical, ebs, prompt_len)
        out.append(PodMatch(m.pod_id, hit // canonical, m.tier))
    return out


__all__ = ["GroupBits", "apply_groups", "group_hit", "keys_needed"]
