"""A Valkey Cluster run's per-op loops (kv_preflight/index/cluster/outbox_ops.py): the outbox ops of a plan's changes,
the run's first pass (the request keys' changes and the drops' probes) and its engine-key round, built in C
(kv_preflight/index/_write_path.c) where it is built, each equal to its Python reference on random runs."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.index.cluster import outbox_ops
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange

pytestmark = pytest.mark.skipif(outbox_ops._c is None, reason="the C routines are not built")

_RK = st.sampled_from([0, 3, 7, 2**64 - 1, 10**18])
_RKS = st.lists(_RK, min_size=1, max_size=3).map(tuple)
_CHANGE = st.one_of(
    st.builds(KeyChange, _RK, st.sampled_from(["f", "g"]), st.sampled_from([1, 0, -1]), st.sampled_from(["0", ""]),
              st.sampled_from([1, 0, -1])),
    st.builds(EngineAdd, _RK, _RKS),
    st.builds(EngineDrop, _RK, _RKS),
)


@settings(max_examples=300, deadline=None)
@given(changes=st.lists(_CHANGE, max_size=25), num=st.sampled_from([None, 0, 9, 300]),
       empty=st.lists(st.integers(0, 3), max_size=25))
def test_a_runs_loops_in_c_are_their_python_references(changes, num, empty):
    ops = outbox_ops.change_ops(changes, num)
    assert ops == outbox_ops.change_ops_py(changes, num)
    assert msgspec.msgpack.encode(ops) == msgspec.msgpack.encode(outbox_ops.change_ops_py(changes, num))
    got = outbox_ops._c.run_keys(ops)
    assert got is not None and got == outbox_ops._run_keys(ops)
    key_ops = got[0]
    assert [type(op) for op in key_ops] == [type(op) for op in outbox_ops._run_keys(ops)[0]]
    empty_at = {j: n for j, n in enumerate(empty) if n}  # how many of each drop's keys round A found empty
    got = outbox_ops._c.engine_round(ops, empty_at, outbox_ops.ENGINE_PREFIX)
    assert got is not None and got == outbox_ops._engine_round(ops, empty_at)


def test_an_op_of_another_shape_is_left_to_python():
    """A hand-made outbox entry (decoded and checked by ``decode_entry``, but of no shape the C loops take)
    goes through the Python reference: the C routines answer None."""
    ops = [["K", 1, "f", 1, "0", 1, 1, 1], ["X", 5, []], ["Z", 2**64, [1]]]
    assert outbox_ops._c.engine_round(ops, {}, outbox_ops.ENGINE_PREFIX) is None
    assert outbox_ops._c.engine_round([["Z", 2**64, [1]]], {}, outbox_ops.ENGINE_PREFIX) is None
    assert outbox_ops._c.run_keys([("K", 1), ["?", 1]]) is None


@settings(max_examples=300, deadline=None)
@given(changes=st.lists(_CHANGE, max_size=25), back=st.sets(_RK), empty=st.lists(st.integers(0, 3), max_size=25))
def test_the_raced_drops_in_c_are_the_python_reference(changes, back, empty):
    """Round D: the drops whose key holds an entry again with no later store of the run to explain it."""
    ops = outbox_ops.change_ops(changes, 3)
    _, _, drops = outbox_ops._engine_round(ops, {j: n for j, n in enumerate(empty) if n})
    assert outbox_ops._c.raced(ops, drops, back) == outbox_ops._raced(ops, drops, back)


def test_a_store_after_the_drop_explains_its_entry_and_one_before_does_not():
    x, k = ["X", 5, [3]], ["K", 3, "f", 1, "0", 1, 1, 1]
    for c in (outbox_ops._c.raced, outbox_ops._raced):
        assert c([x, k], [(0, x)], {3}) == []  # the run stored the key again after the drop
        assert c([k, x], [(1, x)], {3}) == [(1, x)]  # stored before the drop: another writer's entry
        assert c([k, x], [(1, x)], {4}) == []  # the key holds no entry again


def test_a_short_k_op_is_the_python_references_index_error():
    """A K op too short for op[1] or, when its key is asked for, op[3]: Python's IndexError (a C loop that
    skipped it would do so silently)."""
    for ops, keys in [([["K"]], {1}), ([["K", 1, "f"]], {1})]:
        with pytest.raises(IndexError):
            outbox_ops._raced(ops, [], keys)
        with pytest.raises(IndexError):
            outbox_ops._c.raced(ops, [], keys)
    assert outbox_ops._c.raced([["K", 1, "f"]], [], {2}) == outbox_ops._raced([["K", 1, "f"]], [], {2}) == []


def test_a_change_missing_fields_goes_to_python():
    """A NamedTuple made by tuple.__new__ may lack fields the C loops read by position: they leave it to the
    Python twins, which say what is wrong, never a read past the tuple."""
    from kv_preflight.index import changes as ch
    short = tuple.__new__(EngineAdd, (1,))
    assert outbox_ops._c.change_ops([short], 1, 1, outbox_ops._CHANGE_TYPES) is None
    assert ch._change_args_c([short], b"1:\x01", ch._CHANGE_TYPES, *ch._PRESENCE_NAME, ch.ENGINE_PREFIX) is None
    with pytest.raises(IndexError):
        outbox_ops.change_ops([short], 0)
    with pytest.raises(IndexError):
        ch.change_args([short], 0)


def test_an_outbox_field_not_of_the_written_shape_is_malformed():
    """"<n>|<writer>|<ms>" or nothing: a field of another shape (a hand edit) is deleted unrun, never split
    further on (the takeover of another writer's entries renames them by that shape, and raised on it)."""
    import msgspec

    from kv_preflight.index.cluster.outbox_ops import decode_entry

    payload = msgspec.msgpack.encode([["Z", 7, [11]]])
    assert decode_entry(b"5|host:1:ab@2000|1796000000000", payload) == (5, [["Z", 7, [11]]])
    for field in (b"5|x", b"5", b"5|w|soon", b"x|w|1", b""):
        assert decode_entry(field, payload) is None, field
