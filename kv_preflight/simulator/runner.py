"""Runs requests through the pure engine one at a time and publishes each step's events.

This is the only place where the cache model meets time and sockets: a lock
serialises requests (the simulator's scheduler runs one request at a time), and
each step's batch is published before the next step starts, so sequence numbers
follow engine order as in vLLM.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kv_preflight.simulator.cache import PrefixCache
from kv_preflight.simulator.engine import Generation, run_request
from kv_preflight.simulator.hybrid_cache import HybridPrefixCache
from kv_preflight.simulator.publisher import EventPublisher


@dataclass
class EngineCounters:
    """What ``/metrics`` reports; plain numbers, updated only by the runner."""

    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0  # cancelled before they finished: the client went away (vLLM's finished_reason abort)


class EngineRunner:
    def __init__(
        self,
        cache: PrefixCache | HybridPrefixCache,
        publisher: EventPublisher,
        alphabet: Sequence[int],
        step_delay_s: float = 0.0,
    ) -> None:
        self.cache = cache
        self.publisher = publisher
        self.alphabet = tuple(alphabet)
        self.step_delay_s = step_delay_s
        self.counters = EngineCounters()
        self._lock = asyncio.Lock()

    def blocks_needed(self, num_prompt: int, max_tokens: int) -> int:
        """Blocks a request holds at most: KV for prompt + outputs - 1 tokens (in every KV cache group)."""
        return self.cache.peak_blocks(num_prompt + max_tokens - 1)

    async def generate(self, prompt_ids: list[int], max_tokens: int, lora: tuple[str, int] | None = None) -> Generation:
        """Run one request to completion (``lora``: its adapter's name and id); the caller has checked it fits."""
        self.counters.waiting += 1
        try:
            await self._lock.acquire()
        except asyncio.CancelledError:
            self.counters.requests_aborted += 1
            raise
        finally:
            self.counters.waiting -= 1
        gen = Generation(prompt_ids=list(prompt_ids), max_tokens=max_tokens, lora=lora)
        self.counters.running = 1
        steps = run_request(self.cache, gen, self.alphabet)
        try:
            for step in steps:
                if step.events:
                    await self.publisher.publish(step.events)
                if not step.finished:
                    # Yield between steps, as vLLM's engine core serves utility calls
                    # (reset_prefix_cache, metrics) between steps.
                    await asyncio.sleep(self.step_delay_s)
        except asyncio.CancelledError:
            self.counters.requests_aborted += 1
            raise
        finally:
            steps.close()  # frees the blocks if we were cancelled mid-request
            self.counters.running = 0
            self._lock.release()
        c = self.counters
        c.prompt_tokens += len(prompt_ids)
        c.generation_tokens += len(gen.output_ids)
        c.prefix_cache_queries += len(prompt_ids)
        c.prefix_cache_hits += gen.cached_tokens
        c.requests_finished += 1
        return gen

    def reset_prefix_cache(self) -> bool:
        """vLLM refuses while blocks are held; the AllBlocksCleared goes out with the next step's batch."""
        return self.cache.reset()
