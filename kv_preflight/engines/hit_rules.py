"""How many tokens of a prompt an engine reuses from its prefix cache, given which of the prompt's blocks each
KV cache group holds: vLLM's cache-hit rules, one per group kind, and the fixed point over groups. Pure.

A plain model has one KV cache group (full attention): the hit is the run of cached blocks from the start.
Hybrid models (gpt-oss, Gemma 3: sliding-window layers beside full-attention ones; Llama 4: chunked local
attention; Qwen3-Next, Granite 4, Nemotron-H, Jamba: Mamba layers) run vLLM's hybrid KV cache manager: one group
per layer kind, each with its own blocks and its own rule for what counts as a hit, and the request's hit is the
longest length every group accepts. Followed here from vLLM 0.32's source:

* ``HybridKVCacheCoordinator.find_longest_cache_hit`` (vllm/v1/core/kv_cache_coordinator.py): groups sorted with
  full attention first; each group either accepts the current candidate length or lowers it, and the loop runs
  until no group lowers it; with exactly two spec groups (groups of equal specs merged), full attention
  first, one pass ("simple hybrid"). One group alone: ``UnitaryKVCacheCoordinator``, its kind's rule.
  Full-attention groups are downward-closed, so their first answer is only trimmed on later passes.
* ``FullAttentionManager.find_longest_cache_hit``: cached blocks from the start, up to the first miss.
* ``SlidingWindowManager.find_longest_cache_hit``: searched right to left for ``ceil((window - 1) / block)``
  contiguous cached blocks; the hit ends with that run (blocks before the window are not needed); if no run is
  long enough, the run of cached blocks from block 0 still counts.
* ``ChunkedLocalAttentionManager.find_longest_cache_hit``: blocks before the chunk that holds the candidate's
  end count as computed; from that chunk's first block, cached blocks up to the first miss.
* ``MambaManager.find_longest_cache_hit``: the last cached block (right to left) at a position aligned to the
  hit alignment; the hit ends there.
* EAGLE (``drop_eagle_block``): the last matched block of a full-attention group is dropped; a sliding-window
  group needs one more contiguous block and drops it; Mamba drops nothing. In a hybrid model each EAGLE spec
  group first matches one block past the candidate (``eagle_proof_margin``) and drops at most once per candidate
  length (``eagle_verified``); groups of one spec are merged and drop together (``SpecGroup``).

Lengths are in tokens; ``held(group, i)`` says whether the group holds block ``i`` (0-based, in that group's
own block size). ``max_tokens`` is the longest hit allowed: the prompt's length minus one, since the engine
always recomputes the last prompt token (``KVCacheManager.get_computed_blocks``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED = "chunked_local_attention"
MAMBA = "mamba"
KNOWN_KINDS = (FULL, SLIDING, CHUNKED, MAMBA)

Held = Callable[[int, int], bool]  # (group, block index) -> cached


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group of an engine, as far as its hit rule needs it. ``block_size`` in tokens (None: the
    pod's engine block size); ``sliding_window`` for sliding-window groups; ``attention_chunk_size`` for chunked
    local attention (vLLM 0.32's events do not carry it: a flag or discovery must); ``eagle``: EAGLE/MTP drafting
    drops the last matched block."""

    kind: str = FULL
    block_size: int | None = None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    eagle: bool = False

    def __post_init__(self) -> None:
        # a kind vLLM runs with another kind's manager is that kind here (``RUN_AS``)
        if self.kind in RUN_AS:
            object.__setattr__(self, "kind", RUN_AS[self.kind])

    def missing(self) -> str | None:
        """What the rule needs and this spec lacks (the pod is then answered conservatively), or None."""
        if self.kind not in KNOWN_KINDS:
            return f"KV cache group kind {self.kind!r} has no hit rule here"
        if self.kind == SLIDING and not self.sliding_window:
            return "sliding-window group without its window size"
        if self.kind == CHUNKED and not self.attention_chunk_size:
            return "chunked local attention group without its chunk size (give it with --group-spec)"
        return None

    def filled(self, declared: "GroupSpec") -> "GroupSpec":
        """This spec (learned from events) with what it lacks taken from ``declared`` (``--group-spec``): the
        events' own values win, since they are what the engine runs; an unknown kind takes the declared one."""
        kind = self.kind if self.kind in KNOWN_KINDS else declared.kind
        return GroupSpec(kind, self.block_size or declared.block_size, self.sliding_window or declared.sliding_window,
                         self.attention_chunk_size or declared.attention_chunk_size, self.eagle or declared.eagle)


# ``kv_cache_spec_kind`` values (vLLM 0.32's ``KVCacheSpecKind``, vllm/v1/kv_cache_interface.py, set on BlockStored
# by ``KVCacheManager.take_events``) whose spec vLLM runs with another kind's manager (``register_all_kvcache_specs``
# in vllm/v1/core/single_type_kv_cache_manager.py): MLA and sink full attention are ``FullAttentionSpec``
# subclasses run by ``FullAttentionManager`` (``SinkFullAttentionManager`` overrides no lookup) and sorted first as
# full attention by the coordinator; sliding-window MLA is a ``SlidingWindowSpec`` run by ``SlidingWindowManager``,
# its window in ``kv_cache_spec_sliding_window`` like any sliding window's.
RUN_AS = {"mla_attention": FULL, "sink_full_attention": FULL, "sliding_window_mla": SLIDING}
KIND_NAMES = {"full": FULL, "full_attention": FULL, "sliding_window": SLIDING, "swa": SLIDING, "chunked": CHUNKED,
              "chunked_local_attention": CHUNKED, "mamba": MAMBA, **RUN_AS}
SPEC_OPTIONS = {"block": "block_size", "window": "sliding_window", "chunk": "attention_chunk_size"}


def parse_group_spec(item: str) -> tuple[str, int, GroupSpec]:
    """One ``--group-spec`` value: ``MODEL:GROUP=KIND[/block=N][/window=N][/chunk=N][/eagle]`` (KIND: full,
    sliding_window, chunked_local_attention, mamba; short forms swa, chunked; vLLM's mla_attention,
    sink_full_attention and sliding_window_mla, run as full attention or sliding window). What vLLM 0.32's events do not
    carry (a chunked local attention group's chunk size, a Mamba group's block size) is given this way; no
    commas, so ``KVPF_GROUP_SPECS`` lists several with commas."""
    head, sep, rest = item.strip().partition("=")
    model, colon, group = head.rpartition(":")
    form = "MODEL:GROUP=KIND[/block=N][/window=N][/chunk=N][/eagle]"
    if not sep or not colon or not model or not group.strip().isdigit() or not rest:
        raise ValueError(f"--group-spec expects {form}, got {item!r}")
    kind_name, *options = rest.split("/")
    kind = KIND_NAMES.get(kind_name.strip().lower())
    if kind is None:
        raise ValueError(f"--group-spec {item!r}: unknown kind {kind_name!r} (one of {', '.join(sorted(KIND_NAMES))})")
    values: dict[str, object] = {"kind": kind}
    for opt in options:
        name, eq, value = opt.strip().partition("=")
        if name == "eagle" and not eq:
            values["eagle"] = True
        elif name in SPEC_OPTIONS and eq and value.isdigit() and int(value) > 0:
            values[SPEC_OPTIONS[name]] = int(value)
        else:
            raise ValueError(f"--group-spec {item!r}: bad option {opt!r} (block=N, window=N, chunk=N or eagle)")
    return model.strip(), int(group), GroupSpec(**values)  # type: ignore[arg-type]


def parse_group_specs(items: Iterable[str]) -> dict[str, dict[int, GroupSpec]]:
    """Repeated ``--group-spec`` values as model -> group -> spec."""
    out: dict[str, dict[int, GroupSpec]] = {}
    for item in items:
        model, group, spec = parse_group_spec(item)
        out.setdefault(model, {})[group] = spec
    return out


def effective_groups(learned: Mapping[int, GroupSpec] | None, declared: Mapping[int, GroupSpec] | None
                     ) -> dict[int, GroupSpec] | None:
    """A pod's groups as the hit rule uses them: those its events named (its meta's, when they need a rule:
    kv_preflight/index/pod_meta.py ``has_a_rule``), each filled from the declared ones (``--group-spec`` for its
    model); None when there are none (a plain model, or an engine whose events carry no group: the declared
    groups alone cannot place its blocks)."""
    if not learned:
        return None
    if not declared:
        return dict(learned)
    return {g: (s.filled(declared[g]) if g in declared else s) for g, s in learned.items()}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


Has = Callable[[int], bool]  # block index -> cached in every group of a spec group


def _full(has: Has, bs: int, max_length: int, drop: bool, align: int) -> int:
    """``FullAttentionManager.find_longest_cache_hit`` (not fine-grained: every group's block size a multiple of
    the hash block): cached blocks from the start; EAGLE drops ``min(align, bs)`` tokens; rounded down to the
    alignment."""
    n = 0
    limit = max_length // bs
    while n < limit and has(n):
        n += 1
    hit = n * bs
    if drop and hit > 0:
        hit -= min(align, bs)
    return hit - hit % align


def _sliding(has: Has, bs: int, window: int, max_length: int, drop: bool, align: int) -> int:
    """``SlidingWindowManager.find_longest_cache_hit``: right to left for ``_contiguous_blocks_for_hit`` blocks
    (one more with EAGLE, then popped), a run's last block only where the hit would be aligned; else the run
    from block 0, realigned."""
    need = _cdiv(window - 1, bs) + (1 if drop else 0)
    run = 0
    blocks = None
    for i in range(max_length // bs - 1, -1, -1):
        if has(i):
            if run == 0 and bs != align:
                post = i if drop else i + 1
                if (post * bs) % align:
                    continue
            run += 1
            if run >= need:
                blocks = i + run
                break
        else:
            run = 0
    if blocks is None:
        blocks = run
        while bs != align and blocks * bs % align:
            blocks -= 1
    if drop and blocks:
        blocks -= 1
        while bs != align and blocks * bs % align:
            blocks -= 1
    return blocks * bs


def _chunked(has: Has, bs: int, chunk: int, max_length: int) -> int:
    """``ChunkedLocalAttentionManager.find_longest_cache_hit``: blocks before the chunk holding ``max_length``
    count as computed; from that chunk's first block, cached blocks up to the first miss. (vLLM refuses EAGLE
    with chunked local attention, so there is no drop.)"""
    limit = max_length // bs
    start = (max_length // chunk * chunk) // bs if max_length > 0 else 0
    n = start
    while n < limit and has(n):
        n += 1
    return n * bs


def _mamba(has: Has, bs: int, max_length: int, align: int) -> int:
    """``MambaManager.find_longest_cache_hit`` (block-aligned lookups): the last cached block at an aligned
    position, right to left; it never drops a block for EAGLE."""
    for i in range(max_length // bs - 1, -1, -1):
        if has(i):
            if bs != align and (i + 1) * bs % align:
                continue
            return (i + 1) * bs
    return 0


def _rule(spec: GroupSpec, bs: int, has: Has, max_length: int, align: int, drop: bool) -> int:
    """One spec group's manager, ``find_longest_cache_hit(max_length, drop_eagle_block)``. A spec whose rule
    lacks a setting (``GroupSpec.missing``) accepts nothing: an answer that cannot be exact is a lower bound,
    never more than the engine finds."""
    if spec.missing():
        return 0
    if spec.kind == SLIDING:
        return _sliding(has, bs, spec.sliding_window or bs, max_length, drop, align)
    if spec.kind == CHUNKED:
        return _chunked(has, bs, spec.attention_chunk_size or bs, max_length)
    if spec.kind == MAMBA:
        return _mamba(has, bs, max_length, align)
    return _full(has, bs, max_length, drop, align)


def group_hit(g: int, spec: GroupSpec, bs: int, held: Held, max_tokens: int, align: int) -> int:
    """One group alone (vLLM's ``UnitaryKVCacheCoordinator.find_longest_cache_hit``): its manager's rule up to
    ``max_tokens``, aligned to its own block, EAGLE's block dropped with no margin (a single group matches no
    block past the candidate)."""
    return _rule(spec, bs, lambda i: held(g, i), max_tokens, align, spec.eagle)


@dataclass
class _SpecGroup:
    """vLLM's ``SpecGroup``: KV cache groups of one spec, looked up together (a block counts only when every
    member holds it) and, with EAGLE when any member has it, dropping one block for all of them."""

    spec: GroupSpec
    block_size: int
    members: list[int]
    eagle: bool


def _same_spec(spec: GroupSpec, bs: int) -> tuple[str, int, int | None, int | None]:
    """What vLLM compares to merge groups (``group.spec == spec`` and the same manager): the kind, the block
    size and the kind's own size. Groups are made of layers of one spec, so two groups whose events name the
    same kind and sizes have equal specs. (A kind run as another, ``RUN_AS``, is that kind here: an MLA group
    beside a plain full-attention one of the same block size would be merged, where vLLM keeps two specs.)"""
    return (spec.kind, bs, spec.sliding_window if spec.kind == SLIDING else None,
            spec.attention_chunk_size if spec.kind == CHUNKED else None)


def spec_groups(groups: Mapping[int, GroupSpec], sizes: Mapping[int, int]) -> list[_SpecGroup]:
    """``HybridKVCacheCoordinator.verify_and_split_kv_cache_groups``: groups of equal specs merged (in group
    order), then full attention first (a stable sort)."""
    out: list[_SpecGroup] = []
    by_spec: dict[tuple[str, int, int | None, int | None], _SpecGroup] = {}
    for g in sorted(groups):
        spec = groups[g]
        key = _same_spec(spec, sizes[g])
        found = by_spec.get(key)
        if found is None:
            found = by_spec[key] = _SpecGroup(spec, sizes[g], [g], spec.eagle)
            out.append(found)
        else:
            found.members.append(g)
            found.eagle = found.eagle or spec.eagle
    out.sort(key=lambda sg: sg.spec.kind != FULL)
    return out


def _has(held: Held, members: list[int]) -> Has:
    if len(members) == 1:
        g = members[0]
        return lambda i: held(g, i)
    return lambda i: all(held(g, i) for g in members)


def longest_hit(groups: Mapping[int, GroupSpec], held: Held, prompt_tokens: int, block_size: int) -> int:
    """The request's hit in tokens: every group's rule, to their fixed point
    (``HybridKVCacheCoordinator.find_longest_cache_hit``).

    ``groups``: group index -> spec (one group: ``UnitaryKVCacheCoordinator``, its rule alone, whatever its
    kind); ``block_size``: the engine block size, for groups whose spec gives none; ``prompt_tokens``: the
    prompt's length (the hit is at most one token less: the engine recomputes the last prompt token). Hits are
    aligned to the least common multiple of the groups' block sizes (vLLM's scheduler block size); the request's
    block hashes are counted in the greatest common divisor (its hash block size).

    Followed step by step: groups of equal specs merged into spec groups, full attention first; with two spec
    groups, full attention first, one pass ("simple hybrid"); a full-attention spec group is looked up once and
    later only trims the candidate; an EAGLE spec group not yet verified at the current candidate drops a block
    and, unless Mamba, first matches one block past the candidate (``eagle_proof_margin``), capped at the
    request's hashed tokens; once it has dropped it is verified, and the verifications are forgotten whenever a
    group that did not drop lowers the candidate (``eagle_verified``)."""
    max_tokens = prompt_tokens - 1
    if max_tokens <= 0 or not groups:
        return 0
    sizes = {g: (s.block_size or block_size) for g, s in groups.items()}
    align = math.lcm(*sizes.values())
    if len(groups) == 1:
        ((g, spec),) = groups.items()
        return group_hit(g, spec, sizes[g], held, max_tokens, sizes[g])
    hash_block = math.gcd(*sizes.values())  # the request's hashes: whole blocks of this size
    hashed = prompt_tokens // hash_block * hash_block
    order = spec_groups(groups, sizes)
    simple = len(order) == 2 and order[0].spec.kind == FULL
    has = [_has(held, sg.members) for sg in order]
    hit = max_tokens
    full_hits: dict[int, int] = {}
    verified: set[int] = set()
    while True:
        cur = hit
        for idx, sg in enumerate(order):
            if sg.spec.kind == FULL and idx in full_hits:
                cur = min(cur, full_hits[idx])
                continue
            drop = sg.eagle and idx not in verified and sg.spec.kind != CHUNKED
            max_length = cur
            if drop and sg.spec.kind != MAMBA:
                max_length = min(cur + sg.block_size, hashed)
            found = _rule(sg.spec, sg.block_size, has[idx], max_length, align, drop)
            if drop:
                verified.add(idx)
            elif found < cur:
                verified.clear()
            cur = found
            if sg.spec.kind == FULL:
                full_hits[idx] = found
        if cur >= hit:
            break
        hit = cur
        if simple:
            break
    return hit


def prefix_group(groups: Mapping[int, GroupSpec]) -> int:
    """The group whose held keys form a prefix of every chain (full attention: the engine reuses a block
    only after every block before it, and evicts a chain's tail first): the lowest full-attention group,
    else group 0. Its keys are what the index's lookup walks; the others' are read beside it."""
    full = [g for g, s in groups.items() if s.kind == FULL]
    return min(full) if full else 0


def held_blocks(groups: Mapping[int, GroupSpec], keys_held: Callable[[int, int], bool], canonical: int,
                block_size: int) -> Held:
    """``held(group, block)`` from a presence at request-key granularity: a group block of ``B`` tokens is
    cached in the group when its last request key (``canonical`` tokens each) is held there (an engine stores
    a block's request keys together, so its last one stands for all). ``keys_held(group, key index)``."""
    per = {g: (s.block_size or block_size) for g, s in groups.items()}

    def held(g: int, i: int) -> bool:
        bs = per[g]
        if bs % canonical:
            return False  # a block that ends inside a request key is never counted (conservative)
        return keys_held(g, (i + 1) * bs // canonical - 1)

    return held


__all__ = ["CHUNKED", "FULL", "KIND_NAMES", "KNOWN_KINDS", "MAMBA", "RUN_AS", "SLIDING", "GroupSpec",
           "effective_groups", "group_hit", "held_blocks", "longest_hit", "parse_group_spec", "parse_group_specs",
           "prefix_group", "spec_groups"]
