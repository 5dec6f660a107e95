"""A hybrid model's hit: the engine's rule over each KV cache group's presence. Pure.

The index's lookup gives each pod's prefix in its prefix group (full attention: ``PodMatch.blocks``, in
request keys). A pod with several KV cache groups (a sliding-window layer beside a full-attention one, and so
on) reuses only what every group's rule accepts (kv_preflight/engines/hit_rules.py, vLLM's coordinator): the
other groups' presence is read beside the lookup (``Index.presence``), and each such pod's match is replaced
by the blocks that rule leaves, so scoring needs nothing else.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec, longest_hit, prefix_group
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


@lru_cache(maxsize=256)
def _window_pair(groups: tuple[tuple[int, GroupSpec], ...], engine_block: int, canonical: int
                 ) -> tuple[int, int, int] | None:
    """(window group, block size, contiguous blocks a hit needs) when the groups are one full-attention group
    and one sliding-window group (gpt-oss, Gemma 3), neither with EAGLE, of one block size that whole request
    keys divide; else None (the general rule then runs)."""
    if len(groups) != 2:
        return None
    kinds = {spec.kind: (g, spec) for g, spec in groups}
    if set(kinds) != {FULL, SLIDING} or any(spec.eagle or spec.missing() for _, spec in groups):
        return None
    sizes = {spec.block_size or engine_block for _, spec in groups}
    if len(sizes) != 1:
        return None
    bs = sizes.pop()
    if bs % canonical:
        return None
    g, spec = kinds[SLIDING]
    return g, bs, -(-((spec.sliding_window or bs) - 1) // bs)


def _window_hit(window_group: int, bs: int, need: int, prefix_keys: int, bits: GroupBits, num: int,
                canonical: int, prompt_len: int) -> int:
    """``longest_hit`` for one full-attention group (the prefix group) and one sliding-window group, without a
    callback per block: vLLM's "simple hybrid", one pass. Full attention holds the blocks of the pod's prefix,
    at most the prompt less its last token (``FullAttentionManager.find_longest_cache_hit``); within that, the
    window group's blocks right to left until ``need`` contiguous ones end the hit, else the run from block 0
    (``SlidingWindowManager.find_longest_cache_hit``; one block size, so no realignment)."""
    max_tokens = prompt_len - 1
    if max_tokens <= 0:
        return 0
    per = bs // canonical
    n = min(prefix_keys // per, max_tokens // bs)
    run = 0
    for i in range(n - 1, -1, -1):
        if bits(window_group, (i + 1) * per - 1) >> num & 1:
            run += 1
            if run >= need:
                return (i + run) * bs
        else:
            run = 0
    return run * bs


def group_hit(groups: Mapping[int, GroupSpec], prefix_keys: int, bits: GroupBits, num: int, canonical: int,
              engine_block: int, prompt_len: int) -> int:
    """Tokens a hybrid pod reuses: ``prefix_keys``, its prefix (in request keys of ``canonical`` tokens) in its
    prefix group; ``bits``, the chain keys' other-group bitmaps; ``num``, the pod's bit. A block of a group is
    held there when the group's bit is set on the block's last key."""
    pair = _window_pair(tuple(sorted(groups.items())), engine_block, canonical)
    if pair is not None:
        return _window_hit(*pair, prefix_keys, bits, num, canonical, prompt_len)
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
