"""A Valkey Cluster run's outbox entries and per-change loops (kv_preflight/index/cluster/outbox_ops.py): an entry
stored and read back, the run's first pass (the request keys' changes and the drops' probes) and its engine-key
rounds, built in C (kv_preflight/index/_write_path.c) where it is built, each equal to its Python reference on
random runs."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.index.changes import Probe
from kv_preflight.index.cluster import outbox_ops
from kv_preflight.index.cluster.outbox_ops import OutboxEntry, decode_entry, outbox_payload
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange

needs_c = pytest.mark.skipif(outbox_ops._c is None, reason="the C routines are not built")
FIELD = b"5|host:1:ab@2000|1796000000000"

_RK = st.sampled_from([0, 3, 7, 2**64 - 1, 10**18])
_RKS = st.lists(_RK, min_size=1, max_size=3).map(tuple)
_CHANGE = st.one_of(
    st.builds(KeyChange, _RK, st.sampled_from(["f", "g"]), st.sampled_from([1, 0, -1]), st.sampled_from(["0", ""]),
              st.sampled_from([1, 0, -1])),
    st.builds(EngineAdd, _RK, _RKS),
    st.builds(EngineDrop, _RK, _RKS),
)
_ENTRY = st.builds(OutboxEntry, st.sampled_from([0, 9, 300]), st.sampled_from([b"", b"\x02"]),
                   st.lists(_CHANGE, max_size=25))
_ENTRIES = st.lists(_ENTRY, min_size=1, max_size=3)


def _flat(entries: list[OutboxEntry]) -> list:
    return [c for e in entries for c in e.changes]


@settings(max_examples=300, deadline=None)
@given(entry=_ENTRY)
def test_an_entry_reads_back_as_the_plan_made_it(entry):
    """What the pod step stores is the plan's changes themselves: read back, each change is of its own type (a drop
    is no add, though both are an engine key and its request keys) with its own fields, in order."""
    back = decode_entry(FIELD, outbox_payload(entry))
    assert back is not None and back[0] == 5
    assert back[1] == entry and [type(c) for c in back[1].changes] == [type(c) for c in entry.changes]


@needs_c
@settings(max_examples=300, deadline=None)
@given(entries=_ENTRIES, empty=st.lists(st.integers(0, 3), max_size=75))
def test_a_runs_loops_in_c_are_their_python_references(entries, empty):
    """Over one or several entries (a drain, a pipelined run: positions count across them), the C loops give what
    the Python references give, each key op with its own entry and of the same type (a KeyChange, a Probe)."""
    got = outbox_ops._c.run_keys(entries, outbox_ops._TYPES)
    want = outbox_ops._run_keys(entries)
    assert got is not None and got == want
    assert [type(op) for op in got[0]] == [type(op) for op in want[0]]
    assert all(a is b for a, b in zip(got[1], want[1]))
    changes = _flat(entries)
    empty_at = {j: n for j, n in enumerate(empty) if n}  # how many of each drop's keys round A found empty
    got = outbox_ops._c.engine_round(changes, empty_at, outbox_ops.ENGINE_PREFIX, outbox_ops._TYPES)
    assert got is not None and got == outbox_ops._engine_round(changes, empty_at)


def test_a_change_of_another_shape_is_left_to_python():
    """Changes of no shape the C loops take (another type, an engine key outside uint64, request keys not a
    non-empty tuple) go through the Python reference: the C routines answer None."""
    c, t, prefix = outbox_ops._c, outbox_ops._TYPES, outbox_ops.ENGINE_PREFIX
    if c is None:
        pytest.skip("the C routines are not built")
    for odd in ([EngineAdd(2**64, (1,))], [EngineDrop(5, ())], [EngineAdd(5, [1])], [("K", 1)]):
        assert c.engine_round([KeyChange(1, "f", 1, "0", 1), *odd], {}, prefix, t) is None, odd
    assert c.run_keys([OutboxEntry(0, b"", [KeyChange(1, "f", 1, "0", 1), ("?", 1)])], t) is None
    assert c.run_keys([OutboxEntry(0, b"", [EngineDrop(5, ())])], t) is None
    assert c.run_keys([(0, b"")], t) is None


@needs_c
@settings(max_examples=300, deadline=None)
@given(entries=_ENTRIES, back=st.sets(_RK), empty=st.lists(st.integers(0, 3), max_size=75))
def test_the_raced_drops_in_c_are_the_python_reference(entries, back, empty):
    """Round D: the drops whose key holds an entry again with no later store of the run to explain it."""
    changes = _flat(entries)
    _, _, drops = outbox_ops._engine_round(changes, {j: n for j, n in enumerate(empty) if n})
    assert outbox_ops._c.raced(changes, drops, back, outbox_ops._TYPES) == outbox_ops._raced(changes, drops, back)


def test_a_store_after_the_drop_explains_its_entry_and_one_before_does_not():
    x, k = EngineDrop(5, (3,)), KeyChange(3, "f", 1, "0", 1)
    c = outbox_ops._c
    for raced in [outbox_ops._raced] + ([lambda *a: c.raced(*a, outbox_ops._TYPES)] if c is not None else []):
        assert raced([x, k], [(0, x)], {3}) == []  # the run stored the key again after the drop
        assert raced([k, x], [(1, x)], {3}) == [(1, x)]  # stored before the drop: another writer's entry
        assert raced([k, x], [(1, x)], {4}) == []  # the key holds no entry again


def test_a_change_missing_fields_goes_to_python():
    """A NamedTuple made by tuple.__new__ may lack fields the C loops read by position: they leave it to the
    Python references, which say what is wrong, never a read past the tuple."""
    from kv_preflight.index import changes as ch
    short_add, short_key = tuple.__new__(EngineAdd, (1,)), tuple.__new__(KeyChange, (1, "f"))
    if outbox_ops._c is not None:
        t = outbox_ops._TYPES
        for short in (short_add, short_key):
            assert outbox_ops._c.run_keys([OutboxEntry(0, b"", [short])], t) is None
            assert outbox_ops._c.engine_round([short], {}, outbox_ops.ENGINE_PREFIX, t) is None
            assert outbox_ops._c.raced([short], [], {1}, t) is None
        assert ch._change_args_c([short_add], b"1:\x01", ch._CHANGE_TYPES, *ch._PRESENCE_NAME, ch.ENGINE_PREFIX) is None
    with pytest.raises(ValueError):
        outbox_ops._engine_round([short_add], {})
    with pytest.raises(IndexError):
        outbox_ops._raced([short_key], [], {1})
    with pytest.raises(IndexError):
        ch.change_args([short_add], 0)


def test_an_outbox_field_not_of_the_written_shape_is_malformed():
    """"<n>|<writer>|<ms>" or nothing: a field of another shape (a hand edit) is deleted unrun, never split
    further on (the takeover of another writer's entries renames them by that shape, and raised on it)."""
    payload = outbox_payload(OutboxEntry(3, b"", [EngineAdd(7, (11,))]))
    assert decode_entry(FIELD, payload) == (5, OutboxEntry(3, b"", [EngineAdd(7, (11,))]))
    for field in (b"5|x", b"5", b"5|w|soon", b"x|w|1", b""):
        assert decode_entry(field, payload) is None, field


K = [1, "f", 1, "0", 1]


@pytest.mark.parametrize("raw", [
    # a previous build's entry: the changes as ops, each carrying the pod's bit position ("K", ..., byte, mask)
    [["K", 1, "f", 1, "0", 1, 1, 1], ["Z", 7, [1]], ["X", 7, [1]]],
    [["K", 1, "f", 1, "0", 1, 1, 1, b"\x02"]],
    [], [0, b"", []], [0, b"", [K], [], "more"], {"num": 0}, "x", None,
    [-1, b"", [K], []], [outbox_ops.MAX_NUM, b"", [K], []], [True, b"", [K], []], [0.0, b"", [K], []],
    [0, "", [K], []], [0, b"\0" * (outbox_ops.MAX_NUM // 8 + 1), [K], []],
    [0, b"", [[-1, "f", 1, "0", 1]], []],
    [0, b"", [[1, b"f", 1, "0", 1]], []], [0, b"", [[1, "f", 1.0, "0", 1]], []], [0, b"", [[1, "f", 1, 0, 1]], []],
    [0, b"", [[1, "f", 1, "0", True]], []], [0, b"", [[1, "f", 1, "0"]], []], [0, b"", [(1, "f")], []],
    [0, b"", [[7, []]], []], [0, b"", [[7, [1, -2]]], []], [0, b"", [[7, 1]], []], [0, b"", [[-7, [1]]], []],
    [0, b"", [K], [0]],  # a drop's position on a key change
    [0, b"", [[7, [1]]], [1]],  # a position past the changes
    [0, b"", [[7, [1]]], [0, 0]],  # named twice
    [0, b"", [[7, [1]]], ["0"]], [0, b"", [[7, [1]]], 0],
])
def test_an_entry_of_another_shape_is_malformed(raw):
    """Anything may be in Valkey: an entry not of the shape ``outbox_payload`` writes (a previous build's list of
    ops among them) is malformed, never run, and no item of it reaches the rounds unchecked."""
    assert decode_entry(FIELD, msgspec.msgpack.encode(raw)) is None
    assert decode_entry(FIELD, b"\xc1") is None  # not msgpack at all


_MSGPACK = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=3)
                        | st.binary(max_size=3) | st.sampled_from([0, 1, 7, -1, "f", "0", ""]),
                        lambda inner: st.lists(inner, max_size=6), max_leaves=30)


_ITEM = st.one_of(_MSGPACK, st.tuples(_RK, st.sampled_from(["f", 1]), st.sampled_from([1, -1, True]),
                                      st.sampled_from(["0", ""]), st.sampled_from([1, 0])).map(list),
                  st.tuples(_RK, st.lists(st.one_of(_RK, st.just(-1)), max_size=2)).map(list))


@settings(max_examples=500, deadline=None)
@given(raw=st.one_of(_MSGPACK, st.tuples(st.integers(0, 20), st.binary(max_size=2), st.lists(_ITEM, max_size=6),
                                         st.lists(st.integers(-1, 6), max_size=3)).map(list)))
def test_whatever_is_stored_decodes_to_an_entry_of_the_three_changes_or_to_nothing(raw):
    """No payload makes ``decode_entry`` raise, and what it gives back is an OutboxEntry of the three change types,
    whose fields the rounds (and the C loops, which read them by position) may take as they are."""
    got = decode_entry(FIELD, msgspec.msgpack.encode(raw))
    if got is None:
        return
    entry = got[1]
    assert type(entry.num) is int and 0 <= entry.num < outbox_ops.MAX_NUM and type(entry.sibs) is bytes
    for c in entry.changes:
        assert type(c) in (KeyChange, EngineAdd, EngineDrop)
        if type(c) is KeyChange:
            assert [type(x) for x in c] == [int, str, int, str, int] and 0 <= c.rk < 2**64
        else:
            assert type(c.rks) is tuple and c.rks and all(type(x) is int and 0 <= x < 2**64 for x in (c.ek, *c.rks))
    assert decode_entry(FIELD, outbox_payload(entry)) == got


def test_a_probe_made_in_c_is_a_probe():
    """run_keys makes its probes itself (tuple.__new__'s way): each is a Probe, equal to the Python one."""
    if outbox_ops._c is None:
        pytest.skip("the C routines are not built")
    e = OutboxEntry(0, b"", [EngineDrop(5, (3, 4, 3))])
    got = outbox_ops._c.run_keys([e], outbox_ops._TYPES)[0]
    assert sorted(got) == [Probe(3, 0), Probe(4, 0)] and {type(p) for p in got} == {Probe}
    assert got[0].rk in (3, 4) and got[0].at == 0
    with pytest.raises(TypeError):
        outbox_ops._c.run_keys([e], (KeyChange, EngineAdd, EngineDrop, dict))
