"""A hybrid model's hit: the engine's rule over each KV cache group's presence. Pure.

The index's lookup gives each pod's prefix in its prefix group (full attention: ``PodMatch.blocks``, in
request keys). A pod with several KV cache groups (a sliding-window layer beside a full-attention one, and so
on) reuses only what every group's rule accepts (kv_preflight/engines/hit_rules.py, vLLM's coordinator): the
other groups' presence is read beside the lookup (``Index.presence``), and each such pod's match is replaced
by the blocks that rule leaves, so scoring needs nothing else.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kv_preflight.engines.hit_rules import SLIDING, GroupSpec, effective_groups, longest_hit, prefix_group
from kv_preflight.index.entries import PodMatch
from kv_preflight.predictor.explain.findings import Finding

MAX_NAMED = 5  # pods a finding names; the rest are counted


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


def pods_groups(learned: Mapping[str, Mapping[int, GroupSpec] | None], declared: Mapping[int, GroupSpec] | None
                ) -> dict[str, dict[int, GroupSpec]]:
    """Each hybrid pod's groups as its rule uses them: learned from its events, filled from ``--group-spec``."""
    out = {}
    for pod, groups in learned.items():
        eff = effective_groups(groups, declared)
        if eff:
            out[pod] = eff
    return out


def _named(pods: Sequence[str]) -> str:
    shown = ", ".join(repr(p) for p in pods[:MAX_NAMED])
    return shown + (f" and {len(pods) - MAX_NAMED} more" if len(pods) > MAX_NAMED else "")


def group_findings(model: str, matched: Iterable[str], hybrid: Mapping[str, Mapping[int, GroupSpec]],
                   declared: Mapping[int, GroupSpec] | None) -> list[Finding]:
    """What an answer must say about pods it cannot answer exactly (issue 24): a hybrid pod whose group lacks
    what its rule needs (answered as a lower bound: that group accepts nothing), and, for a model declared
    hybrid by ``--group-spec``, pods whose events name no KV cache group (SGLang, TensorRT-LLM: their count is
    the prefix their events describe, which the engine's other groups may cut; docs/engines.md)."""
    out: list[Finding] = []
    declared_hybrid = bool(declared) and len(declared or {}) > 1
    if not hybrid and not declared_hybrid:
        return out  # plain pods of a plain model: nothing to say, nothing walked (the fleet-wide hot path)
    lacking: dict[str, list[str]] = {}
    silent = []
    for pod in sorted({p for p in matched if p in hybrid or declared_hybrid}):
        groups = hybrid.get(pod)
        if groups is None:
            silent.append(pod)
            continue
        for g, spec in sorted(groups.items()):
            why = spec.missing()
            if why:
                lacking.setdefault(f"group {g}: {why}", []).append(pod)
    for why, pods in lacking.items():
        out.append(Finding("hybrid_groups_incomplete", None, (
            f"pod(s) {_named(pods)} of {model!r}: KV cache {why}; counted as a lower bound (that group accepts "
            "no block), not exact")))
    if silent:
        out.append(Finding("hybrid_not_exact", None, (
            f"{model!r} has {len(declared or {})} KV cache groups (--group-spec) but the events of pod(s) "
            f"{_named(silent)} name none (SGLang and TensorRT-LLM publish one group's blocks): their count is "
            "that group's prefix, which the engine's other groups may cut; exactness is not claimed "
            "(docs/engines.md)")))
    return out


def window_cut(groups: Mapping[int, GroupSpec], prefix_keys: int, bits: GroupBits, num: int, canonical: int,
               engine_block: int, prompt_len: int) -> tuple[int, int, list[int]] | None:
    """Why a hybrid pod's hit is shorter than its full-attention prefix, for /explain: (sliding-window group,
    its window in tokens, the group's blocks within the prefix it no longer holds), or None when no
    sliding-window group misses a block of the prefix."""
    for g, spec in sorted(groups.items()):
        if spec.kind != SLIDING:
            continue
        size = spec.block_size or engine_block
        if size % canonical:
            continue
        usable = min(prefix_keys * canonical, prompt_len - 1) // size
        missing = [i for i in range(usable) if not bits(g, (i + 1) * size // canonical - 1) >> num & 1]
        if missing:
            return g, spec.sliding_window or 0, missing
    return None


__all__ = ["GroupBits", "apply_groups", "group_findings", "group_hit", "keys_needed", "pods_groups", "window_cut"]
