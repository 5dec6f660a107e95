"""A prompt's multimodal items -> the extra element of each request key, as the ingester keys vLLM's events.

vLLM 0.32 keys an engine block of ``E`` tokens with one ``("mm", identifier, offset)`` per multimodal item
whose placeholder overlaps the block, in placeholder order (kv_cache_utils ``_gen_mm_extra_hash_keys``), and
publishes them per block as ``(identifier, offset)`` pairs. llm-d keys a request-key block with the
identifiers only (offsets dropped: ``[{"Hash": id}, ...]``, kvblock ``ParseRawExtraKeys``), and, where an
engine block spans several canonical blocks, gives each of them the engine block's identifiers
(``realignExtraFeatures``), or, where several engine blocks make one canonical block, their identifiers one
after the other. The one rule covering both, for any ratio, and what the ingester does
(ingester/bridge.py): canonical block ``k`` carries, in order, the identifiers of every engine block that
overlaps it. A block's identifiers therefore depend on the engine's block size, which the predictor reads
per pod (its meta's ``engine_block_size``), so a prompt with images is keyed once per engine block size.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec


class MultimodalItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One multimodal item of a prompt as the engine sees it: vLLM's ``MultiModalFeatureSpec.identifier``
    and its placeholder's ``PlaceholderRange`` (``offset``, ``length``) in the prompt's token ids (the ids
    the engine sees, placeholders expanded). vLLM's render step lists them as ``mm_hashes`` and
    ``mm_placeholders`` per modality; ``modality`` is accepted and not keyed."""

    identifier: Annotated[str, msgspec.Meta(min_length=1)]
    offset: Annotated[int, msgspec.Meta(ge=0)]
    length: Annotated[int, msgspec.Meta(ge=1)]
    modality: str | None = None


def checked_items(items: Sequence[MultimodalItem], n_tokens: int) -> list[MultimodalItem]:
    """The items in placeholder order; ValueError for placeholders that overlap or run past the prompt
    (vLLM refuses both: ``mm_placeholders must be globally non-overlapping and sorted`` / ``must remain within
    the token_ids sequence``)."""
    ordered = sorted(items, key=lambda i: (i.offset, i.length))
    end = 0
    for n, item in enumerate(ordered):
        if item.offset + item.length > n_tokens:
            raise ValueError(f"mm_items: item {item.identifier[:40]!r} (offset {item.offset}, length {item.length}) "
                             f"runs past the prompt's {n_tokens} tokens")
        if n and item.offset < end:
            raise ValueError(f"mm_items: item {item.identifier[:40]!r} at offset {item.offset} overlaps the one before "
                             f"it (ending at {end}); placeholders do not overlap")
        end = item.offset + item.length
    return ordered


def engine_block_ids(items: Sequence[MultimodalItem], engine_block: int, n_blocks: int) -> list[tuple[str, ...]]:
    """Per engine block ``j < n_blocks``, the identifiers of the items overlapping ``[j*E, (j+1)*E)`` in
    placeholder order: the identifiers of vLLM's ``("mm", identifier, offset)`` extra keys of that block.
    ``items`` sorted (``checked_items``)."""
    out: list[tuple[str, ...]] = [()] * n_blocks
    for item in items:
        first = item.offset // engine_block
        last = min((item.offset + item.length - 1) // engine_block, n_blocks - 1)
        for j in range(first, last + 1):
            out[j] = out[j] + (item.identifier,)
    return out


def canonical_extras(items: Sequence[MultimodalItem], n_tokens: int, canonical: int,
                     engine_block: int) -> list[list[str] | None] | None:
    """Per canonical block of the prompt, its multimodal identifiers (None: none), as the ingester keys the
    blocks of an engine whose blocks are ``engine_block`` tokens: the identifiers of each engine block that
    overlaps the canonical block, engine blocks in order. None when no block has any. ``items`` sorted."""
    if not items:
        return None
    n_canonical = n_tokens // canonical
    if not n_canonical:
        return None
    per_engine = engine_block_ids(items, engine_block, -(-(n_canonical * canonical) // engine_block))
    out: list[list[str] | None] = []
    for k in range(n_canonical):
        first, last = k * canonical // engine_block, ((k + 1) * canonical - 1) // engine_block
        ids = [i for j in range(first, last + 1) for i in per_engine[j]]
        out.append(ids or None)
    return out if any(out) else None


def with_salt(extras: list[list[str] | None] | None, cache_salt: str | None,
              n_canonical: int) -> list[list[str] | None] | None:
    """The salt after the first canonical block's identifiers, as vLLM orders its extra keys (``mm``, then
    ``cache_salt`` on the block starting at token 0) and llm-d-router folds it (``foldCacheSalt``)."""
    if not cache_salt or not n_canonical:
        return extras
    out = list(extras) if extras else [None] * n_canonical
    out[0] = [*(out[0] or ()), cache_salt]
    return out


__all__ = ["MultimodalItem", "canonical_extras", "checked_items", "engine_block_ids", "with_salt"]
