"""Engine events -> index mutations: llm-d's dual-key bridge, as a pure function.

vLLM names blocks by *engine keys* (its own chained hashes, block size E, 32 on
CPU). llm-d's scheduler names them by *request keys* (FNV/CBOR chain, canonical
block size C, 16 by default). On BlockStored we recompute the request keys from
the event's ``token_ids``, chaining from the parent block's last request key, and
record engine key -> request keys (in the pod's state, kv_preflight/index/pod_state.py, and llm-d's
``engine:<key>``), so a later BlockRemoved (engine key only) can find the request keys to drop.

A parent is found among the blocks planned with its batch (``ChainState``: the pipeline's runs in flight, which
neither the pod's state nor Valkey holds yet), else in the pod's state (``seed_held``), else in Valkey's
``engine:<parent>`` (``seed_state``); else the child is an orphan.

Ratios: when E is a multiple of C (the usual case) each engine block owns E/C
whole request keys. Otherwise an engine block may end mid-key; its leftover
tokens ("carry", ``Carry``) go with the batch into the pod's state (``Plan.carries`` -> ``PodState.carries``),
which persists them in its log beside the block, so the next block can finish the key whichever process
plans it (a new ingester after a kill -9, another taking the pod over). Only Valkey's engine map holds no
carry: a child whose parent is found only there, with E not a multiple of C, is an orphan.
"""
from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kv_preflight.engines import BlockExtras, ExtraKeys
from kv_preflight.engines.hit_rules import GroupSpec
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.entries import CHAIN_ROOT, Carry, ClearPod, Mutation, RemoveBlock, StoreBlock, tier_of
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
    # where ``carry`` is not empty: the extra-key ids of the engine blocks its tokens came from (the canonical
    # block they start overlaps those blocks too), and the salt of a prompt whose first canonical block is not
    # complete yet (engine blocks smaller than canonical ones)
    carry_ids: tuple[str, ...] = ()
    salt: str | None = None


class ChainState:
    """Engine key -> ChainPoint of the blocks planned with a batch (the pipeline's runs, ingester/pipeline.py),
    or found for them; a bounded LRU. Content-addressed, so safe to share across pods."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._points: OrderedDict[tuple[str, int], ChainPoint] = OrderedDict()

    def get(self, model: str, engine_key: int) -> ChainPoint | None:
        key = (model, engine_key)
        points = self._points
        point = points.get(key)
        if point is not None:
            points.move_to_end(key)
        return point

    def put(self, model: str, engine_key: int, point: ChainPoint) -> None:
        key = (model, engine_key)
        points = self._points
        if key in points:
            points.move_to_end(key)
        points[key] = point  # a new key goes last already
        if len(points) > self.capacity:
            self._points.popitem(last=False)

    def put_many(self, model: str, engine_keys: Sequence[int], points: Sequence[ChainPoint]) -> None:
        """``put`` of each (engine key, point) in turn, in one call (an event's blocks: the write path's
        commonest state change). The capacity is trimmed once, at the end: the map never holds more than
        ``capacity`` between calls (set once, when made), so that leaves the same points in the same LRU order
        as trimming after each put: the ``capacity`` most recently put or got, oldest first."""
        store = self._points
        move_to_end = store.move_to_end
        for engine_key, point in zip(engine_keys, points):
            key = (model, engine_key)
            if key in store:
                move_to_end(key)
            store[key] = point
        while len(store) > self.capacity:
            store.popitem(last=False)

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
    # engine key -> what each block planned with E not a multiple of C (or ending mid key) left unkeyed: for the
    # pod's state to keep and persist (PodState.carries), for a child planned later
    carries: dict[int, Carry] = field(default_factory=dict)
    # LoRA adapters whose blocks the batch stores (their names, as the blocks are keyed): the index records them
    # per pod (layout.py ADAPTERS_KEY), so a predictor knows an adapter from the events alone
    adapters: set[str] = field(default_factory=set)
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


def adapter_of(event: BlockStored, lora_names: Mapping[str, str] | None = None) -> str | None:
    """The LoRA adapter an event's blocks belong to, by the name a request gives it (``model_for``); None for
    the base model's, and for an id nobody named (keyed under a name no request asks for)."""
    if event.lora_name:
        return event.lora_name
    if event.lora_id is None:
        return None
    return (lora_names or {}).get(str(event.lora_id))


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
    return list(dict.fromkeys(missing))


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
    mutations = plan.mutations
    events = batch.events

    def store(ev: BlockStored, into: Plan) -> None:
        _plan_stored(ev, into, pod_id, model_for(ev, topic_model, lora_names), state, hash_seed, block_size,
                     entry_field, hash_algo, extra_keys)

    ahead: dict[int, Plan] | None = None  # the full events after the first partial one, planned ahead of it
    for i, ev in enumerate(events):
        if isinstance(ev, BlockRemoved):  # first: the commonest event (an eviction, one block each)
            tier, group = tier_of(ev.medium), ev.group_idx or 0
            for ek in ev.block_hashes:
                mutations.append(RemoveBlock(ek, tier, group))
            plan.removed_blocks += len(ev.block_hashes)
        elif isinstance(ev, BlockStored):
            plan.engine_block_size = ev.block_size
            if ev.lora_name or ev.lora_id is not None:
                adapter = adapter_of(ev, lora_names)
                if adapter and adapter != topic_model:
                    plan.adapters.add(adapter)
            if ev.kv_cache_spec_kind:
                plan.groups[ev.group_idx or 0] = _group_spec(ev.kv_cache_spec_kind, ev.block_size,
                                                             ev.kv_cache_spec_sliding_window)
            if ahead is not None and i in ahead:
                _take(plan, ahead[i])
            elif partial(ev):
                if ahead is None:
                    ahead = _plan_ahead(events, i + 1, store)
                _plan_partial(ev, plan, pod_id, model_for(ev, topic_model, lora_names), state, entry_field, known)
            else:
                store(ev, plan)
        elif isinstance(ev, AllBlocksCleared):
            mutations.append(ClearPod())
            plan.clears += 1
    return plan


def _plan_ahead(events: Sequence[Any], start: int, store: Callable[[BlockStored, Plan], None]) -> dict[int, Plan]:
    """The full BlockStored events from ``start`` on, each planned into a Plan of its own, by index. A partial
    event's blocks are found among the batch's full events' (its group and the full-attention group cache the
    same request's blocks in the same step; vLLM 0.32 sends the partial group first), so at the batch's first
    partial event the full events after it are planned ahead (every full event before it already is), and
    their mutations kept for their place in the batch. Done only then: most batches have no partial event, and
    this way they are walked once."""
    ahead: dict[int, Plan] = {}
    for j in range(start, len(events)):
        ev = events[j]
        if isinstance(ev, BlockStored) and not partial(ev):
            ahead[j] = Plan()
            store(ev, ahead[j])
    return ahead


def _take(plan: Plan, planned: Plan) -> None:
    """A full event's Plan, planned ahead (``_plan_ahead``), into the batch's at the event's place."""
    plan.mutations.extend(planned.mutations)
    plan.orphans += planned.orphans
    plan.stored_blocks += planned.stored_blocks
    plan.carries.update(planned.carries)


@functools.lru_cache(maxsize=256)
def _group_spec(kind: str, block_size: int, sliding_window: int | None) -> GroupSpec:
    """A KV cache group's spec as every BlockStored of the group repeats it: one frozen GroupSpec per distinct
    triple, not one made per event (its ``__post_init__`` costs more than the event's other fields)."""
    return GroupSpec(kind, block_size, sliding_window)


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
    read = _read_extras(ev, extra_keys)
    aligned = not point.carry and e % block_size == 0
    if aligned and hash_algo == "fnv64a" and read is None:
        # Fast path: one C call keys the whole event.
        keys = request_keys(ev.token_ids[: len(ev.block_hashes) * e], model=model, hash_seed=hash_seed,
                            block_size=block_size, parent=point.request_key)
        per = e // block_size
        if per and len(keys) == len(ev.block_hashes) * per:  # else malformed (fewer tokens than blocks, or 0-token
            # blocks): planned block by block below
            _store_keyed(plan, state, model, ev.block_hashes, keys, per, parent, tier, fld, ev.group_idx or 0,
                         parentless)
            return
        for i, ek in enumerate(ev.block_hashes):
            own = tuple(keys[i * per : (i + 1) * per])
            before = parent if i == 0 else keys[i * per - 1]
            plan.mutations.append(StoreBlock(ek, tier, fld, own, ev.group_idx or 0, parentless, before))
            state.put(model, ek, ChainPoint(own[-1] if own else point.request_key, keys=own, parent=before))
        plan.stored_blocks += len(ev.block_hashes)
        return
    # The salt keys the prompt's first canonical block only, after its identifiers, as llm-d-router's request
    # side folds it (preciseprefixcache ``foldCacheSalt``) and the predictor keys it (keys/chain.py
    # ``prompt_request_keys``); vLLM sends it in the extra keys of the block starting at token 0.
    salt = point.salt
    if parentless and read and read[0] is not None:
        salt = read[0].salt
    for i, ek in enumerate(ev.block_hashes):
        pending = point.carry + tuple(ev.token_ids[i * e : (i + 1) * e])
        n = len(pending) // block_size
        ids = read[i].ids if read and i < len(read) and read[i] is not None else ()
        per_block = None
        if n and (ids or point.carry_ids or salt):
            # canonical block k carries the ids of every engine block overlapping it (keys/multimodal.py): the
            # first, begun in the carry, those of the carry's blocks and this one's; the others this one's
            first = list(point.carry_ids + ids) if point.carry else list(ids)
            per_block = [first or None] + [list(ids) or None] * (n - 1)
            if salt:
                per_block[0] = [*(per_block[0] or ()), salt]
                salt = None
        own = request_keys(pending[:n * block_size], model=model, hash_seed=hash_seed, block_size=block_size,
                           parent=point.request_key, extra_per_block=per_block, hash_algo=hash_algo)
        left = tuple(pending[n * block_size:])
        carry_ids = (point.carry_ids + ids if not n and point.carry else ids) if left else ()
        point = ChainPoint(own[-1] if own else point.request_key, left, keys=tuple(own), parent=parent,
                           carry_ids=carry_ids, salt=salt if left else None)
        plan.mutations.append(StoreBlock(ek, tier, fld, tuple(own), ev.group_idx or 0, parentless, parent))
        if own:
            parent = own[-1]
        state.put(model, ek, point)
        if left or e % block_size:
            plan.carries[ek] = Carry(left, carry_ids, point.salt)
        plan.stored_blocks += 1


def _read_extras(ev: BlockStored, extra_keys: ExtraKeys | None) -> list[BlockExtras | None] | None:
    """Each engine block's extra keys read (its adapter's name aside), or None when no block has any. vLLM sends a
    None for each block without extra keys (every block of a text-only prompt): an event of those only is
    answered at C speed, without asking the engine's adapter once per block."""
    extras = ev.extra_keys
    if extra_keys is None or not extras or not any(extras):
        return None
    read = [extra_keys.read(x, ev.lora_name) if x else None for x in extras]
    return read if any(read) else None


def _store_keyed(plan: Plan, state: ChainState, model: str, engine_keys: list[int], keys: list[int], per: int,
                 parent: int, tier: str, fld: str, group: int, parentless: bool) -> None:
    """An aligned event's blocks, its request keys computed in one piece: engine block i owns ``keys[i*per :
    (i+1)*per]`` and chains from the key before them (the first from ``parent``). The write path's commonest
    work (a StoreBlock and a ChainPoint per engine block), so one loop with everything bound locally and the
    points put in the chain state in one call, in block order: the same mutations and state as a put per block."""
    if len(engine_keys) == 1:  # a decode step's block, the commonest event: cheaper without the loop's set-up
        own = tuple(keys)
        plan.mutations.append(StoreBlock(engine_keys[0], tier, fld, own, group, parentless, parent))
        state.put(model, engine_keys[0], ChainPoint(own[-1], keys=own, parent=parent))
        plan.stored_blocks += 1
        return
    append = plan.mutations.append
    points: list[ChainPoint] = []
    add = points.append
    before = parent
    for ek, own in zip(engine_keys, zip(*[iter(keys)] * per)):  # own: the next ``per`` keys
        append(StoreBlock(ek, tier, fld, own, group, parentless, before))
        end = own[-1]
        add(ChainPoint(end, keys=own, parent=before))
        before = end
    state.put_many(model, engine_keys, points)
    plan.stored_blocks += len(engine_keys)


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
    parentless = ev.parent_block_hash is None
    for ek in ev.block_hashes:
        point = state.get(model, ek)
        if point is not None and point.keys is not None:
            keys, parent = point.keys, point.parent
        else:  # not met by this process lately (restarted, its LRU full): a block the pod itself holds
            held = known(ek) if known is not None else None
            if held is None:
                plan.orphans += 1
                continue
            keys, parent = held
        plan.mutations.append(StoreBlock(ek, tier, fld, keys, ev.group_idx or 0, parentless, parent))
        plan.stored_blocks += 1


def seed_held(state: ChainState, missing: Sequence[tuple[str, int]], known: Known,
              carries: Mapping[int, Carry], root: Callable[[str], int]) -> list[tuple[str, int]]:
    """Parents not planned with the batch that the pod itself holds: taken from the pod's own state (the index
    writer's, ``known``), which holds every block the pod holds, loaded from its log, and what those that ended
    mid key left unkeyed (``carries``, ``PodState.carries``); put in ``state`` as chain points. ``root``: a
    model's chain root (where a block that keyed nothing chains from, when it starts its chain). Returns those
    it does not hold, for Valkey's engine map. A block keyed before its parent was, and with no carry (no request
    key of its own: engine blocks smaller than canonical ones), leaves its chain's last key unknown here:
    Valkey's."""
    rest = []
    for model, ek in missing:
        held = known(ek)
        if held is None:
            rest.append((model, ek))
            continue
        rks, parent = held
        carry = carries.get(ek)
        if carry is not None and (rks or parent is not None):
            # the chain stands at the block's last key, or, where it keyed none, at the key it chains from
            last = rks[-1] if rks else root(model) if parent == CHAIN_ROOT else parent
            state.put(model, ek, ChainPoint(last, carry.tokens, keys=rks if parent is not None else None,
                                            parent=parent if parent is not None else CHAIN_ROOT,
                                            carry_ids=carry.ids, salt=carry.salt))
            continue
        if not rks:
            rest.append((model, ek))
            continue
        state.put(model, ek, ChainPoint(rks[-1], carry_known=False, keys=rks if parent is not None else None,
                                        parent=parent if parent is not None else CHAIN_ROOT))
    return rest


def seed_state(state: ChainState, resolved: dict[tuple[str, int], int]) -> None:
    """Parents resolved from Valkey's engine map: aligned chain points (no carry is stored there)."""
    for (model, ek), rk in resolved.items():
        state.put(model, ek, ChainPoint(rk, carry_known=False))


__all__ = ["ChainPoint", "ChainState", "Plan", "adapter_of", "plan_batch", "seed_held", "seed_state", "unresolved_parents",
           "Sequence"]
