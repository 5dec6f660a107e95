"""The engine-key -> request-key bridge, for every engine/canonical block ratio."""
import pytest

from kv_preflight.engines.vllm import EXTRA_KEYS as VLLM_EXTRA_KEYS
from kv_preflight.ingester.bridge import ChainState, plan_batch, seed_state, unresolved_parents
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import ClearPod, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.keys.chain import request_keys

TOKENS = list(range(1000, 1128))  # 128 tokens


def field(pod, medium, group):
    return encode_entry(make_entry(pod, medium, group))


def plan(events, state=None, block_size=16, model="tiny"):
    return plan_batch(EventBatch(1.0, events, 0), pod_id="p", topic_model=model, state=state if state is not None else ChainState(),
                      hash_seed="", block_size=block_size, entry_field=field, extra_keys=VLLM_EXTRA_KEYS)


@pytest.mark.parametrize("engine_block", [16, 32, 64, 8, 24, 48])
def test_any_ratio_maps_to_the_canonical_chain(engine_block):
    n = len(TOKENS) // engine_block
    expected = request_keys(TOKENS[: n * engine_block], model="tiny")
    # Split the same chain over two events so the second resolves its parent from state.
    state = ChainState()
    half = n // 2
    ev1 = BlockStored(list(range(1, half + 1)), None, TOKENS[: half * engine_block], engine_block, medium="GPU", group_idx=0)
    ev2 = BlockStored(list(range(half + 1, n + 1)), half, TOKENS[half * engine_block : n * engine_block], engine_block,
                      medium="GPU", group_idx=0)
    p1 = plan([ev1], state)
    p2 = plan([ev2], state)
    stores = [m for m in p1.mutations + p2.mutations if isinstance(m, StoreBlock)]
    assert [m.engine_key for m in stores] == list(range(1, n + 1))
    assert [k for m in stores for k in m.request_keys] == expected
    if engine_block % 16 == 0:
        assert all(len(m.request_keys) == engine_block // 16 for m in stores)
    assert p2.engine_block_size == engine_block and p1.orphans == p2.orphans == 0


def test_unknown_parent_is_an_orphan_until_resolved():
    ev = BlockStored([7], 99, TOKENS[:32], 32)
    state = ChainState()
    assert unresolved_parents(EventBatch(1.0, [ev]), "tiny", state) == [("tiny", 99)]
    assert plan([ev], state).orphans == 1
    seed_state(state, {("tiny", 99): 12345})
    p = plan([ev], state)
    assert p.orphans == 0
    assert p.mutations[0].request_keys == tuple(request_keys(TOKENS[:32], model="tiny", parent=12345))


def test_parent_in_same_batch_needs_no_lookup():
    evs = [BlockStored([1], None, TOKENS[:32], 32), BlockStored([2], 1, TOKENS[32:64], 32)]
    assert unresolved_parents(EventBatch(1.0, evs), "tiny", ChainState()) == []


def test_lora_blocks_are_keyed_by_adapter_name():
    ev = BlockStored([1], None, TOKENS[:32], 32, lora_id=3, lora_name="sql-lora")
    p = plan([ev])
    assert p.mutations[0].request_keys == tuple(request_keys(TOKENS[:32], model="sql-lora"))


def test_removed_and_cleared_and_tiers():
    p = plan([BlockRemoved([5, 6], medium="CPU"), AllBlocksCleared(), BlockRemoved([7])])
    assert p.mutations == [RemoveBlock(5, "cpu"), RemoveBlock(6, "cpu"), ClearPod(), RemoveBlock(7, "gpu")]
    assert p.clears == 1 and p.removed_blocks == 3


def test_entry_field_carries_tier_and_group():
    p = plan([BlockStored([1], None, TOKENS[:32], 32, medium="CPU", group_idx=1)])
    assert p.mutations[0].entry_field == \
        '{"PodIdentifier":"p","DeviceTier":"cpu","Speculative":false,"HasGroup":true,"GroupIdx":1}'


def test_parent_from_valkey_with_unknown_carry_is_an_orphan():
    """E=24, C=16: an engine block may end mid request key, its leftover tokens ("carry") kept only
    in the ingester's memory. A parent resolved from Valkey has no carry there, so its child cannot
    be keyed: an orphan (the pod is flagged), never keys computed as if the carry were empty."""
    a = BlockStored([1], None, TOKENS[:24], 24, medium="GPU", group_idx=0)
    b = BlockStored([2], 1, TOKENS[24:48], 24, medium="GPU", group_idx=0)
    warm = ChainState()
    plan([a], warm)
    assert [k for m in plan([b], warm).mutations for k in m.request_keys] == request_keys(TOKENS[:48], model="tiny")[1:]
    cold = ChainState()
    rk_a = request_keys(TOKENS[:16], model="tiny")[-1]  # what engine:1 holds (its only request key)
    seed_state(cold, {("tiny", 1): rk_a})
    p = plan([b], cold)
    assert p.orphans == 1 and p.mutations == []
    # With E a multiple of C no block carries anything: a resolved parent is exact.
    c = BlockStored([3], 1, TOKENS[32:64], 32, medium="GPU", group_idx=0)
    seed_state(cold, {("tiny", 1): request_keys(TOKENS[:32], model="tiny")[-1]})
    assert plan([c], cold).mutations[0].request_keys == tuple(request_keys(TOKENS[:64], model="tiny")[2:])


def test_kinds_vllm_runs_with_another_kinds_manager_are_learned_as_that_kind():
    """vLLM 0.32's events name MLA, sink full attention and sliding-window MLA groups by their own
    ``kv_cache_spec_kind``; vLLM runs them with the full-attention and sliding-window managers, so their groups
    are learned as those kinds (with a rule), not as kinds without one."""
    from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec

    p = plan([BlockStored([1], None, TOKENS[:16], 16, medium="GPU", group_idx=0, kv_cache_spec_kind="mla_attention"),
              BlockStored([1], None, TOKENS[:16], 16, medium="GPU", group_idx=1, kv_cache_spec_kind="sliding_window_mla",
                          kv_cache_spec_sliding_window=64),
              BlockStored([1], None, TOKENS[:16], 16, medium="GPU", group_idx=2,
                          kv_cache_spec_kind="sink_full_attention")])
    assert p.groups == {0: GroupSpec(FULL, 16), 1: GroupSpec(SLIDING, 16, 64), 2: GroupSpec(FULL, 16)}
    assert not any(s.missing() for s in p.groups.values())
