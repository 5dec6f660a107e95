"""The prefix cache of one vLLM (v1) engine, as a pure model: blocks, hashes, LRU order, events.

Written from vLLM 0.32's observable behaviour (its KV events and ``cached_tokens``),
checked against a real engine by ``tests/e2e/test_simulator_parity.py``. The rules
that decide what hits and what gets evicted:

* The pool has ``num_blocks`` blocks; block 0 is vLLM's reserved null block, so
  ``num_blocks - 1`` hold KV.
* Only full blocks are cached. A block's hash chains over its parent's hash and
  its tokens, so a prefix hit is the longest run of cached hashes from block 0.
* The last token of a request is always recomputed (its logits are needed), so
  a hit covers at most ``num_tokens - 1`` tokens, rounded down to whole blocks.
  A prompt of exactly ``k`` cached blocks therefore re-stores block ``k``: the
  hash map then holds two blocks for one hash, and each is announced (stored,
  later removed) on its own, as vLLM does.
* Free blocks wait in one queue in eviction order. A finished request frees its
  blocks last-to-first: hashed blocks join the tail (so its *last* blocks are
  evicted first), unhashed ones the head (reused before any cached block).
  A hit takes its blocks out of the queue; an allocation pops the head and, if
  that block was cached, forgets its hash and emits ``BlockRemoved``.
* Every new full block is announced with one ``BlockStored`` per caching call,
  after the removals its allocation caused.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

MEDIUM_GPU = "GPU"  # vLLM 0.32 tags device-resident blocks so
GROUP_IDX = 0  # one KV-cache group: a plain full-attention decoder
SPEC_KIND = "full_attention"
_ROOT = b"kv-preflight-simulator-root"


def chain_hash(parent: int | None, tokens: Sequence[int], lora: str | None = None) -> int:
    """A 64-bit content hash of one block: parent hash + token ids, and a LoRA adapter's name, which vLLM hashes
    into every block of an adapter's request (not vLLM's hash, but equally chained and keyed)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(_ROOT if parent is None else parent.to_bytes(8, "big"))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    if lora is not None:
        h.update(b"lora:" + lora.encode())
    return int.from_bytes(h.digest(), "big")


def extend_block_hashes(hashes: list[int], tokens: Sequence[int], block_size: int, lora: str | None = None) -> None:
    """Hash every full block of ``tokens`` not yet in ``hashes`` (decode output grows them)."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(chain_hash(parent, tokens[i * block_size : (i + 1) * block_size], lora))


@dataclass(eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


@dataclass(eq=False)
class RequestBlocks:
    """What the pool tracks for one running request: its tokens, their block hashes, its blocks."""

    token_ids: list[int]
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already in the hash map (hits or stored)
    lora: tuple[str, int] | None = None  # the LoRA adapter's name and id, for an adapter's request


class BlockPool:
    """vLLM's block pool, what both prefix caches (this one and hybrid_cache.py's) share: the blocks, the free
    queue, and the events, which accumulate until ``take_events`` (the engine publishes them once per step, as
    vLLM's scheduler does)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (one is vLLM's reserved null block)")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        # Block 0 is the null block: never free, never cached.
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self._blocks[1:])
        self._events: list[Event] = []

    @property
    def num_free_blocks(self) -> int:
        """Free includes cached-but-unused blocks: they are eviction candidates."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: blocks held by requests over usable blocks."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events


class PrefixCache(BlockPool):
    """vLLM's block pool with prefix caching, one request at a time or many; no I/O."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # hash -> blocks holding it, oldest first (a hit uses the oldest).
        self._cached: dict[int, dict[int, Block]] = {}

    # ---- observations ----

    def cached_hashes(self) -> set[int]:
        return set(self._cached)

    def free_queue_hashes(self) -> list[int | None]:
        """Eviction order, head first (tests compare it with the rules above)."""
        return [b.block_hash for b in self._free.values()]

    # ---- request life cycle ----

    def new_request(self, token_ids: Sequence[int], lora: tuple[str, int] | None = None) -> RequestBlocks:
        """``lora``: the adapter's name and id, for a request naming a LoRA adapter."""
        req = RequestBlocks(token_ids=list(token_ids), lora=lora)
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, lora[0] if lora else None)
        return req

    def find_cached_prefix(self, req: RequestBlocks) -> list[Block]:
        """The longest cached run of the request's blocks, leaving the last token to recompute."""
        limit = (len(req.token_ids) - 1) // self.block_size
        hits: list[Block] = []
        for h in req.block_hashes[:limit]:
            holders = self._cached.get(h)
            if not holders:
                break
            hits.append(next(iter(holders.values())))
        return hits

    def admit(self, req: RequestBlocks) -> int:
        """Take the request's prefix hit (out of the free queue); returns the cached token count."""
        if req.blocks:
            raise ValueError("request already admitted")
        hits = self.find_cached_prefix(req)
        for block in hits:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
        req.blocks.extend(hits)
        req.num_cached_blocks = len(hits)
        return len(hits) * self.block_size

    def peak_blocks(self, num_tokens: int) -> int:
        """Blocks a request with KV for ``num_tokens`` tokens holds at its end."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, req: RequestBlocks, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(req.blocks))

    def allocate_slots(self, req: RequestBlocks, num_tokens: int) -> None:
        """Give the request room for ``num_tokens`` tokens, evicting from the head as needed."""
        need = self.blocks_needed(req, num_tokens)
        if need > len(self._free):
            raise PoolExhausted(f"need {need} free blocks, have {len(self._free)}")
        for _ in range(need):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            req.blocks.append(block)

    def cache_full_blocks(self, req: RequestBlocks, num_tokens: int) -> None:
        """Hash-map every block completed within the first ``num_tokens`` tokens; one BlockStored."""
        name = req.lora[0] if req.lora else None
        extend_block_hashes(req.block_hashes, req.token_ids, self.block_size, name)
        full = min(num_tokens, len(req.token_ids)) // self.block_size
        start = req.num_cached_blocks
        if full <= start:
            return
        new_hashes = req.block_hashes[start:full]
        for block, h in zip(req.blocks[start:full], new_hashes):
            block.block_hash = h
            self._cached.setdefault(h, {})[block.block_id] = block
        req.num_cached_blocks = full
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=list(new_hashes),
                parent_block_hash=req.block_hashes[start - 1] if start else None,
                token_ids=req.token_ids[start * bs : full * bs],
                block_size=bs,
                lora_id=req.lora[1] if req.lora else None,
                medium=MEDIUM_GPU,
                lora_name=name,
                # vLLM 0.32: the adapter's name, untagged, first in every block's extra keys
                extra_keys=[[name] if name else None for _ in new_hashes],
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=SPEC_KIND,
            )
        )

    def free(self, req: RequestBlocks) -> None:
        """Release the request's blocks last-to-first; cached ones become LRU eviction candidates."""
        to_tail: list[Block] = []
        to_head: list[Block] = []
        for block in reversed(req.blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (to_head if block.block_hash is None else to_tail).append(block)
        for block in reversed(to_head):  # keep their order, all ahead of the old head
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)
        for block in to_tail:
            self._free[block.block_id] = block
        req.blocks.clear()
        req.num_cached_blocks = 0

    def reset(self) -> bool:
        """Forget every hash, as ``POST /reset_prefix_cache``; refused while a request holds blocks."""
        if len(self._free) != self.num_blocks - 1:
            return False
        self._cached.clear()
        for block in self._blocks:
            block.block_hash = None
        self._events.append(AllBlocksCleared())
        return True

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        h = block.block_hash
        holders = self._cached.get(h)
        block.block_hash = None
        if holders is None or holders.pop(block.block_id, None) is None:
            return
        if not holders:
            del self._cached[h]
        self._events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=GROUP_IDX))


class PoolExhausted(RuntimeError):
    """A request needs more blocks than are free (vLLM would preempt or queue it)."""
