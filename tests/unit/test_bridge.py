"""The engine-key -> request-key bridge, for every engine/canonical block ratio."""
import pytest

from kv_preflight.engines.vllm import EXTRA_KEYS as VLLM_EXTRA_KEYS
from kv_preflight.index.pod_state import PodState
from kv_preflight.ingester.bridge import ChainState, plan_batch, seed_held, seed_state, unresolved_parents
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_preflight.index.index import ClearPod, RemoveBlock, StoreBlock, encode_entry, make_entry
from kv_preflight.keys.chain import chain_root, request_keys

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


# ---- the write path's fast paths (ChainState.put_many, whole events keyed at once, partial events planned
# ahead lazily) hold to what one block at a time does


from hypothesis import given, settings, strategies as st

from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.ingester.bridge import ChainPoint


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 6),
       steps=st.lists(st.one_of(st.tuples(st.just("get"), st.integers(0, 9)),
                                st.tuples(st.just("put"), st.lists(st.integers(0, 9), max_size=8))), max_size=12))
def test_put_many_is_a_put_per_point_in_turn(capacity, steps):
    """Same points, same LRU order and evictions as ``put`` one at a time, whatever the duplicates, gets in
    between and capacity."""
    one, many = ChainState(capacity), ChainState(capacity)
    n = 0
    for kind, arg in steps:
        if kind == "get":
            assert one.get("m", arg) == many.get("m", arg)
            continue
        points = [ChainPoint(n + i) for i in range(len(arg))]
        n += len(arg)
        for ek, p in zip(arg, points):
            one.put("m", ek, p)
        many.put_many("m", arg, points)
        assert list(one._points.items()) == list(many._points.items())


@pytest.mark.parametrize("engine_block,blocks", [(16, 1), (16, 5), (32, 1), (32, 3), (64, 2)])
def test_stored_blocks_chain_and_their_points_in_block_order(engine_block, blocks):
    """Each StoreBlock's parent is the key before its own (the chain root's is CHAIN_ROOT, a resolved parent's
    its last key), each engine key's point holds its keys, its last key and that parent, and the points enter
    the LRU in block order, after the parent (got, so moved last before them)."""
    per = engine_block // 16
    state = ChainState()
    state.put("tiny", 50, ChainPoint(777))
    state.put("tiny", 51, ChainPoint(888))
    for parent, rk, before in ((None, None, CHAIN_ROOT), (50, 777, 777)):
        ev = BlockStored(list(range(1, blocks + 1)), parent, TOKENS[:blocks * engine_block], engine_block,
                         medium="GPU", group_idx=0, extra_keys=[None] * blocks)
        p = plan([ev], state)
        keys = request_keys(TOKENS[:blocks * engine_block], model="tiny", parent=rk)
        owns = [tuple(keys[i * per:(i + 1) * per]) for i in range(blocks)]
        befores = [before] + [own[-1] for own in owns[:-1]]
        assert p.mutations == [StoreBlock(i + 1, "gpu", field("p", "GPU", 0), own, 0, parent is None, b)
                               for i, (own, b) in enumerate(zip(owns, befores))]
        assert p.stored_blocks == blocks and p.orphans == 0
        assert [state.get("tiny", i + 1) for i in range(blocks)] == \
               [ChainPoint(own[-1], keys=own, parent=b) for own, b in zip(owns, befores)]
    # the second event's parent was got (moved last), then its blocks put in order, then got above in order
    assert list(state._points) == [("tiny", 51), ("tiny", 50)] + [("tiny", i + 1) for i in range(blocks)]


def test_an_event_with_fewer_tokens_than_blocks_keys_the_blocks_it_has_tokens_for():
    ev = BlockStored([1, 2, 3], None, TOKENS[:32], 16, medium="GPU", group_idx=0)
    p = plan([ev])
    keys = request_keys(TOKENS[:32], model="tiny")
    assert [m.request_keys for m in p.mutations] == [(keys[0],), (keys[1],), ()]
    assert [m.parent for m in p.mutations] == [CHAIN_ROOT, keys[0], keys[1]] and p.stored_blocks == 3


def test_multimodal_ids_on_a_later_block_only_key_that_block():
    """vLLM sends None for each block without extra keys: an image in the second block still keys it."""
    ev = BlockStored([1, 2], None, TOKENS[:32], 16, medium="GPU", group_idx=0, extra_keys=[None, [("img", 0)]])
    plain = request_keys(TOKENS[:32], model="tiny")
    with_image = request_keys(TOKENS[:32], model="tiny", extra_per_block=[None, ["img"]])
    assert with_image[0] == plain[0] and with_image[1] != plain[1]
    assert [k for m in plan([ev]).mutations for k in m.request_keys] == with_image


def test_a_partial_event_takes_the_keys_of_the_full_events_around_it_in_its_place():
    """A sliding-window group's event (fewer hashes than its tokens' blocks) between the full-attention group's
    events of the same step: its blocks take the keys the full events computed, before or after it in the batch;
    a hash met nowhere is an orphan. Mutations stay in event order; the chain state sees the full events' puts
    first, then the partial event's gets."""
    keys = request_keys(TOKENS[:64], model="tiny")
    full_a = BlockStored([1, 2], None, TOKENS[:32], 16, medium="GPU", group_idx=0, extra_keys=[None] * 2)
    window = BlockStored([2, 4, 9], None, TOKENS[:64], 16, medium="GPU", group_idx=1, extra_keys=[None] * 3)
    full_b = BlockStored([3, 4], 2, TOKENS[32:64], 16, medium="GPU", group_idx=0, extra_keys=[None] * 2)
    state = ChainState()
    p = plan([full_a, window, BlockRemoved([7]), full_b], state)
    f0, f1 = field("p", "GPU", 0), field("p", "GPU", 1)
    assert p.mutations == [
        StoreBlock(1, "gpu", f0, (keys[0],), 0, True, CHAIN_ROOT), StoreBlock(2, "gpu", f0, (keys[1],), 0, True, keys[0]),
        StoreBlock(2, "gpu", f1, (keys[1],), 1, True, keys[0]), StoreBlock(4, "gpu", f1, (keys[3],), 1, True, keys[2]),
        RemoveBlock(7, "gpu"),
        StoreBlock(3, "gpu", f0, (keys[2],), 0, False, keys[1]), StoreBlock(4, "gpu", f0, (keys[3],), 0, False, keys[2]),
    ]
    assert (p.stored_blocks, p.orphans, p.removed_blocks) == (6, 1, 1)
    assert list(state._points) == [("tiny", 1), ("tiny", 3), ("tiny", 2), ("tiny", 4)]


# ---- blocks the pod holds, from its own state (the index writer's PodState) when this process has not met them

def held_by_pod(events):
    """A pod's state after ``events`` planned by a process since gone: what the writer loads from its log."""
    pod = PodState(pod_id="p")
    pod.plan(plan(events).mutations)
    return pod.block_keys


def test_a_parent_the_pod_holds_is_taken_from_its_state_not_valkey():
    """A chain state that never met the parent (the ingester restarted, its LRU let it go, another pod's restart
    emptied it): the pod's own state names it, so Valkey is asked only for what the pod does not hold."""
    known = held_by_pod([BlockStored([1, 2], None, TOKENS[:64], 32, medium="GPU", group_idx=0)])
    child = BlockStored([3], 2, TOKENS[64:96], 32, medium="GPU", group_idx=0)
    state = ChainState()
    missing = unresolved_parents(EventBatch(1.0, [child, BlockStored([9], 8, TOKENS[:32], 32)]), "tiny", state)
    assert seed_held(state, missing, known, {}, chain_root) == [("tiny", 8)]  # for Valkey
    p = plan([child], state)
    assert p.orphans == 0
    assert p.mutations[0].request_keys == tuple(request_keys(TOKENS[:96], model="tiny")[4:])


def test_a_partial_event_takes_the_keys_of_blocks_the_pod_holds():
    """A sliding-window group's event whose blocks the full-attention group stored in an earlier batch, planned by
    a process that has not met them: their keys come from the pod's state, not an orphan each."""
    keys = request_keys(TOKENS[:64], model="tiny")
    known = held_by_pod([BlockStored([1, 2, 3, 4], None, TOKENS[:64], 16, medium="GPU", group_idx=0)])
    window = BlockStored([2, 4], None, TOKENS[:64], 16, medium="GPU", group_idx=1, extra_keys=[None] * 4)
    p = plan_batch(EventBatch(1.0, [window], 0), pod_id="p", topic_model="tiny", state=ChainState(), hash_seed="",
                   block_size=16, entry_field=field, extra_keys=VLLM_EXTRA_KEYS, known=known)
    f1 = field("p", "GPU", 1)
    assert p.mutations == [StoreBlock(2, "gpu", f1, (keys[1],), 1, True, keys[0]),
                           StoreBlock(4, "gpu", f1, (keys[3],), 1, True, keys[2])]
    assert p.orphans == 0


def test_blocks_ending_mid_key_leave_their_chain_points_for_the_pods_state():
    """E=24, C=16: every block's point (its leftover tokens, or none at a key boundary) is in ``Plan.carries``, for
    the pod's state to keep; taken back for a block the pod holds, the child is keyed as by the same run, and a
    point of a block the pod no longer holds is not taken."""
    a = BlockStored([1, 2], None, TOKENS[:48], 24, medium="GPU", group_idx=0)
    p = plan([a])
    assert set(p.carries) == {1, 2} and p.carries[1].tokens == tuple(TOKENS[16:24]) and p.carries[2].tokens == ()
    assert plan([BlockStored([3], None, TOKENS[:32], 32)]).carries == {}  # aligned: the pod's keys are enough
    known = held_by_pod([a])
    child = BlockStored([3], 2, TOKENS[48:72], 24, medium="GPU", group_idx=0)
    state = ChainState()
    assert seed_held(state, [("tiny", 2)], known, p.carries, chain_root) == []
    assert [k for m in plan([child], state).mutations for k in m.request_keys] == request_keys(TOKENS[:72], model="tiny")[3:]
    assert seed_held(ChainState(), [("tiny", 2)], lambda ek: None, p.carries, chain_root) == [("tiny", 2)]


def test_a_held_block_that_keyed_nothing_chains_its_child_from_the_models_root():
    """E=8, C=16: a prompt's first block keys nothing. Seeded from the pod's state (its carry, as the log gives it
    back) by a process that never met it, the chain stands at the model's root: the child's key is the one-run
    key, not an orphan."""
    p = plan([BlockStored([1], None, TOKENS[:8], 8, medium="GPU", group_idx=0)])
    assert p.mutations[0].request_keys == () and p.carries[1].tokens == tuple(TOKENS[:8])
    pod = PodState(pod_id="p")
    pod.plan(p.mutations, None, p.carries)
    state = ChainState()
    assert seed_held(state, [("tiny", 1)], pod.block_keys, pod.carries, chain_root) == []
    child = plan([BlockStored([2], 1, TOKENS[8:16], 8, medium="GPU", group_idx=0)], state)
    assert child.orphans == 0 and child.mutations[0].request_keys == tuple(request_keys(TOKENS[:16], model="tiny"))
