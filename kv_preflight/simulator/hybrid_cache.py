"""The prefix cache of a vLLM (v1) engine serving a hybrid model: several KV cache groups over one block pool.

A model with sliding-window layers beside full-attention ones (gpt-oss, Gemma 3; here the launcher's
tiny-hybrid-model: one layer of each, window 64) runs vLLM 0.32's hybrid KV cache manager. Followed from its
source (vllm/v1/core/), function by function; the plain one-group model is ``cache.PrefixCache``:

* One ``BlockPool`` for all groups (``KVCacheCoordinator.__init__``): ``num_blocks`` includes the null block;
  every group takes its blocks from the one free queue, and the hash map is keyed by (group, hash), so the same
  block hash can be cached once per group (``BlockPool.get_cached_block``, ``make_block_hash_with_group_id``).
* The hit (``KVCacheManager.get_computed_blocks``, at most ``num_tokens - 1``) is
  ``HybridKVCacheCoordinator.find_longest_cache_hit``: full attention first (cached blocks from block 0,
  ``FullAttentionManager.find_longest_cache_hit``), then the sliding-window group within that length
  (``SlidingWindowManager.find_longest_cache_hit``: right to left, ``ceil((window - 1) / block)`` contiguous
  cached blocks end the hit; failing that, the run from block 0). One full-attention group plus one other is
  the "simple hybrid": one pass, then the full-attention blocks are trimmed to the hit.
* A full-attention hit longer than the reconciled one is a shared prefix the window group has not cached:
  ``shared_prefix_boundary`` (``get_computed_blocks``) is that longer length, and the window group then also
  caches the blocks ending there.
* The window group touches only the blocks inside the window (``add_local_computed_blocks``: the skipped
  ones are null blocks), allocates a slot for every new token (``allocate_new_blocks``), and from the next
  step frees the blocks that fell out of the window (``remove_skipped_blocks`` before each allocation,
  ``get_num_skipped_tokens`` = computed - window + 1), last first, up to the first null block.
* What the window group caches (``SlidingWindowManager.reachable_block_mask`` with vLLM 0.32's default
  ``prefix_cache_retention_interval`` 0): only the ``ceil((window - 1) / block)`` blocks that end at a
  boundary a later request can resume at: ``num_prompt - 1`` rounded down to a block (``replay_boundaries``)
  and the shared-prefix boundary. Its other blocks are never hashed. Every ``cache_full_blocks`` call still
  sends one ``BlockStored`` per group, whose ``token_ids`` span all the new full blocks and whose
  ``block_hashes`` list only the cached ones (it may be empty).
* Freeing a finished request (``KVCacheCoordinator.free``) goes group by group, each group's blocks last to
  first (``BlockPool.free_blocks``): hashed blocks to the queue's tail, unhashed ones to its head.
* ``KVCacheManager.take_events`` stamps each ``BlockStored`` with its group's ``kv_cache_spec_kind`` and
  ``kv_cache_spec_sliding_window``; ``BlockRemoved`` carries only ``group_idx``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_preflight.simulator.cache import MEDIUM_GPU, Block, BlockPool, PoolExhausted, extend_block_hashes

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV cache group: its layer kind and, for sliding window, the window in tokens."""

    kind: str = FULL_ATTENTION
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (FULL_ATTENTION, SLIDING_WINDOW):
            raise ValueError(f"the simulator models {FULL_ATTENTION} and {SLIDING_WINDOW} groups, not {self.kind!r}")
        if (self.kind == SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding_window group needs its window, and only it has one")
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError("sliding_window must be at least 2 tokens")


@dataclass(eq=False)
class HybridRequest:
    """One running request: its tokens and block hashes, and per group its blocks (None: vLLM's null block)."""

    token_ids: list[int]
    num_prompt_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[list[Block | None]] = field(default_factory=list)
    num_cached_blocks: list[int] = field(default_factory=list)
    shared_prefix_boundary: int = 0
    scheduled: bool = False  # its first allocation (the prefill) is done


class HybridPrefixCache(BlockPool):
    """vLLM's block pool shared by several KV cache groups, with prefix caching; pure, no I/O.

    The same surface as ``PrefixCache`` (``new_request``, ``admit``, ``allocate_slots``,
    ``cache_full_blocks``, ``free``, ``reset``, ``take_events``), so ``engine.run_request`` drives either.
    """

    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVCacheGroup]) -> None:
        super().__init__(num_blocks, block_size)
        groups = tuple(groups)
        # The hybrid coordinator's "simple hybrid": one full-attention group and one other. More groups need
        # the fixed-point loop and per-spec batching, which no model the simulator stands for has.
        if sorted(g.kind for g in groups) != [FULL_ATTENTION, SLIDING_WINDOW]:
            raise ValueError("a hybrid simulator has one full_attention and one sliding_window group")
        self.groups = groups
        self._full = next(i for i, g in enumerate(groups) if g.kind == FULL_ATTENTION)
        self._window = next(i for i, g in enumerate(groups) if g.kind == SLIDING_WINDOW)
        # (group, hash) -> blocks holding it, oldest first; a block's own key is in _key_of.
        self._cached: dict[tuple[int, int], dict[int, Block]] = {}
        self._key_of: dict[int, tuple[int, int]] = {}

    # ---- observations ----

    def cached_hashes(self, group: int) -> set[int]:
        return {h for g, h in self._cached if g == group}

    def free_queue_hashes(self) -> list[tuple[int, int] | None]:
        """Eviction order, head first: each free block's (group, hash), or None if it holds none."""
        return [self._key_of.get(b.block_id) for b in self._free.values()]

    def peak_blocks(self, num_tokens: int) -> int:
        """Blocks a request with KV for ``num_tokens`` tokens may hold at once: every group a slot per token
        (the window group frees its old blocks only from the step after the prefill)."""
        return len(self.groups) * -(-num_tokens // self.block_size)

    # ---- request life cycle ----

    def new_request(self, token_ids: Sequence[int]) -> HybridRequest:
        req = HybridRequest(token_ids=list(token_ids), num_prompt_tokens=len(token_ids),
                            blocks=[[] for _ in self.groups], num_cached_blocks=[0] * len(self.groups))
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size)
        return req

    def _get(self, group: int, block_hash: int) -> Block | None:
        holders = self._cached.get((group, block_hash))
        return next(iter(holders.values())) if holders else None

    def _full_hit(self, req: HybridRequest, max_tokens: int) -> list[Block]:
        """``FullAttentionManager.find_longest_cache_hit``: cached blocks from block 0 up to the first miss."""
        hits: list[Block] = []
        for h in req.block_hashes[: max_tokens // self.block_size]:
            block = self._get(self._full, h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _window_hit(self, req: HybridRequest, max_tokens: int) -> list[Block | None]:
        """``SlidingWindowManager.find_longest_cache_hit``: right to left, the first run of
        ``ceil((window - 1) / block)`` cached blocks ends the hit (blocks before it are null); with no such
        run, the cached run from block 0 (block size equals the hit alignment here, so no realignment)."""
        window = self.groups[self._window].sliding_window or 0
        need = -(-(window - 1) // self.block_size)
        n = max_tokens // self.block_size
        found: list[Block | None] = [None] * n
        run = 0
        for i in range(n - 1, -1, -1):
            block = self._get(self._window, req.block_hashes[i])
            if block is None:
                run = 0
                continue
            found[i] = block
            run += 1
            if run >= need:
                return found[: i + run]
        return found[:run]

    def find_longest_cache_hit(self, req: HybridRequest) -> tuple[list[list[Block | None]], int, int]:
        """Per-group hit blocks, the hit in tokens, and the shared-prefix boundary (0 if none)."""
        max_tokens = len(req.token_ids) - 1
        full = self._full_hit(req, max_tokens)
        longest = len(full) * self.block_size
        window = self._window_hit(req, longest)
        hit = len(window) * self.block_size
        hits: list[list[Block | None]] = [[] for _ in self.groups]
        hits[self._full] = list(full[: hit // self.block_size])
        hits[self._window] = window
        # get_computed_blocks: hit + (longest - hit) when the window group lags the full-attention one.
        return hits, hit, longest if longest > hit else 0

    def admit(self, req: HybridRequest) -> int:
        """Take the request's hit (touching the blocks inside the window); returns the cached token count."""
        if req.scheduled or any(req.blocks):
            raise ValueError("request already admitted")
        hits, hit, req.shared_prefix_boundary = self.find_longest_cache_hit(req)
        for g, group_hits in enumerate(hits):  # add_local_computed_blocks, group by group
            skipped = self._num_skipped_tokens(g, hit) // self.block_size
            kept = group_hits[skipped:]
            for block in kept:
                assert block is not None
                if block.ref_cnt == 0:
                    del self._free[block.block_id]
                block.ref_cnt += 1
            req.blocks[g] = [None] * skipped + list(kept)
            req.num_cached_blocks[g] = len(req.blocks[g])
        return hit

    def _num_skipped_tokens(self, group: int, num_computed_tokens: int) -> int:
        """``get_num_skipped_tokens``: tokens before the window of the next token (none for full attention)."""
        window = self.groups[group].sliding_window
        return 0 if window is None else max(0, num_computed_tokens - window + 1)

    def allocate_slots(self, req: HybridRequest, num_tokens: int) -> None:
        """``KVCacheManager.allocate_slots`` for ``num_tokens`` tokens in all: after the first step, free the
        window's skipped blocks (the tokens computed before this step), then give each group its slots."""
        if req.scheduled:
            self._remove_skipped_blocks(req, num_tokens - 1)
        need = sum(max(0, -(-num_tokens // self.block_size) - len(blocks)) for blocks in req.blocks)
        if need > len(self._free):
            raise PoolExhausted(f"need {need} free blocks, have {len(self._free)}")
        for blocks in req.blocks:  # allocate_new_blocks, group by group
            for _ in range(-(-num_tokens // self.block_size) - len(blocks)):
                _, block = self._free.popitem(last=False)
                self._evict(block)
                block.ref_cnt = 1
                blocks.append(block)
        req.scheduled = True

    def _remove_skipped_blocks(self, req: HybridRequest, processed_tokens: int) -> None:
        """``SingleTypeKVCacheManager.remove_skipped_blocks`` / ``_remove_blocks_in_range``: the blocks wholly
        before the window, last first, stopping at the first null block; freed as one list."""
        for g, blocks in enumerate(req.blocks):
            skipped = min(self._num_skipped_tokens(g, processed_tokens) // self.block_size, len(blocks))
            freed: list[Block] = []
            for i in range(skipped - 1, -1, -1):
                block = blocks[i]
                if block is None:
                    break
                freed.append(block)
                blocks[i] = None
            self._free_blocks(freed)

    def _reachable(self, req: HybridRequest, group: int, start: int, end: int) -> list[bool]:
        """``SlidingWindowManager.reachable_block_mask`` with retention interval 0 (vLLM 0.32's default) and
        no EAGLE: the ``need`` blocks ending at each boundary a later request can resume at."""
        window = self.groups[group].sliding_window or 0
        need = -(-(window - 1) // self.block_size)
        mask = [False] * (end - start)
        boundaries = [req.num_prompt_tokens - 1]  # replay_boundaries without EAGLE
        if req.shared_prefix_boundary:
            boundaries.append(req.shared_prefix_boundary)
        for boundary in boundaries:
            last = boundary // self.block_size  # alignment is the block size: one block size for all groups
            for j in range(max(start, last - need), min(end, last)):
                mask[j - start] = True
        return mask

    def cache_full_blocks(self, req: HybridRequest, num_tokens: int) -> None:
        """``KVCacheCoordinator.cache_blocks``: each group hashes its blocks completed within ``num_tokens``
        (the window group only its reachable ones) and sends one ``BlockStored``."""
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size)
        full = min(num_tokens, len(req.token_ids)) // self.block_size
        bs = self.block_size
        for g, group in enumerate(self.groups):
            start = req.num_cached_blocks[g]
            if full <= start:
                continue
            blocks = req.blocks[g]
            mask = self._reachable(req, g, start, full) if group.kind == SLIDING_WINDOW else [True] * (full - start)
            stored: list[int] = []
            for i in range(start, full):
                block = blocks[i]
                if block is None or not mask[i - start]:
                    continue
                key = (g, req.block_hashes[i])
                self._key_of[block.block_id] = key
                block.block_hash = req.block_hashes[i]
                self._cached.setdefault(key, {})[block.block_id] = block
                stored.append(req.block_hashes[i])
            req.num_cached_blocks[g] = full
            self._events.append(BlockStored(
                block_hashes=stored,
                parent_block_hash=req.block_hashes[start - 1] if start else None,
                token_ids=req.token_ids[start * bs: full * bs],
                block_size=bs,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[None] * len(stored) if stored else None,
                group_idx=g,
                kv_cache_spec_kind=group.kind,
                kv_cache_spec_sliding_window=group.sliding_window,
            ))

    def free(self, req: HybridRequest) -> None:
        """``KVCacheCoordinator.free``: group by group, each group's blocks last to first."""
        for blocks in req.blocks:
            self._free_blocks([b for b in reversed(blocks) if b is not None])
            blocks.clear()
        req.num_cached_blocks = [0] * len(self.groups)

    def _free_blocks(self, ordered: list[Block]) -> None:
        """``BlockPool.free_blocks``: unhashed blocks to the head (in the given order), hashed ones to the tail."""
        to_head: list[Block] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    to_head.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(to_head):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def reset(self) -> bool:
        """``BlockPool.reset_prefix_cache``: refused while a request holds blocks."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        self._key_of.clear()
        for block in self._blocks:
            block.block_hash = None
        self._events.append(AllBlocksCleared())
        return True

    def _evict(self, block: Block) -> None:
        """``BlockPool._maybe_evict_cached_block``: a reused block forgets its hash, announced per group."""
        key = self._key_of.pop(block.block_id, None)
        block.block_hash = None
        if key is None:
            return
        holders = self._cached.get(key)
        if holders is None or holders.pop(block.block_id, None) is None:
            return
        if not holders:
            del self._cached[key]
        self._events.append(BlockRemoved(block_hashes=[key[1]], medium=MEDIUM_GPU, group_idx=key[0]))
