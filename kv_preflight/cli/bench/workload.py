"""Synthetic but realistic inputs for the benchmark: prompts, and vLLM 0.32 KV-event batches.

The event stream models one vLLM engine per pod with 32-token (or ``engine_block``) engine blocks and a
bounded prefix cache: requests share a few system prompts, add a unique part,
decode some tokens, and finish; freed blocks are evicted tail first (as vLLM's
free queue does) when the pool is full. Each engine step becomes one batch with
the BlockStored events of that step (chained by ``parent_block_hash``) and one
BlockRemoved event per evicted block, exactly as vLLM 0.32 publishes them
(tests/fixtures/vllm-0.32-live-frames.jsonl), encoded to wire frames.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass

from kv_preflight.events import BlockRemoved, BlockStored, EventBatch, encode_frames, make_topic

ENGINE_BLOCK = 32
VOCAB = 151_000


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _engine_hash(parent: int | None, toks: list[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in toks))
    return int.from_bytes(h.digest(), "little")


@dataclass
class _Request:
    blocks: list[int]  # engine hashes, in chain order
    tokens: list[int]
    decode_left: int
    pending: list[int]  # decoded tokens not yet in a full block


class EngineModel:
    """A pod's prefix cache with vLLM-like storage and eviction, emitting event batches."""

    def __init__(self, pod: str, model: str, *, capacity_blocks: int, system_prompts: list[list[int]], seed: int,
                 engine_block: int = ENGINE_BLOCK):
        self.pod, self.model = pod, model
        self.engine_block = engine_block
        self.evicted = 0  # blocks evicted so far (the cache is at steady state once this is > 0)
        self.topic = make_topic(pod, model)
        self.capacity = capacity_blocks
        self.system_prompts = system_prompts
        self.rng = random.Random(seed)
        self.cached: dict[int, int] = {}  # engine hash -> refcount
        self.free: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self.children: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self.running: list[_Request] = []
        self.seq = -1
        self.ts = 1_700_000_000.0
        self.prompts: list[list[int]] = []  # a sample of admitted prompts, to look up afterwards

    def _lookup_or_store(self, parent: int | None, chunk: list[int], stored: list[tuple[int, list[int]]]) -> int:
        key = (parent, tuple(chunk))
        h = self.children.get(key)
        if h is not None and h in self.cached:
            if self.cached[h] == 0:
                self.free.pop(h, None)
            self.cached[h] += 1
            return h
        h = _engine_hash(parent, chunk)
        self.children[key] = h
        self.cached[h] = 1
        stored.append((h, chunk))
        return h

    def _events_for(self, stored_runs: list[tuple[int | None, list[tuple[int, list[int]]]]]) -> list:
        out = []
        for parent, run in stored_runs:
            if not run:
                continue
            hashes = [h for h, _ in run]
            toks = [t for _, c in run for t in c]
            out.append(BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=toks, block_size=self.engine_block,
                lora_id=None, medium="GPU", lora_name=None, extra_keys=[None] * len(hashes), group_idx=0,
                kv_cache_spec_kind="full_attention",
            ))
        return out

    def _admit(self, stored_runs) -> None:
        sp = self.rng.choice(self.system_prompts)
        user = tokens(self.rng.choice((256, 512, 1024, 2048)), self.rng.randrange(1 << 30))
        toks = sp + user
        if len(self.prompts) < 100:
            self.prompts.append(toks)
        parent: int | None = None
        blocks: list[int] = []
        run: list[tuple[int, list[int]]] = []
        run_parent: int | None = None
        eb = self.engine_block
        for i in range(len(toks) // eb):
            chunk = toks[i * eb:(i + 1) * eb]
            new: list[tuple[int, list[int]]] = []
            h = self._lookup_or_store(parent, chunk, new)
            if new:
                if not run:
                    run_parent = parent
                run.extend(new)
            parent = h
            blocks.append(h)
        stored_runs.append((run_parent, run))
        rem = toks[len(blocks) * eb:]
        self.running.append(_Request(blocks, toks, self.rng.choice((64, 128, 256)), rem))

    def _release(self, req: _Request) -> None:
        for h in reversed(req.blocks):  # tail first: evicted before the shared prefix
            self.cached[h] -= 1
            if self.cached[h] == 0:
                self.free[h] = None

    def _evict(self) -> list[int]:
        out = []
        while len(self.cached) > self.capacity and self.free:
            h, _ = self.free.popitem(last=False)
            del self.cached[h]
            out.append(h)
        self.evicted += len(out)
        return out

    def step(self) -> EventBatch:
        stored_runs: list = []
        if len(self.running) < 8 or self.rng.random() < 0.3:
            self._admit(stored_runs)
        still = []
        for req in self.running:
            req.pending += tokens(16, self.rng.randrange(1 << 30))
            req.decode_left -= 16
            while len(req.pending) >= self.engine_block:
                chunk, req.pending = req.pending[:self.engine_block], req.pending[self.engine_block:]
                new: list[tuple[int, list[int]]] = []
                h = self._lookup_or_store(req.blocks[-1] if req.blocks else None, chunk, new)
                stored_runs.append((req.blocks[-1] if req.blocks else None, new))
                req.blocks.append(h)
            if req.decode_left <= 0:
                self._release(req)
            else:
                still.append(req)
        self.running = still
        events = [BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0) for h in self._evict()]
        events += self._events_for(stored_runs)
        self.seq += 1
        self.ts += 0.05
        return EventBatch(ts=self.ts, events=events, data_parallel_rank=0)


@dataclass
class Stream:
    frames: list[tuple[str, list[bytes]]]  # (pod, [topic, seq, payload]) in publish order
    batches: int
    stored_blocks: int
    removed_blocks: int
    prompts: list[list[int]]  # prompts the engines served (a sample)
    last_seq: dict[str, int]  # pod -> seq of its last batch
    warm_frames: int = 0  # frames until every engine's cache was full (it evicted): the steady state after


def event_stream(*, pods: int, target_blocks: int, capacity_blocks: int = 6000, model: str = "bench-model",
                 seed: int = 7, engine_block: int = ENGINE_BLOCK, steady_blocks: int = 0) -> Stream:
    """Interleaved batches of ``pods`` engines until about ``target_blocks`` engine blocks were stored, or
    with ``steady_blocks``, until that many block events (stores and evictions) followed the moment every
    engine's cache was full."""
    rng = random.Random(seed)
    system = [tokens(rng.choice((512, 1024, 2048)), seed * 100 + i) for i in range(6)]
    engines = [EngineModel(f"bench-pod-{i}", model, capacity_blocks=capacity_blocks, system_prompts=system,
                           seed=seed + i, engine_block=engine_block) for i in range(pods)]
    frames: list[tuple[str, list[bytes]]] = []
    stored = removed = 0
    warm, at_warm = 0, 0

    def more() -> bool:
        if steady_blocks:
            return not warm or stored + removed - at_warm < steady_blocks
        return stored < target_blocks

    while more():
        if not warm and all(e.evicted for e in engines):
            warm, at_warm = len(frames), stored + removed
        for eng in engines:
            b = eng.step()
            for ev in b.events:
                if isinstance(ev, BlockStored):
                    stored += len(ev.block_hashes)
                else:
                    removed += len(ev.block_hashes)
            frames.append((eng.pod, encode_frames(eng.topic, eng.seq, b)))
    return Stream(frames, len(frames), stored, removed, [p for e in engines for p in e.prompts],
                  {e.pod: e.seq for e in engines}, warm)
