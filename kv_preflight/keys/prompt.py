"""A prompt's request keys as the predictor looks them up: model (or LoRA adapter), cache salt, multimodal items.

A text prompt has one chain of keys. A prompt with multimodal items has one per engine block size: a canonical
block carries the identifiers of every engine block overlapping it (keys/multimodal.py), so the same prompt is
keyed differently on an engine of 16-token blocks and one of 32. Each chain is computed when first asked for,
and engine block sizes that give the same identifiers share one.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_preflight.keys.chain import prompt_request_keys
from kv_preflight.keys.multimodal import MultimodalItem, canonical_extras


@dataclass
class PromptKeys:
    tokens: Sequence[int]
    model: str  # the chain's root: the model, or the LoRA adapter's name
    block_size: int  # canonical
    hash_seed: str = ""
    cache_salt: str | None = None
    items: Sequence[MultimodalItem] = ()  # sorted and checked (keys/multimodal.py ``checked_items``)
    hash_algo: str = "fnv64a"
    _chains: dict[tuple, list[int]] = field(default_factory=dict, repr=False)

    @property
    def keys(self) -> list[int]:
        """The chain for engine blocks of the canonical size (the only one of a text prompt). ValueError on a
        token id outside uint32."""
        return self.for_engine_block(self.block_size)

    def for_engine_block(self, engine_block: int | None) -> list[int]:
        """The chain as an engine with ``engine_block``-token blocks keys the prompt (None: the canonical size)."""
        extras = canonical_extras(self.items, len(self.tokens), self.block_size, engine_block or self.block_size) \
            if self.items else None
        shape = tuple(tuple(e) if e else () for e in extras) if extras else ()
        got = self._chains.get(shape)
        if got is None:
            got = self._chains[shape] = prompt_request_keys(
                self.tokens, model=self.model, hash_seed=self.hash_seed, block_size=self.block_size,
                cache_salt=self.cache_salt, extra_per_block=extras, hash_algo=self.hash_algo)
        return got


__all__ = ["PromptKeys"]
