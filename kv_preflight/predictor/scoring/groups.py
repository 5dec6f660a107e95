"""A hybrid model's hit: the engine's rule over each KV cache group's presence. Pure.

The index's lookup gives each pod's prefix in its prefix group (full attention: ``PodMatch.blocks``, in
request keys). A pod with several KV cache groups (a sliding-window layer beside a full-attention one, and so
on) reuses only what every group's rule accepts (kv_preflight/engines/hit_rules.py, vLLM's coordinator): the
other groups' presence is read beside the lookup (``ReadSide.group_presence``), and each such pod's match is replaced
by the blocks that rule leaves, so scoring needs nothing else.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec, effective_groups, longest_hit, prefix_group
from kv_preflight.index.entries import PodMatch
from kv_preflight.predictor.explain.findings import Finding

MAX_NAMED = 5  # pods a finding names; the rest are counted


class GroupBits:
    """Each chain key's bitmap per KV cache group (every tier ORed), as integers, made once per key and group
    asked for: a fleet's hybrid pods test their bit in the same few keys near their prefix's end. ``presence``:
    per key, (tier, group) -> bitmap, the other groups' fields (``Lookup.group_bits``, ``group_bits_of``)."""

    def __init__(self, presence: Sequence[Mapping[tuple[str, int], bytes]]):
        self.presence = presence
        self._ints: dict[tuple[int, int], int] = {}

    def __call__(self, group: int, k: int) -> int:
        got = self._ints.get((group, k))
        if got is None:
            got = 0
            if k < len(self.presence):
                for (_, g), bitmap in self.presence[k].items():
                    if g == group:
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


def _window_hits(pods: Sequence[tuple[int, int]], window_group: int, bs: int, need: int, bits: GroupBits,
                 canonical: int, prompt_len: int) -> dict[int, int]:
    """``_window_hit`` for many pods at once: pod number -> tokens, for (number, prefix keys) pairs. The same
    right-to-left search, walked once for all of them on the window group's bitmaps: ``runs[j]`` holds the
    pods whose run of held blocks (from where each pod's full-attention prefix ends, downwards) is at least
    ``j`` long; a pod leaves when its run reaches ``need``. A few integer operations a block instead of a
    bit test per pod and block: a fleet-wide prefix held by 1,000 hybrid pods."""
    max_tokens = prompt_len - 1
    out: dict[int, int] = {}
    if max_tokens <= 0:
        return {num: 0 for num, _ in pods}
    per = bs // canonical
    limit = max_tokens // bs
    starts: dict[int, int] = {}  # block -> pods whose search starts there
    for num, prefix_keys in pods:
        n = min(prefix_keys // per, limit)
        if n:
            starts[n - 1] = starts.get(n - 1, 0) | 1 << num
        else:
            out[num] = 0
    if not starts:
        return out
    runs = [0] * (need + 1)  # runs[0]: every pod still searching
    for i in range(max(starts), -1, -1):
        runs[0] |= starts.get(i, 0)
        held = bits(window_group, (i + 1) * per - 1) & runs[0]
        for j in range(need, 0, -1):
            runs[j] = runs[j - 1] & held
        done = runs[need]
        if done:
            _spread(done, (i + need) * bs, out)
            keep = ~done
            runs = [r & keep for r in runs]
    for j in range(need - 1, -1, -1):  # no run long enough: the run from block 0
        left = runs[j] & ~runs[j + 1] if j + 1 < need else runs[j]
        _spread(left, j * bs, out)
    return out


def _spread(mask: int, tokens: int, out: dict[int, int]) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = tokens
        mask ^= low


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
                 engine_blocks: Mapping[str, int | None], presence: Sequence[Mapping[tuple[str, int], bytes]],
                 nums: Mapping[str, int], canonical: int, prompt_len: int) -> list[PodMatch]:
    """The matches with each hybrid pod's blocks replaced by what its groups' rules leave (in request keys);
    a pod whose number is not known keeps its prefix-group match (read again next time). Pods of one layout
    (one groups mapping, shared by a model's pods: kv_preflight/index/pod_meta.py) and one engine block are
    analysed once and, for one window beside full attention, searched at once."""
    bits = GroupBits(presence)
    hits: dict[str, int] = {}
    batched: list[tuple[str, tuple[int, int, int], int]] = []  # (pod, its window layout, its number)
    batches: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # pods of one layout, searched at once
    pairs: dict[tuple[int, int], tuple[int, int, int] | None] = {}  # (id of a groups mapping, engine block) -> pair
    for m in matches:
        pod = m.pod_id
        groups = groups_of.get(pod)
        if groups is None:
            continue
        num = nums.get(pod)
        if num is None:
            continue
        ebs = engine_blocks.get(pod) or canonical
        layout = (id(groups), ebs)
        if layout in pairs:
            pair = pairs[layout]
        else:
            pair = pairs[layout] = _window_pair(tuple(sorted(groups.items())), ebs, canonical)
        if pair is None:
            hits[pod] = group_hit(groups, m.blocks, bits, num, canonical, ebs, prompt_len)
            continue
        batch = batches.get(pair)
        if batch is None:
            batch = batches[pair] = []
        batch.append((num, m.blocks))
        batched.append((pod, pair, num))
    found = {pair: _window_hits(pods, *pair, bits, canonical, prompt_len) for pair, pods in batches.items()}
    for pod, pair, num in batched:
        hits[pod] = found[pair][num]
    return [m if (hit := hits.get(m.pod_id)) is None else PodMatch(m.pod_id, hit // canonical, m.tier)
            for m in matches]


def pods_groups(learned: Mapping[str, Mapping[int, GroupSpec] | None], declared: Mapping[int, GroupSpec] | None
                ) -> dict[str, dict[int, GroupSpec]]:
    """Each hybrid pod's groups as its rule uses them: learned from its events, filled from ``--group-spec``."""
    out = {}
    for pod, groups in learned.items():
        # nothing declared: the learned mapping itself, one object per metadata read (apply_groups keys its
        # analysis of a pod's layout on it)
        eff = groups if not declared else effective_groups(groups, declared)
        if eff:
            out[pod] = eff
    return out


def _named(pods: Sequence[str]) -> str:
    shown = ", ".join(repr(p) for p in pods[:MAX_NAMED])
    return shown + (f" and {len(pods) - MAX_NAMED} more" if len(pods) > MAX_NAMED else "")


class CompleteGroups:
    """Pods whose groups were found complete, each with that very mapping (one object per metadata read), so a
    fleet's thousand hybrid pods are not checked again on every answer. One per predictor."""

    def __init__(self, limit: int = 100_000):
        self.limit = limit
        self._seen: dict[str, Mapping[int, GroupSpec]] = {}

    def known(self, pod: str, groups: Mapping[int, GroupSpec]) -> bool:
        return self._seen.get(pod) is groups

    def add(self, pod: str, groups: Mapping[int, GroupSpec]) -> None:
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[pod] = groups


def group_findings(model: str, matched: Iterable[str], hybrid: Mapping[str, Mapping[int, GroupSpec]],
                   declared: Mapping[int, GroupSpec] | None, complete: CompleteGroups | None = None) -> list[Finding]:
    """What an answer must say about pods it cannot answer exactly (issue 24): a hybrid pod whose group lacks
    what its rule needs (answered as a lower bound: that group accepts nothing), a pod of one group of another
    kind than full attention (its rule runs over the pod's prefix only: a lower bound), and, for a model declared
    hybrid by ``--group-spec``, pods whose events name no KV cache group (SGLang, TensorRT-LLM: their count is
    the prefix their events describe, which the engine's other groups may cut; docs/engines.md)."""
    out: list[Finding] = []
    declared_hybrid = bool(declared) and len(declared or {}) > 1
    if not hybrid and not declared_hybrid:
        return out  # plain pods of a plain model: nothing to say, nothing walked (the fleet-wide hot path)
    lacking: dict[str, list[str]] = {}
    alone: dict[str, list[str]] = {}  # pods of one group of a kind other than full attention, by that kind
    silent = []
    for pod in sorted({p for p in matched if p in hybrid or declared_hybrid}):
        groups = hybrid.get(pod)
        if groups is None:
            silent.append(pod)
            continue
        if len(groups) == 1:
            (spec,) = groups.values()
            if spec.kind != FULL and not spec.missing():
                alone.setdefault(spec.kind, []).append(pod)
        if complete is not None and complete.known(pod, groups):  # these very groups were found complete
            continue
        ok = True
        for g, spec in sorted(groups.items()):
            why = spec.missing()
            if why:
                ok = False
                lacking.setdefault(f"group {g}: {why}", []).append(pod)
        if ok and complete is not None:
            complete.add(pod, groups)
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
    for kind, pods in alone.items():
        out.append(Finding("single_group_lower_bound", None, (
            f"pod(s) {_named(pods)} of {model!r} have one KV cache group, of kind {kind}: counted by that kind's "
            "rule over the pod's prefix of the prompt (the lookup stops at a pod's first missing block, and "
            "vLLM's rule may also use blocks held past it), so a lower bound, not exact (docs/engines.md)")))
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


__all__ = ["CompleteGroups", "GroupBits", "apply_groups", "group_findings", "group_hit", "keys_needed", "pods_groups",
           "window_cut"]
