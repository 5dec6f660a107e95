"""The pod's private state and its plans, against a direct model recomputed from the blocks after every batch:
the changes a plan emits turn the index's entries, bits and engine keys exactly into what the blocks say, the
orphan count equals its definition, and a snapshot plus the batches after it restore the same state."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec
import msgspec

from kv_preflight.index.entries import (CHAIN_ROOT, ClearPod, MarkIncomplete, RemoveBlock, StoreBlock, encode_entry,
                                        make_entry)
from kv_preflight.index import pod_log, pod_state
from kv_preflight.index.pod_log import _Delta, _mutations, encode_delta, encode_snapshot, restore
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange, PodState, _Block

FIELD = {(t, g): encode_entry(make_entry("pod", t.upper(), g)) for t in ("gpu", "cpu") for g in (0, 1)}


def model(state: PodState) -> tuple[set, set, set, int | None]:
    """Entries, bits, engine links and the orphan count, straight from the blocks."""
    entries, bits, engines = set(), set(), set()
    held: dict[int, int | None] = {}
    pg = state.prefix_group
    for (ek, tier, group), b in state.blocks.items():
        engines.add(ek)
        for j, rk in enumerate(b.rks):
            entries.add((rk, b.field))
            bits.add((rk, state.bit_of(b.field, group)))
            if group == pg:
                parent = b.parent if j == 0 else b.rks[j - 1]
                if held.get(rk) is None:
                    held[rk] = parent
    if any(p is None for p in held.values()):
        orphans = None
    else:
        orphans = sum(1 for rk, p in held.items() if p != CHAIN_ROOT and p not in held)
    return entries, bits, engines, orphans


def apply_changes(changes, entries: set, bits: set, engines: set) -> None:
    for c in changes:
        if isinstance(c, KeyChange):
            if c.entry > 0:
                assert (c.rk, c.field) not in entries
                entries.add((c.rk, c.field))
            elif c.entry < 0:
                entries.discard((c.rk, c.field))
            if c.bit_delta > 0:
                assert (c.rk, c.bit) not in bits
                bits.add((c.rk, c.bit))
            elif c.bit_delta < 0:
                bits.discard((c.rk, c.bit))
        elif isinstance(c, EngineAdd):
            engines.add(c.ek)  # (again, for an engine key whose drop waited: ZADD is idempotent)
        elif isinstance(c, EngineDrop):
            engines.discard(c.ek)


def chains(rng: random.Random, n_chains: int, length: int, per: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Chains of engine blocks (engine key, request keys), request keys unique per position; the last chain
    is the first under other engine keys (what llm-d's keys leave out differs: two engine keys, one request
    key, as the pod state must handle)."""
    out = []
    for c in range(n_chains):
        shared = rng.randrange(0, length) if c else 0
        chain = list(out[0][:shared]) if c and out else []
        for i in range(len(chain), length):
            ek = 10_000 * (c + 1) + i
            chain.append((ek, tuple(ek * 10 + k for k in range(per))))
        out.append(chain)
    out.append([(ek + 500_000, rks) for ek, rks in out[0]])
    return out


def random_batch(rng: random.Random, world, held: set, hybrid: bool) -> list:
    muts = []
    for _ in range(rng.randrange(1, 6)):
        r = rng.random()
        chain = rng.choice(world)
        tier = "gpu" if rng.random() < 0.8 else "cpu"
        group = rng.choice([0, 1]) if hybrid else 0
        if r < 0.5:
            start = rng.randrange(0, len(chain))
            end = rng.randrange(start, len(chain)) + 1
            parentless = start == 0 and rng.random() < 0.3
            for i in range(start, end):
                ek, rks = chain[i]
                parent = (CHAIN_ROOT if i == 0 else chain[i - 1][1][-1])
                if rng.random() < 0.05:
                    parent = None  # an import of an older export
                muts.append(StoreBlock(ek, tier, FIELD[(tier, group)], rks, group, parentless, parent))
                held.add((ek, tier, group))
        elif r < 0.9 and held:
            ek, t, g = rng.choice(sorted(held))
            muts.append(RemoveBlock(ek, t, g))
        elif r < 0.93:
            muts.append(ClearPod())
    return muts


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), hybrid=st.booleans(), per=st.sampled_from([1, 2]))
def test_plans_keep_the_index_equal_to_the_blocks(seed, hybrid, per):
    rng = random.Random(seed)
    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)} if hybrid else {}
    state = PodState(groups, engine_block_size=32)
    world = chains(rng, 3, 8, per)
    entries, bits, engines = set(), set(), set()
    held: set = set()
    snapshot = encode_snapshot(state, 0)
    deltas = []
    for gen in range(1, 40):
        muts = random_batch(rng, world, held, hybrid)
        plan = state.plan(muts)
        apply_changes(plan.changes, entries, bits, engines)
        state = plan.after
        deltas.append(encode_delta(gen, muts, None, 32))
        e, b, g, orphans = model(state)
        assert entries == e and bits == b and g <= engines
        # an engine key the pod let go of stays in engine:<ek> only while the pod links one of its keys
        linked = {rk for rk, _ in entries}
        assert all(any(rk in linked for rk in state.deferred[ek]) for ek in engines - g)
        assert engines - g == set(state.deferred)
        assert state.orphan_count == orphans
        if gen % 13 == 0:
            snapshot, deltas = encode_snapshot(state, gen), []
        again, at = restore(snapshot, deltas)
        assert at == gen
        assert model(again) == model(state)
        assert {k: v.copies for k, v in again.blocks.items()} == {k: v.copies for k, v in state.blocks.items()}


def test_planning_moves_the_state_and_a_clone_stays_behind():
    state = PodState(engine_block_size=32)
    before = state.clone()
    plan = state.plan([StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT)])
    assert plan.after is state and len(state) == 1 and len(before) == 0
    again = before.plan([StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT)])
    assert again.changes == plan.changes


def test_a_copy_is_counted_and_outlives_one_eviction():
    state = PodState(engine_block_size=32)
    s = StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT)
    state = state.plan([s]).after
    copy = StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT)
    state = state.plan([copy]).after
    plan = state.plan([RemoveBlock(1, "gpu", 0)])
    assert plan.changes == [] and plan.removed == 1
    plan = plan.after.plan([RemoveBlock(1, "gpu", 0)])
    assert [type(c) for c in plan.changes] == [KeyChange, EngineDrop]


def test_reannounced_run_is_not_a_copy_but_a_recomputed_one_is():
    """vLLM re-sends a reused prefix parentless (report mode "full"): every block a hit, nothing changes. A
    hybrid model whose sliding-window group cut the hit to 0 recomputes and re-caches the same blocks, also
    parentless from block 0: each is a second physical copy (observed on vLLM 0.32 with the tiny hybrid model)."""
    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)}
    run = [(1, (11,)), (2, (21,)), (3, (31,))]

    def stores(group, parentless):
        return [StoreBlock(ek, "gpu", FIELD[("gpu", group)], rks, group, parentless,
                           CHAIN_ROOT if i == 0 else run[i - 1][1][-1])
                for i, (ek, rks) in enumerate(run)]

    state = PodState(groups, engine_block_size=32)
    state.reannouncements = True  # clients may ask for report mode "full" (ingest --kv-cache-report-mode full)
    state = state.plan(stores(1, False) + stores(0, False)).after
    plan = state.plan(stores(1, True) + stores(0, True))
    assert plan.reannounced == 6 and plan.changes == []
    # the window's blocks evicted: the rule finds no hit, so the same parentless run is a recompute
    state = state.plan([RemoveBlock(2, "gpu", 0), RemoveBlock(3, "gpu", 0), RemoveBlock(1, "gpu", 0)]).after
    plan = state.plan(stores(1, True))
    assert plan.reannounced == 0 and plan.stored == 3
    assert all(b.copies == 2 for (ek, t, g), b in plan.after.blocks.items() if g == 1)


def test_without_report_mode_full_a_parentless_run_of_held_blocks_is_a_copy():
    """vLLM's default (report mode "incremental") re-announces nothing: concurrent requests that computed one
    prefix at once each cache it from block 0, parentless, so the run is a second copy even where every block
    is a hit (read as a re-announcement, one copy's eviction dropped what vLLM still held)."""
    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)}
    blocks = [(1, (11,)), (2, (21,))]
    run = [StoreBlock(ek, "gpu", FIELD[("gpu", 1)], rks, 1, True, CHAIN_ROOT if i == 0 else blocks[i - 1][1][-1])
           for i, (ek, rks) in enumerate(blocks)]
    state = PodState(groups, engine_block_size=32).plan(run).after
    plan = state.plan(run)
    assert plan.reannounced == 0 and all(b.copies == 2 for b in plan.after.blocks.values())
    state = plan.after.plan([RemoveBlock(1, "gpu", 1), RemoveBlock(2, "gpu", 1)]).after
    assert all(b.copies == 1 for b in state.blocks.values()) and len(state.blocks) == 2


def test_prefix_group_follows_the_full_attention_group():
    state = PodState({0: GroupSpec(SLIDING, 32, 64)}, engine_block_size=32)
    assert state.prefix_group == 0
    f0, f1 = FIELD[("gpu", 0)], FIELD[("gpu", 1)]
    state = state.plan([StoreBlock(1, "gpu", f1, (11,), 1, False, CHAIN_ROOT),
                        StoreBlock(2, "gpu", f1, (21,), 1, False, 11),
                        StoreBlock(2, "gpu", f0, (21,), 0, False, 11)]).after
    assert state.orphan_count == 1  # group 0 (the prefix group so far) holds 21 without 11
    state.set_groups({1: GroupSpec(FULL, 32)})
    assert state.prefix_group == 1 and state.orphan_count == 0


def test_bits_move_when_the_prefix_group_becomes_known():
    """Group 1 turns out to be the full-attention group: its bits move to the prefix field, group 0's out."""
    state = PodState(engine_block_size=32)
    f0, f1 = FIELD[("gpu", 0)], FIELD[("gpu", 1)]
    state = state.plan([StoreBlock(1, "gpu", f0, (11,), 0, False, CHAIN_ROOT),
                        StoreBlock(1, "gpu", f1, (11,), 1, False, CHAIN_ROOT)]).after
    assert set(state.bit_refs) == {(11, "gpu"), (11, "gpu|1")}
    plan = state.plan([], {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)})
    entries, bits, engines = {(11, f0), (11, f1)}, {(11, "gpu"), (11, "gpu|1")}, {1}
    apply_changes(plan.changes, entries, bits, engines)
    assert bits == {(11, "gpu"), (11, "gpu|0")} == set(plan.after.bit_refs)


_U64 = st.integers(0, 2**64 - 1)
_MUTATION = st.one_of(
    st.builds(StoreBlock, _U64, st.sampled_from(["gpu", "cpu", "disk"]), st.sampled_from(list(FIELD.values())),
              st.lists(_U64, min_size=0, max_size=3).map(tuple), st.integers(0, 255), st.booleans(),
              st.one_of(st.none(), st.just(CHAIN_ROOT), _U64)),
    st.builds(RemoveBlock, _U64, st.sampled_from(["gpu", "cpu"]), st.integers(0, 255)),
    st.builds(ClearPod),
    st.builds(MarkIncomplete, st.text(max_size=20)),
)


@settings(max_examples=300, deadline=None)
@given(muts=st.lists(_MUTATION, max_size=12), chain=st.booleans())
def test_a_delta_gives_back_exactly_the_mutations_it_was_made_of(muts, chain):
    """The columnar delta (parents elided where a store chains from the store before it, per-op columns held
    once when uniform) decodes to the very mutations it encoded, whatever they are."""
    if chain:  # stores that chain, as an engine's batches mostly do: the elided parents
        last = None
        for i, m in enumerate(muts):
            if isinstance(m, StoreBlock):
                muts[i] = msgspec.structs.replace(m, parent=last if last is not None else m.parent)
                last = m.request_keys[-1] if m.request_keys else None
    got = _mutations(msgspec.msgpack.decode(encode_delta(7, muts, None, 32), type=_Delta))
    assert got == muts


def _chain_stores(muts: list) -> list:
    """The batch with its stores chained (each store's parent the last request key of the store before it, when
    it had one), as an engine's batches mostly are: the delta's elided parents."""
    out, last = [], None
    for m in muts:
        if type(m) is StoreBlock:
            m = msgspec.structs.replace(m, parent=last if last is not None else m.parent)
            last = m.request_keys[-1] if m.request_keys else None
        out.append(m)
    return out


class _OddStore(StoreBlock):
    """A subclass: the C pass leaves a batch holding one to the Python loop."""


# values the C pass leaves to the Python loop (which takes them or raises as it always did), and a few it takes
# itself (a list of request keys, a parent the state log cannot hold: msgspec refuses it either way)
_ODD = {"engine_key": [-1, 2**64, True, 1.0], "group": [-1, 256, True], "tier": [f"t{i}" for i in range(20)],
        "request_keys": [[1, 2], (1, -1), (2**64,), (True,)], "parent": [True, 1.0, 2**70, -5], "parentless": [0, 1]}


@st.composite
def _odd_mutation(draw):
    m = draw(_MUTATION)
    if isinstance(m, (StoreBlock, RemoveBlock)):
        name = draw(st.sampled_from([f for f in _ODD if f in m.__struct_fields__]))
        m = msgspec.structs.replace(m, **{name: draw(st.sampled_from(_ODD[name]))})
        if isinstance(m, StoreBlock) and draw(st.booleans()):
            m = _OddStore(*msgspec.structs.astuple(m))
    return m


def _delta_or_error(muts: list, c_columns) -> bytes | tuple[type, str]:
    """encode_delta's bytes, or its error, with the C columns (``c_columns``) or the Python loop (None)."""
    saved = pod_log._delta_columns
    pod_log._delta_columns = c_columns
    try:
        return encode_delta(7, muts, {0: GroupSpec(FULL, 32)}, 32)
    except Exception as exc:  # noqa: BLE001 - the error itself is what is compared
        return type(exc), str(exc)
    finally:
        pod_log._delta_columns = saved


@pytest.mark.skipif(pod_log._delta_columns is None, reason="the C delta columns are not built")
@settings(max_examples=400, deadline=None)
@given(muts=st.lists(_MUTATION, max_size=24), odd=st.lists(st.tuples(st.integers(0, 24), _odd_mutation()), max_size=3),
       chain=st.booleans(), as_tuple=st.booleans())
def test_the_c_delta_columns_give_the_python_loops_bytes_and_errors(muts, odd, chain, as_tuple):
    """``_speedups.delta_columns`` builds encode_delta's columns in one pass; the Python loop is its reference:
    random batches (chained or not, with mutations the C pass leaves to the loop mixed in) encode to the same
    bytes or fail with the same error either way, and an ordinary batch does go through C."""
    for at, m in odd:
        muts.insert(at, m)
    if chain:
        muts = _chain_stores(muts)
    batch = tuple(muts) if as_tuple else muts
    c = pod_log._delta_columns
    assert _delta_or_error(batch, c) == _delta_or_error(batch, None)
    if not odd:
        assert c(batch, *pod_log._DELTA_TYPES) is not None


@pytest.mark.skipif(pod_log._delta_columns is None, reason="the C delta columns are not built")
def test_the_c_delta_columns_leave_anything_unusual_to_the_python_loop():
    c, types = pod_log._delta_columns, pod_log._DELTA_TYPES
    store = StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT)
    assert c([store, RemoveBlock(2, "gpu", 255), ClearPod(), MarkIncomplete("x")], *types) is not None
    assert c([RemoveBlock(1, f"t{i}", 0) for i in range(16)], *types) is not None
    unusual = [[RemoveBlock(1, f"t{i}", 0) for i in range(17)], [_OddStore(*msgspec.structs.astuple(store))],
               (store for _ in range(1)), [object()]]
    taken = {("request_keys", (1, 2)), ("parent", 2**70), ("parent", -5)}  # (a list, as list)
    unusual += [[msgspec.structs.replace(store, **{name: v})] for name, vs in _ODD.items() for v in vs
                if name != "tier" and (name, tuple(v) if isinstance(v, list) else v) not in taken]
    unusual += [[RemoveBlock(*args)] for args in [(-1, "gpu", 0), (1, b"gpu", 0), (1, "gpu", 256), (1, "gpu", 1.0)]]
    unusual += [[msgspec.structs.replace(store, entry_field=b"F")], [msgspec.structs.replace(store, request_keys=b"")]]
    for muts in unusual:
        assert c(muts, *types) is None, muts
    for name, v in taken:
        assert c([msgspec.structs.replace(store, **{name: list(v) if isinstance(v, tuple) else v})], *types) is not None


@pytest.fixture(params=["C", "Python"])
def snapshot_path(request, monkeypatch):
    """encode_snapshot with its per-block columns built in C (``_speedups.snapshot_columns``), then by the
    Python path (the fallback and reference), with no C at all."""
    if request.param == "Python":
        monkeypatch.setattr(pod_log, "_snapshot_columns", None)
        monkeypatch.setattr(pod_log, "_pack_u64s", None)
    elif pod_log._snapshot_columns is None:
        pytest.skip("C extension not built")
    return request.param


def test_a_snapshots_bytes_stay_those_earlier_builds_wrote_and_read(snapshot_path):
    """Snapshots persist in Valkey (``kvpf:{<pod>}:state``) and are read by every build of the fleet: the
    bytes for a state with two groups, two fields and tiers, a copy, a block with no keys and parents of
    every kind are frozen (written by the per-block encoder that the column-at-a-time one replaced)."""
    import hashlib

    state = PodState({0: GroupSpec(FULL, 32), 1: GroupSpec(SLIDING, 32, 64)}, engine_block_size=32, pod_id="p")
    muts = [StoreBlock(100 + i, "gpu", "FA", (1000 + 2 * i, 1001 + 2 * i), i % 2, False,
                       CHAIN_ROOT if i == 0 else 999 + 2 * i) for i in range(6)]
    muts += [StoreBlock(200, "cpu", "FB", (5000,), 0, True, None), StoreBlock(201, "cpu", "FB", (5001,), 0, False, 5000),
             StoreBlock(202, "gpu", "FA", (), 0, False, 77), StoreBlock(100, "gpu", "FA", (1000, 1001), 0, False, CHAIN_ROOT),
             RemoveBlock(103, "gpu", 1)]
    state.plan(muts)
    snap = encode_snapshot(state, 7)
    assert (len(snap), hashlib.sha256(snap).hexdigest()) == \
        (262, "ef02e27a9598f3fd6b3a4f17f02b348251d30e8d629c03d1a0060b8f17e0d698")
    again, gen = restore(snap, [])
    assert gen == 7 and model(again) == model(state) and encode_snapshot(again, 7) == snap
    assert {k: v.copies for k, v in again.blocks.items()} == {k: v.copies for k, v in state.blocks.items()}


@pytest.mark.parametrize("bad", [-1, 2**64, 1.0])
def test_a_key_outside_uint64_is_a_struct_error_in_both_encoders(bad, snapshot_path):
    """What the state log cannot hold (an imported row's key, say) fails as struct.error, as it did before the
    C packer, in the delta and the snapshot alike."""
    import struct

    store = StoreBlock(bad, "gpu", "F", (11,), 0, False, CHAIN_ROOT)
    with pytest.raises(struct.error):
        encode_delta(1, [store], None, 32)
    state = PodState(engine_block_size=32)
    state.plan([StoreBlock(1, "gpu", "F", (bad,), 0, False, CHAIN_ROOT)])
    with pytest.raises(struct.error):
        encode_snapshot(state, 1)


def test_a_group_outside_a_byte_is_refused_by_both_encoders(snapshot_path):
    """The format holds a group in 8 bits: a delta and a snapshot refuse group -1 or 256 (a snapshot wrote -1
    once, and it came back as group 255)."""
    for group in (-1, 256):
        store = StoreBlock(1, "gpu", "F", (11,), group, False, CHAIN_ROOT)
        with pytest.raises(ValueError):
            encode_delta(1, [store], None, 32)
        state = PodState(engine_block_size=32)
        state.plan([store])
        with pytest.raises(ValueError):
            encode_snapshot(state, 1)


def _everything(state: PodState) -> dict:
    """Every part of a pod state a plan moves."""
    return {"blocks": {k: (b.field, b.rks, b.parent, b.copies) for k, b in state.blocks.items()},
            "order": list(state.blocks), "tiers": state.tiers, "entry_refs": state.entry_refs,
            "bit_refs": state.bit_refs, "ek_slots": state.ek_slots, "ek_refs": state.ek_refs,
            "rk_links": state.rk_links, "deferred": state.deferred, "waiting": state.waiting, "held": state.held,
            "known": state.known, "kids": state.kids, "parent_of": state.parent_of, "unknown": state.unknown,
            "orphans": state.orphans}


# another pod's entry and an unparseable one (no bit); the pod's own in llm-d's older form (another entry, the
# same bit as the JSON form's)
_OTHER_FIELDS = [encode_entry(make_entry("other-pod", "GPU", 0)), "not an entry",
                 encode_entry(make_entry("pod", "GPU", 0), "v08"), encode_entry(make_entry("pod", "CPU", 0), "v08")]


@pytest.mark.skipif(pod_state._plan_blocks is None, reason="the C plan loop is not built")
@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), hybrid=st.booleans(), per=st.sampled_from([1, 2]),
       reannouncements=st.booleans(), foreign=st.booleans())
def test_the_c_plan_loop_moves_the_state_exactly_as_the_python_methods(seed, hybrid, per, reannouncements,
                                                                        foreign):
    """kv_preflight/index/_write_path.c runs ``PodState.plan``'s stores and removals; the Python methods are its
    reference. Random batches (copies, shared request keys under two engine keys and their deferred drops,
    unknown parents, clears, flags, other pods' and unparseable entry fields, empty blocks) leave both with the
    same state, field for field, and the same changes in the same order."""
    rng = random.Random(seed)
    groups = {0: GroupSpec(SLIDING, 32, 64), 1: GroupSpec(FULL, 32)} if hybrid else {}
    states = {}
    for name in ("c", "py"):
        states[name] = PodState(groups, engine_block_size=32, pod_id="pod")
        states[name].reannouncements = reannouncements
    world = chains(rng, 3, 8, per)
    held: set = set()
    c_loop = pod_state._plan_blocks
    for _ in range(40):
        muts = random_batch(rng, world, held, hybrid)
        if rng.random() < 0.1:
            muts.insert(rng.randrange(len(muts) + 1), MarkIncomplete("gap"))
        if foreign:
            muts = [msgspec.structs.replace(m, entry_field=rng.choice(_OTHER_FIELDS))
                    if isinstance(m, StoreBlock) and rng.random() < 0.3 else m for m in muts]
        muts = [msgspec.structs.replace(m, request_keys=())  # a block linking no request key
                if isinstance(m, StoreBlock) and rng.random() < 0.03 else m for m in muts]
        plans = {}
        for name in ("c", "py"):
            pod_state._plan_blocks = c_loop if name == "c" else None
            try:
                plans[name] = states[name].plan(muts)
            finally:
                pod_state._plan_blocks = c_loop
        c, py = plans["c"], plans["py"]
        assert c.changes == py.changes and [type(x) for x in c.changes] == [type(x) for x in py.changes]
        assert (c.stored, c.removed, c.cleared, c.reannounced, c.flags, c.cleared_flags) == \
            (py.stored, py.removed, py.cleared, py.reannounced, py.flags, py.cleared_flags)
        assert _everything(states["c"]) == _everything(states["py"])


def test_a_seventeenth_tier_is_refused_by_the_snapshot(snapshot_path):
    """A block's code holds its tier in 4 bits: 16 tiers encode, a 17th is refused."""
    state = PodState(engine_block_size=32)
    state.plan([StoreBlock(i, f"t{i}", "F", (100 + i,), 0, False, CHAIN_ROOT) for i in range(16)])
    again, _ = restore(encode_snapshot(state, 1), [])
    assert model(again) == model(state)
    state.plan([StoreBlock(16, "t16", "F", (116,), 0, False, CHAIN_ROOT)])
    with pytest.raises(ValueError, match="more than 16 tiers"):
        encode_snapshot(state, 1)


@st.composite
def pod_states(draw) -> PodState:
    """A state of any shape a snapshot holds, its blocks set directly: entry fields, tiers and KV cache groups
    shared by every block (the one-code shortcut) or mixed, the same key count everywhere or not (none, too),
    parents that chain from the block before or are None, CHAIN_ROOT or another key, more than one copy, keys
    at the ends of uint64, engine keys waiting to be dropped."""
    state = PodState({0: GroupSpec(FULL, 32)} if draw(st.booleans()) else {},
                     engine_block_size=draw(st.sampled_from([None, 32])), pod_id="pod")
    shared = draw(st.booleans())
    per = draw(st.one_of(st.none(), st.integers(0, 2)))
    last = None
    for _ in range(draw(st.integers(0, 30))):
        # each field a new str object, as decoded ones are: equal fields need not be the same object
        field = "".join(["F", draw(st.sampled_from("ABC"))])
        tier = draw(st.sampled_from(["gpu", "cpu", "disk"]))
        group = draw(st.sampled_from([0, 1, 255]))
        if shared:
            field, tier, group = "FA", "gpu", 0
        n_rks = per if per is not None else draw(st.integers(0, 3))
        rks = tuple(draw(st.lists(_U64, min_size=n_rks, max_size=n_rks)))
        parent = draw(st.sampled_from([last, last, None, CHAIN_ROOT]) | _U64)
        copies = draw(st.one_of(st.just(1), st.integers(0, 2**64 - 1)))
        state.blocks[(draw(_U64), tier, group)] = _Block(field, rks, parent, copies)
        last = rks[-1] if rks else None
    state.deferred = draw(st.dictionaries(_U64, st.lists(_U64, max_size=3).map(tuple), max_size=3))
    return state


@pytest.mark.skipif(pod_log._snapshot_columns is None, reason="C extension not built")
@settings(max_examples=200, deadline=None)
@given(state=pod_states())
def test_the_c_columns_write_the_python_paths_bytes(state):
    """The C columns (built in one pass over the blocks) are the Python path's, and so is every byte of the
    snapshot: the Python path is the reference (here with no C at all: struct packs its keys), and snapshots
    persist (an ingester of either build restores any pod's)."""
    columns = pod_log._snapshot_columns(state.blocks)  # C takes every such state: no fallback
    snap = encode_snapshot(state, 9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pod_log, "_snapshot_columns", None)
        mp.setattr(pod_log, "_pack_u64s", None)
        assert columns == pod_log._columns(state)
        assert encode_snapshot(state, 9) == snap


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with Python's debug allocator (freed memory is overwritten, so a use
    after free crashes there rather than maybe)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONMALLOC": "debug"}, timeout=120)


@pytest.mark.skipif(pod_state._plan_blocks is None, reason="the C plan loop is not built")
def test_the_c_plan_loop_survives_a_callback_that_changes_the_mutations():
    """The C loop calls back into Python (here ``_release``, an engine key's deferred drop): whatever that does
    to the list of mutations, the loop reads it afresh (it held the list's item array and size, and read freed
    items: a crash)."""
    done = _run_isolated("""
        import gc
        from kv_preflight.index.pod_state import PodState
        from kv_preflight.index.entries import CHAIN_ROOT, RemoveBlock, StoreBlock, encode_entry, make_entry
        F = encode_entry(make_entry("pod", "GPU", 0))
        class Odd(PodState):
            muts = None
            def _release(self, rk, out):
                if self.muts is not None:
                    self.muts.clear()
                    gc.collect()
                super()._release(rk, out)
        st = Odd(engine_block_size=32, pod_id="pod")
        st.plan([StoreBlock(1, "gpu", F, (10,), 0, False, CHAIN_ROOT), StoreBlock(2, "gpu", F, (10,), 0, False, CHAIN_ROOT)])
        st.muts = [RemoveBlock(1, "gpu", 0), RemoveBlock(2, "gpu", 0)] + [RemoveBlock(i, "gpu", 0) for i in range(100, 120)]
        try:
            st.plan(st.muts)
        except IndexError:  # the Python loop's, on the list it was given (now empty)
            pass
        print("survived")
        """)
    assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]


@pytest.mark.skipif(pod_state._plan_blocks is None, reason="the C plan loop is not built")
def test_a_missing_engine_slot_is_the_python_methods_key_error():
    """A state that lost an engine key's slot: the C loop raises the KeyError Python's ``self.ek_slots[k]``
    raises, its key the (ek, group) tuple (not KeyError(ek, group))."""
    c_loop = pod_state._plan_blocks
    errors = []
    for loop in (c_loop, None):
        state = PodState(engine_block_size=32, pod_id="pod")
        state.plan([StoreBlock(1, "gpu", "F", (10,), 0, False, CHAIN_ROOT)])
        state.ek_slots.clear()
        pod_state._plan_blocks = loop
        try:
            with pytest.raises(KeyError) as caught:
                state.plan([RemoveBlock(1, "gpu", 0)])
        finally:
            pod_state._plan_blocks = c_loop
        errors.append(caught.value.args)
    assert errors[0] == errors[1] == ((1, 0),)
