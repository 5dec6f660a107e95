"""A pod's carries (what its blocks that end mid request key left unkeyed) in its state log
(kv_preflight/index/pod_log.py): snapshot and deltas give back the state's carries exactly, a log an earlier build
wrote loads with none, and a carries column that does not read never stops the pod loading."""
from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.index import pod_log
from kv_preflight.index.entries import CHAIN_ROOT, Carry, ClearPod, RemoveBlock, StoreBlock
from kv_preflight.index.pod_log import encode_delta, encode_snapshot, restore
from kv_preflight.index.pod_state import PodState
from tests.unit.test_pod_state import chains, model, random_batch

# Written by the build before carries were kept (main at 027b180), for a pod of E=24 blocks: a snapshot of blocks
# 1 and 2 (1 left 8 tokens, 2 none), then a delta storing 3 and removing 1.
OLD_SNAPSHOT = bytes.fromhex(
    "9d0191a146801891a3677075c41001000000000000000200000000000000c4186500000000000000660000000000000067000000000000"
    "009201029100c4010291ff8090")
OLD_DELTA = bytes.fromhex(
    "9e02801891a14691a3677075c4020001c4100300000000000000010000000000000091009101c4086800000000000000c40100c40100916790")
OLD_MUTATIONS = ([StoreBlock(1, "gpu", "F", (101,), 0, True, CHAIN_ROOT), StoreBlock(2, "gpu", "F", (102, 103), 0, True, 101)],
                 [StoreBlock(3, "gpu", "F", (104,), 0, False, 103), RemoveBlock(1, "gpu", 0)])


def carries_for(rng: random.Random, muts) -> dict[int, Carry]:
    """A carry for some of a batch's stores, of every shape: tokens or none, ids, a salt."""
    out = {}
    for m in muts:
        if isinstance(m, StoreBlock) and rng.random() < 0.7:
            tokens = tuple(rng.randrange(0, 2**32) for _ in range(rng.randrange(0, 16)))
            ids = tuple(f"mm{rng.randrange(9)}" for _ in range(rng.randrange(0, 3))) if rng.random() < 0.2 else ()
            out[m.engine_key] = Carry(tokens, ids, "salt" if rng.random() < 0.1 else None)
    return out


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), hybrid=st.booleans())
def test_a_pods_carries_come_back_from_its_log_as_planned(seed, hybrid):
    """Batches with carries, planned and logged: at every batch the log (the last snapshot and the deltas since)
    restores the carries the state holds, and they are exactly those of held blocks, each the last given."""
    rng = random.Random(seed)
    state = PodState(engine_block_size=24)
    world = chains(rng, 3, 8, 1)
    held: set = set()
    given_last: dict[int, Carry] = {}
    snapshot, deltas = encode_snapshot(state, 0), []
    for gen in range(1, 40):
        muts = random_batch(rng, world, held, hybrid)
        carries = carries_for(rng, muts)
        given_last.update(carries)
        state = state.plan(muts, None, carries).after
        deltas.append(encode_delta(gen, muts, None, 24, carries))
        engine_keys = {ek for ek, _, _ in state.blocks}
        assert set(state.carries) <= engine_keys
        assert all(given_last[ek] == c for ek, c in state.carries.items())
        if gen % 11 == 0:
            snapshot, deltas = encode_snapshot(state, gen), []
        again, at = restore(snapshot, deltas)
        assert at == gen and again.carries == state.carries and model(again) == model(state)


def test_a_carry_is_kept_while_its_block_is_held_in_any_tier():
    state = PodState(engine_block_size=24)
    c = Carry((7, 8, 9))
    stores = [StoreBlock(1, "gpu", "F", (11,), 0, False, CHAIN_ROOT), StoreBlock(1, "cpu", "F", (11,), 0, False, CHAIN_ROOT)]
    state.plan(stores, None, {1: c})
    assert state.carries == {1: c}
    state.plan([RemoveBlock(1, "gpu")])
    assert state.carries == {1: c}  # still on the CPU tier
    state.plan([RemoveBlock(1, "cpu")])
    assert state.carries == {}
    state.plan([stores[0], RemoveBlock(1, "gpu")], None, {1: c})  # stored and let go in one batch
    assert state.carries == {}
    state.plan([stores[0]], None, {1: c, 5: Carry(())})  # a carry of a block the batch does not store: not taken
    assert state.carries == {1: c}
    state.plan([ClearPod(), StoreBlock(2, "gpu", "F", (12,), 0, False, 11)], None, {2: Carry(())})
    assert state.carries == {2: Carry(())}


def test_a_log_an_earlier_build_wrote_loads_with_no_carries():
    """Aligned or not, a log without carries reads as before (a child of its mid-key blocks is an orphan, as it
    was), and a batch without carries still writes those bytes: the log's size for aligned pods is unchanged."""
    state, gen = restore(OLD_SNAPSHOT, [OLD_DELTA], "p")
    assert gen == 2 and state.carries == {} and state.block_keys(3) == ((104,), 103) and state.block_keys(1) is None
    before = PodState(engine_block_size=24, pod_id="p")
    before.plan(OLD_MUTATIONS[0])
    assert encode_snapshot(before, 1) == OLD_SNAPSHOT
    assert encode_delta(2, OLD_MUTATIONS[1], None, 24) == encode_delta(2, OLD_MUTATIONS[1], None, 24, {}) == OLD_DELTA


def test_an_earlier_build_reads_a_log_with_carries_as_one_without():
    """A fleet mid-upgrade: the earlier build's decoders take the carries column for a field after their own."""
    state = PodState(engine_block_size=24, pod_id="p")
    state.plan(OLD_MUTATIONS[0], None, {1: Carry(tuple(range(8))), 2: Carry(())})
    snap = msgspec.msgpack.Decoder(pod_log._Snapshot).decode(encode_snapshot(state, 1))
    delta = msgspec.msgpack.Decoder(pod_log._Delta).decode(
        encode_delta(2, OLD_MUTATIONS[1], None, 24, {3: Carry((1, 2))}))
    assert snap.gen == 1 and delta.gen == 2 and pod_log._mutations(delta) == OLD_MUTATIONS[1]


def test_carries_of_several_shapes_take_a_few_bytes_each():
    """The column holds the tokens and a byte per block; ids and salts only where a carry has them."""
    muts = [StoreBlock(i, "gpu", "F", (100 + i,), 0, False, CHAIN_ROOT if i == 1 else 99 + i) for i in range(1, 9)]
    carries = {i: Carry((5,) * 8 if i % 2 else ()) for i in range(1, 9)}
    carries[8] = Carry((), ("mm",), "s")
    plain, carried = encode_delta(1, muts, None, 24), encode_delta(1, muts, None, 24, carries)
    assert len(carried) - len(plain) <= 8 + 4 * 8 + 12 + 6
    state, _ = restore(None, [carried])
    assert state.carries == carries


junk = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=4) | st.binary(max_size=8),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.integers(-2, 9) | st.text(max_size=2),
                                                                                inner, max_size=4), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(value=junk, in_snapshot=st.booleans())
def test_a_carries_column_that_does_not_read_is_left_out_and_the_pod_loads(value, in_snapshot):
    """Anything in the carries column (a hand edit, a bug elsewhere) loads the pod with its blocks, and with no
    carry or only carries that are whole; never an error."""
    muts = [StoreBlock(1, "gpu", "F", (101,), 0, True, CHAIN_ROOT), StoreBlock(2, "gpu", "F", (102,), 0, False, 101)]
    raw = msgspec.Raw(msgspec.msgpack.encode(value))
    state = PodState(engine_block_size=24)
    state.plan(muts)
    if in_snapshot:
        plain = msgspec.msgpack.Decoder(pod_log._Snapshot).decode(encode_snapshot(state, 1))
        log = (msgspec.msgpack.encode(pod_log._CarriedSnapshot(*msgspec.structs.astuple(plain), raw)), [])
    else:
        plain = msgspec.msgpack.Decoder(pod_log._Delta).decode(encode_delta(1, muts, None, 24))
        log = (None, [msgspec.msgpack.encode(pod_log._CarriedDelta(*msgspec.structs.astuple(plain), raw))])
    again, gen = restore(*log)
    assert gen == 1 and model(again) == model(state)
    assert set(again.carries) <= {1, 2} and all(isinstance(c, Carry) and all(isinstance(t, int) for t in c.tokens)
                                               for c in again.carries.values())


def good_log() -> tuple[list, list]:
    """A snapshot and a delta that read, as their msgpack arrays (a test puts junk in one field of either)."""
    muts = [StoreBlock(1, "gpu", "F", (101,), 0, True, CHAIN_ROOT), StoreBlock(2, "gpu", "F", (102,), 0, False, 101),
            RemoveBlock(1, "gpu", 0)]
    state = PodState(engine_block_size=24)
    state.plan(muts[:2], None, {1: Carry((1, 2))})
    return (msgspec.msgpack.decode(encode_snapshot(state, 1)),
            msgspec.msgpack.decode(encode_delta(2, muts, None, 24, {2: Carry((3,))})))


@settings(max_examples=400, deadline=None)
@given(value=junk | st.binary(max_size=40), where=st.sampled_from(["snapshot", "delta", "snapshot field", "delta field"]),
       at=st.integers(0, 20))
def test_a_log_that_does_not_read_is_one_clear_error(value, where, at):
    """Junk in a whole log entry or in one of its fields (a hand edit, a bug, a build that writes another format):
    ``restore`` raises ``PodLogError`` (a ValueError naming the pod), which the ingester handles per pod; the
    decoder's own errors (msgspec's, struct's, an index out of range, an exhausted column) left the ingest loop and
    ended the process, and every process that took the pod over after it."""
    snapshot, delta = good_log()
    if where.endswith("field"):
        entry = list(snapshot if where.startswith("snapshot") else delta)
        entry[at % len(entry)] = value
        value = entry
    raw = value if isinstance(value, bytes) and not where.endswith("field") else msgspec.msgpack.encode(value)
    log = (raw, []) if where.startswith("snapshot") else (msgspec.msgpack.encode(snapshot), [raw])
    try:
        restore(*log, "p")
    except pod_log.PodLogError as exc:
        assert "p" in str(exc) and isinstance(exc, ValueError)


carry_runs = st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2**32 - 1)).map(lambda t: ("new", t)),
                                st.lists(st.integers(0, 2**32 - 1), max_size=4).map(lambda t: ("more", tuple(t))),
                                st.just(("salted", ()))), max_size=40)


@settings(max_examples=300, deadline=None)
@given(run=carry_runs)
def test_carries_that_continue_the_one_before_come_back_whole(run):
    """A carry written as what it adds to the one before it (``_Carries.extends``) reads back as it was, whatever
    the sequence: none between, one no longer, an empty one, ids and a salt beside."""
    carries: list[Carry | None] = []
    for step in run:
        prev = carries[-1] if carries else None
        if step is None:
            carries.append(None)
        elif step[0] == "new":
            carries.append(Carry(step[1]))
        elif step[0] == "more":
            carries.append(Carry((prev.tokens if prev else ()) + step[1]))
        else:
            carries.append(Carry(prev.tokens if prev else (), ("mm",), "s"))
    raw = pod_log._carry_column(carries)
    want = {i: c for i, c in enumerate(carries) if c is not None}
    assert (raw is None) == (not want)
    assert pod_log._read_carries(raw or msgspec.Raw(), list(range(len(carries))), "p") == want


def test_a_chain_of_blocks_smaller_than_a_request_key_writes_each_carry_as_its_own_tokens():
    """E = 1 (SGLang's default page), C = 16: each block's carry is its parent's and its own token; written whole,
    the column took about 7.5 tokens a block, now one (and the bit that says so)."""
    chain, carry = [], ()
    for i in range(64):
        carry = (carry + (100_000 + i,))[-((len(carry) + 1) % 16):] if (len(carry) + 1) % 16 else ()
        chain.append(Carry(carry))
    raw = pod_log._carry_column(chain)
    assert len(raw) <= 64 * (1 + 5) + 8 + 4
    assert pod_log._read_carries(raw, list(range(64)), "p") == dict(enumerate(chain))
