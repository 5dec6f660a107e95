"""One request's life in the engine, step by step, as vLLM 0.32 schedules it; pure and deterministic.

Step 1 (prefill) takes the prefix hit, allocates slots for the whole prompt (one
chunk: prompts fit ``max_num_batched_tokens``), caches its full blocks and samples
the first output token. Each decode step computes the previous output token's KV,
so after ``max_tokens`` outputs ``num_prompt + max_tokens - 1`` tokens have KV:
decode blocks that fill up are cached too (observed: prompt 40 + 25 outputs
stores 2 blocks, + 24 outputs stores 1). The events of each step are one batch.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kv_preflight.events import Event
from kv_preflight.simulator.cache import PrefixCache, RequestBlocks
from kv_preflight.simulator.hybrid_cache import HybridPrefixCache, HybridRequest


@dataclass(frozen=True)
class Step:
    """What one engine step changed: the batch to publish (maybe empty) and whether the request ended."""

    events: list[Event]
    finished: bool


@dataclass
class Generation:
    """The running request as the HTTP layer sees it; ``output_ids`` grows one token per step."""

    prompt_ids: list[int]
    max_tokens: int
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    lora: tuple[str, int] | None = None  # the LoRA adapter's name and id, when the request names one


def output_token(prompt_ids: Sequence[int], index: int, alphabet: Sequence[int]) -> int:
    """The ``index``-th generated token: a function of the prompt only, so reruns repeat it."""
    digest = hashlib.blake2b(repr((len(prompt_ids), prompt_ids[-64:], index)).encode(), digest_size=4).digest()
    return alphabet[int.from_bytes(digest, "big") % len(alphabet)]


def run_request(cache: PrefixCache | HybridPrefixCache, gen: Generation, alphabet: Sequence[int]) -> Iterator[Step]:
    """Drive ``gen`` to completion, one yielded Step per engine step.

    The blocks are freed when the generator finishes or is closed early (a client
    that went away), exactly once either way.
    """
    if gen.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    req: RequestBlocks | HybridRequest = (cache.new_request(gen.prompt_ids, gen.lora) if gen.lora
                                          else cache.new_request(gen.prompt_ids))
    gen.cached_tokens = cache.admit(req)
    try:
        num_prompt = len(gen.prompt_ids)
        cache.allocate_slots(req, num_prompt)
        cache.cache_full_blocks(req, num_prompt)
        while True:
            token = output_token(gen.prompt_ids, len(gen.output_ids), alphabet)
            gen.output_ids.append(token)
            finished = len(gen.output_ids) >= gen.max_tokens
            if finished:
                break
            yield Step(cache.take_events(), finished=False)
            # Decode: the token just sampled gets its KV computed (and a slot) now.
            req.token_ids.append(token)
            computed = len(req.token_ids)
            cache.allocate_slots(req, computed)
            cache.cache_full_blocks(req, computed)
    finally:
        cache.free(req)
    yield Step(cache.take_events(), finished=True)
