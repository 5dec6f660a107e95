"""The bridge, the pod's state and its log together, for engine blocks that end mid request key: a stream planned by
processes that come and go (each new one with an empty chain state and the pod's state restored from its log, as
after a kill -9; or only the chain state emptied, as each ingest call starts one) keys every block it keys as one
process keying the whole stream does, and keys every child of a block the pod holds (its carry is in the log).

The engine is modelled in a few lines: block hashes chained over the parent's hash, the block's tokens and its
extra keys (a multimodal item, a cache salt on the first block), as vLLM's are; a prompt stores the blocks after
the longest prefix the engine holds, with that prefix's last block as parent, in one or two events that may land in
the next batch; a hybrid engine's sliding-window group stores some of the same blocks in partial events; blocks
are evicted one by one, or all at once."""
from __future__ import annotations

import hashlib
import random

import pytest

from kv_preflight.engines.vllm import EXTRA_KEYS
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.entries import StoreBlock
from kv_preflight.index.pod_log import encode_delta, encode_snapshot, restore
from kv_preflight.index.pod_state import PodState
from kv_preflight.ingester.bridge import ChainState, Plan, plan_batch, seed_held, unresolved_parents
from kv_preflight.keys.chain import chain_root

C = 16


def field(pod: str, medium: str | None, group: int | None) -> str:
    return '{"PodIdentifier":"p","DeviceTier":"gpu"}'


def engine_hash(parent: int | None, tokens: list[int], extra: list) -> int:
    return int.from_bytes(hashlib.blake2b(repr((parent, tokens, extra)).encode(), digest_size=8).digest(), "little")


def engine_stream(rng: random.Random, e: int, hybrid: bool) -> list[EventBatch]:
    held: set[int] = set()
    prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 80))] for _ in range(4)]
    batches: list[EventBatch] = []
    later: list[BlockStored] = []  # a prompt's second event, in the next batch
    for step in range(rng.randrange(5, 50)):
        events: list = later
        later = []
        for _ in range(rng.randrange(1, 4)):
            r = rng.random()
            if r < 0.55:
                tokens = rng.choice(prefixes)[:rng.randrange(1, 80)] + [rng.randrange(1, 50_000)
                                                                       for _ in range(rng.randrange(0, 60))]
                salt, mm = rng.choice([None, None, "s1"]), rng.random() < 0.2
                parent, hashes, extras = None, [], []
                for i in range(len(tokens) // e):
                    extra = ([(f"img{i % 3}", 0)] if mm and i % 2 == 0 else []) + ([salt] if i == 0 and salt else [])
                    parent = engine_hash(parent, tokens[i * e:(i + 1) * e], extra)
                    hashes.append(parent)
                    extras.append(extra or None)
                first = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
                if first == len(hashes):
                    continue
                cut = rng.randrange(first, len(hashes))
                for n, (a, b) in enumerate(((first, cut), (cut, len(hashes)))):
                    if a == b:
                        continue
                    parent = None if a == 0 else hashes[a - 1]
                    ex = extras[a:b] if any(extras[a:b]) else None
                    evs = [BlockStored(hashes[a:b], parent, tokens[a * e:b * e], e, medium="GPU", group_idx=0,
                                       extra_keys=ex)]
                    window = [h for j, h in enumerate(hashes[a:b]) if (a + j) % 3 == 2]
                    if hybrid and window:  # (vLLM 0.32 sends the partial group's event first)
                        evs.insert(0, BlockStored(window, parent, tokens[a * e:b * e], e, medium="GPU", group_idx=1,
                                                  kv_cache_spec_kind="sliding_window",
                                                  kv_cache_spec_sliding_window=3 * e, extra_keys=ex))
                    (events if n == 0 or rng.random() < 0.5 else later).extend(evs)
                held.update(hashes[first:])
            elif r < 0.9 and held:
                gone = rng.sample(sorted(held), min(len(held), rng.randrange(1, 4)))
                events.append(BlockRemoved(gone, medium="GPU", group_idx=0))
                held.difference_update(gone)
            elif r < 0.95:
                events.append(AllBlocksCleared())
                held.clear()
                later = []
        if events:
            batches.append(EventBatch(float(step), events, 0))
    return batches


def planned(batch: EventBatch, chains: ChainState, pod: PodState | None, seen: dict[str, int]) -> Plan:
    """As the ingester's Applier plans a batch: parents not in ``chains`` from the pod's state (none: alone)."""
    missing = unresolved_parents(batch, "m", chains)
    if missing and pod is not None:
        held = [ek for _, ek in missing if pod.block_keys(ek) is not None]
        seen["held parents"] += len(held)
        seen["held parents without a carry"] += sum(ek not in pod.carries for ek in held)
        seed_held(chains, missing, pod.block_keys, pod.carries, lambda model: chain_root(model, "", "fnv64a"))
    return plan_batch(batch, pod_id="p", topic_model="m", state=chains, hash_seed="", block_size=C,
                      entry_field=field, extra_keys=EXTRA_KEYS, known=pod.block_keys if pod is not None else None)


@pytest.mark.parametrize("e", [1, 3, 8, 12, 24, 40])
def test_processes_that_come_and_go_key_every_block_as_one_process_does(e):
    seen = {"held parents": 0, "held parents without a carry": 0, "keyed": 0}
    for seed in range(40):
        rng = random.Random(seed * 100 + e)
        batches = engine_stream(rng, e, hybrid=seed % 3 == 0)
        one, reference = ChainState(capacity=10**7), {}
        for batch in batches:
            for m in planned(batch, one, None, seen).mutations:
                if isinstance(m, StoreBlock):
                    reference[m.engine_key] = m.request_keys
        pod, chains, snapshot, deltas = PodState(pod_id="p"), ChainState(), None, []
        for gen, batch in enumerate(batches, 1):
            if rng.random() < 0.4:  # killed: the next process starts from the log
                pod, at = restore(snapshot, deltas, "p")
                assert at == gen - 1
                chains = ChainState()
            elif rng.random() < 0.5:  # a new ingest call: its chain state starts empty
                chains = ChainState()
            plan = planned(batch, chains, pod, seen)
            for m in plan.mutations:
                if isinstance(m, StoreBlock):
                    assert m.request_keys == reference[m.engine_key], (seed, gen, m.engine_key)
                    seen["keyed"] += 1
            pod.plan(plan.mutations, plan.groups or None, plan.carries)
            deltas.append(encode_delta(gen, plan.mutations, plan.groups or None, e, plan.carries))
            if rng.random() < 0.2:
                snapshot, deltas = encode_snapshot(pod, gen), []
    assert seen["held parents"] > 30 and seen["keyed"] > 500, seen  # (the stream is what it is meant to be)
    # a block the pod holds is a parent its child is keyed from: every one that ends mid key has its carry
    assert e % C == 0 or seen["held parents without a carry"] == 0, seen
