"""Engine events -> index mutations: llm-d's dual-key bridge, as a pure function.

vLLM names blocks by *engine keys* (its own chained hashes, block size E, 32 on
CPU). llm-d's scheduler names them by *request keys* (FNV/CBOR chain, canonical
block size C, 16 by default). On BlockStored we recompute the request keys from
the event's ``token_ids``, chaining from the parent block's last request key, and
record engine key -> request keys, so a later BlockRemoved (engine key only) can
find the request keys to drop.

Ratios: when E is a multiple of C (the usual case) each engine block owns E/C
whole request keys. Otherwise an engine block may end mid-key; its leftover
tokens ("carry") are kept in ``ChainState`` so the next block can finish the key.
Carries live in memory only, so a child whose parent carried tokens and was seen
by another ingester process cannot be keyed; that is counted as an orphan.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kv_preflight.engines import ExtraKeys
from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.entries import CHAIN_ROOT, ClearPod, Mutation, RemoveBlock, StoreBlock, tier_of
from kv_preflight.keys.chain import chain_root, request_keys


class ChainPoint(msgspec.Struct, frozen=True, gc=False):  # one per stored block: cheaper to make than a dataclass,
    # and, holding scalars only, never tracked by the cycle collector (an LRU of up to 200,000 of them)
    """Where a chain stands after an engine block: its last request key and tokens not yet keyed; and the
    block's own request keys and the key before them, where they were computed here (a hybrid model's
    other groups cache some of the same blocks in events that do not say which: ``_plan_partial``)."""

    request_key: int
    carry: tuple[int, ...] = ()
    carry_known: bool = True  # False when resolved from Valkey, which stores no carry
    keys: tuple[int, ...] | None = None  # None: not known (resolved from Valkey)
    parent: int = CHAIN_ROOT


class ChainState:
    """Engine key -> ChainPoint, bounded LRU. Content-addressed, so safe to share across pods."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._points: OrderedDict[tuple[str, int], ChainPoint] = OrderedDict()

    def get(self, model: str, engine_key: int) -> ChainPoint | None:
        point = self._points.get((model, engine_key))
        if point is not None:
            self._points.move_to_end((model, engine_key))
        return point

    def put(self, model: str, engine_key: int, point: ChainPoint) -> None:
        key = (model, engine_key)
        points = self._points
        if key in points:
            points.move_to_end(key)
        points[key] = point  # a new key goes last already
        if len(points) > self.capacity:
            self._points.popitem(last=False)

    def __len__(self) -> int:
        return len(self._points)


@dataclass
class Plan:
    mutations: list[Mutation] = field(default_factory=list)
    engine_block_size: int | None = None
    # KV cache group -> its kind and sizes, as the events say them (vLLM 0.32: kv_cache_spec_kind and
    # kv_cache_spec_sliding_window on every BlockStored, filled in KVCacheManager.take_events)
    groups: dict[int, GroupSpec] = field(default_factory=dict)
    orphans: int = 0  # BlockStored events whose parent could not be resolved
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0


def model_for(event: BlockStored, topic_model: str, lora_names: Mapping[str, str] | None = None) -> str:
    """llm-d keys LoRA blocks by adapter name, as the engine does. Engines that send only a LoRA id
    (SGLang, TensorRT-LLM) are mapped by ``--lora-name ID=NAME``; an id nobody named is keyed under
    ``<model>:lora_id=<id>``, which no request asks for: never a false hit on the base model."""
    if event.lora_name:
        return event.lora_name
    if event.lora_id is None:
        return topic_model
    name = (lora_names or {}).get(str(event.lora_id))
    return name or f"{topic_model}:lora_id={event.lora_id}"


def unresolved_parents(batch: EventBatch, topic_model: str, state: ChainState,
                       lora_names: Mapping[str, str] | None = None) -> list[tuple[str, int]]:
    """(model, engine key) of parents that neither this batch nor the local state knows."""
    seen: set[int] = set()
    missing: list[tuple[str, int]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            p = ev.parent_block_hash
            model = model_for(ev, topic_model, lora_names)
            if p is not None and p not in seen and state.get(model, p) is None:
                missing.append((model, p))
            seen.update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            pass
    return list(dict.fromkeys(missing))


def _salt_first_block_only(per_block: list[Any], extra: Any, lora_name: str | None, extra_keys: ExtraKeys) -> list[Any]:
    """The salt keys the prompt's first canonical block only, as llm-d-router's request side folds it
    (preciseprefixcache ``foldCacheSalt``) and kv-preflight's predictor does (kv_preflight/keys/chain.py
    ``salted_request_keys``); multimodal identifiers stay on every canonical block of their engine block."""
    salt = extra_keys.cache_salt(extra, lora_name)
    if salt is None:
        return per_block
    rest = list(per_block[0])
    rest.reverse()
    rest.remove(salt)  # its last occurrence: the salt follows every other extra key of the block
    rest.reverse()
    return [rest + [salt]] + [rest or None] * (len(per_block) - 1)


def plan_batch(
    batch: EventBatch,
    *,
    pod_id: str,
    topic_model: str,
    state: ChainState,
    hash_seed: str,
    block_size: int,
    entry_field: Callable[[str, str | None, int | None], str],
    lora_names: Mapping[str, str] | None = None,
    hash_algo: str = "fnv64a",
    extra_keys: ExtraKeys | None,
    known: Known | None = None,
) -> Plan:
    """Mutations for one batch, in event order. ``state`` must already hold every parent
    that can be resolved (see ``unresolved_parents``); it is updated with new chain points.
    ``extra_keys``: how the engine's extra keys read (its adapter's, kv_preflight/engines/). ``known``: the
    request keys of a block the pod holds (its state in the index writer), for partial events."""
    plan = Plan()
    # A partial event's blocks are found among the batch's full events' (its group and the full-attention
    # group cache the same request's blocks in the same step; vLLM 0.32 sends the partial group first), so
    # those are planned first when there is one, and their mutations kept for their place in the batch.
    early: dict[int, Plan] = {}
    if any(isinstance(ev, BlockStored) and partial(ev) for ev in batch.events):
        for i, ev in enumerate(batch.events):
            if isinstance(ev, BlockStored) and not partial(ev):
                early[i] = Plan()
                _plan_stored(ev, early[i], pod_id, model_for(ev, topic_model, lora_names), state, hash_seed,
                             block_size, entry_field, hash_algo, extra_keys)
    for i, ev in enumerate(batch.events):
        if isinstance(ev, BlockStored):
            plan.engine_block_size = ev.block_size
            if ev.kv_cache_spec_kind:
                plan.groups[ev.group_idx or 0] = GroupSpec(ev.kv_cache_spec_kind, ev.block_size,
                                                           ev.kv_cache_spec_sliding_window)
            model = model_for(ev, topic_model, lora_names)
            if i in early:
                plan.mutations.extend(early[i].mutations)
                plan.orphans += early[i].orphans
                plan.stored_blocks += early[i].stored_blocks
            elif partial(ev):
                _plan_partial(ev, plan, pod_id, model, state, entry_field, known)
            else:
                _plan_stored(ev, plan, pod_id, model, state, hash_seed, block_size, entry_field, hash_algo,
                             extra_keys)
        elif isinstance(ev, BlockRemoved):
            tier = tier_of(ev.medium)
            plan.mutations.extend(RemoveBlock(ek, tier, ev.group_idx or 0) for ek in ev.block_hashes)
            plan.removed_blocks += len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            plan.mutations.append(ClearPod())
            plan.clears += 1
    return plan


def _plan_stored(
    ev: BlockStored, plan: Plan, pod_id: str, model: str, state: ChainState,
    hash_seed: str, block_size: int, entry_field: Callable[[str, str | None, int | None], str],
    hash_algo: str, extra_keys: ExtraKeys | None,
) -> None:
    if ev.parent_block_hash is None:
        point = ChainPoint(chain_root(model, hash_seed, hash_algo))
    else:
        point = state.get(model, ev.parent_block_hash)
        if point is None or (not point.carry_known and ev.block_size % block_size):
            # unknown parent; or E not a multiple of C and the parent's leftover tokens unknown
            plan.orphans += 1
            return
    tier = tier_of(ev.medium)
    fld = entry_field(pod_id, ev.medium, ev.group_idx)
    parentless = ev.parent_block_hash is None  # see StoreBlock.parentless
    # StoreBlock.parent: the request key the block's first key chains from (the chain root is none)
    parent = CHAIN_ROOT if parentless else point.request_key
    e = ev.block_size
    extras = (ev.extra_keys or []) if extra_keys is not None else []
    aligned = not point.carry and e % block_size == 0
    if aligned and hash_algo == "fnv64a" and not any(extra_keys.multimodal_ids(x) for x in extras):
        # Fast path: one C call keys the whole event.
        keys = request_keys(ev.token_ids[: len(ev.block_hashes) * e], model=model, hash_seed=hash_seed,
                            block_size=block_size, parent=point.request_key)
        per = e // block_size
        for i, ek in enumerate(ev.block_hashes):
            own = tuple(keys[i * per : (i + 1) * per])
            before = parent if i == 0 else keys[i * per - 1]
            plan.mutations.append(StoreBlock(ek, tier, fld, own, ev.group_idx or 0, parentless, before))
            state.put(model, ek, ChainPoint(own[-1] if own else point.request_key, keys=own, parent=before))
        plan.stored_blocks += len(ev.block_hashes)
        return
    for i, ek in enumerate(ev.block_hashes):
        pending = point.carry + tuple(ev.token_ids[i * e : (i + 1) * e])
        full = len(pending) // block_size * block_size
        mm = extra_keys.multimodal_ids(extras[i]) if i < len(extras) else None
        per_block = [mm] * (full // block_size) if mm else None
        if i == 0 and parentless and per_block:
            per_block = _salt_first_block_only(per_block, extras[0], ev.lora_name, extra_keys)
        own = request_keys(pending[:full], model=model, hash_seed=hash_seed, block_size=block_size,
                           parent=point.request_key, extra_per_block=per_block, hash_algo=hash_algo)
        point = ChainPoint(own[-1] if own else point.request_key, tuple(pending[full:]), keys=tuple(own),
                           parent=parent)
        plan.mutations.append(StoreBlock(ek, tier, fld, tuple(own), ev.group_idx or 0, parentless, parent))
        if own:
            parent = own[-1]
        state.put(model, ek, point)
        plan.stored_blocks += 1


def partial(ev: BlockStored) -> bool:
    """Whether an event has fewer hashes than full blocks of tokens: its group did not cache some blocks of
    the range (vLLM 0.32 ``BlockPool.cache_full_blocks`` skips a group's null blocks and those its
    ``reachable_block_mask`` leaves out: a sliding-window group keeps only the blocks ending at a boundary a
    later request can resume at) but the event carries the tokens of the whole range, and not which blocks
    its hashes are."""
    return ev.block_size > 0 and len(ev.block_hashes) < len(ev.token_ids) // ev.block_size


Known = Callable[[int], "tuple[tuple[int, ...], int | None] | None"]  # engine key -> (request keys, parent)


def _plan_partial(ev: BlockStored, plan: Plan, pod_id: str, model: str, state: ChainState,
                  entry_field: Callable[[str, str | None, int | None], str], known: Known | None = None) -> None:
    """A partial event's blocks, by their hashes: the same blocks of the same range are in the full-attention
    group's event (the same hash in every group: vLLM hashes tokens, not groups), planned first, or were met
    before; each takes the request keys computed there. A hash met nowhere is an orphan (the pod is flagged),
    never keyed by a guessed position."""
    tier = tier_of(ev.medium)
    fld = entry_field(pod_id, ev.medium, ev.group_idx)
    for ek in ev.block_hashes:
        point = state.get(model, ek)
        if point is None or point.keys is None:
            plan.orphans += 1
            continue
        plan.mutations.append(StoreBlock(ek, tier, fld, point.keys, ev.group_idx or 0,
                                         ev.parent_block_hash is None, point.parent))
        plan.stored_blocks += 1


def seed_state(state: ChainState, resolved: dict[tuple[str, int], int]) -> None:
    """Parents resolved from Valkey's engine map: aligned chain points (no carry is stored there)."""
    for (model, ek), rk in resolved.items():
        state.put(model, ek, ChainPoint(rk, carry_known=False))


__all__ = ["ChainPoint", "ChainState", "Plan", "plan_batch", "seed_state", "unresolved_parents", "Sequence"]
