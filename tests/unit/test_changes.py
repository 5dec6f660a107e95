"""changes.lua's argument lists (index/changes.py): which ops a plan's changes become, and how many ops a
list holds (a Valkey Cluster shard names a moved op by its position: the count must match the script's)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.index import changes
from kv_preflight.index.changes import (Probe, change_args, change_args_py, folds_probe, key_ops, lua_op_count,
                                        mine, shard_args, shard_args_py)
from kv_preflight.index.layout import presence_key
from kv_preflight.index.pod_state import EngineAdd, EngineDrop, KeyChange


def test_mine_is_the_pods_bit_alone():
    assert mine(0) == b"1:\x01"
    assert mine(9) == b"1:\x00\x02"


def test_a_block_of_one_key_is_one_register_and_one_store():
    args = change_args([EngineAdd(7, (11,)), KeyChange(11, "f", 1, "0", 1)], 3)
    assert args[0] == "F" and args[4:] == ["S", 1, 11, "kvpf:{11}", "engine:7"]
    assert lua_op_count(args) == 2


def test_blocks_in_a_row_are_one_run():
    """A batch's stores (and its evictions) under one field and bit are one S (R) op: one op name and one
    dispatch in the script per run, not per block."""
    changes = [KeyChange(rk, "f", 1, "0", 1) for rk in (11, 12, 13)] + \
              [KeyChange(rk, "f", -1, "0", -1) for rk in (11, 12)] + [KeyChange(14, "g", 1, "0", 1)]
    args = change_args(changes, 3)
    assert args[4:6] == ["S", 3] and args[15:17] == ["R", 2]
    assert args[23:25] == ["F", "g"] and args[27:29] == ["S", 1]
    assert lua_op_count(args) == 8  # F, 3 stores, 2 evictions, F, 1 store: each block counts


def test_an_entry_and_its_bit_are_two_ops_for_the_script():
    """A cluster shard runs an outbox K change as E and B: two positions in the script's count."""
    args = key_ops(11, "f", 1, "0", 1, 3)
    assert args[0] == "E" and args[3] == "B"
    assert lua_op_count(args) == 2
    assert lua_op_count(key_ops(11, "f", 1, "0", 0, 3)) == 1  # the general form
    assert lua_op_count(key_ops(11, "f", -1, "", 0, 3)) == 1  # an entry with no bit


def test_counts_ops_of_every_kind_and_length():
    changes = [
        EngineAdd(7, (11, 12)), KeyChange(11, "f", 1, "0", 1), KeyChange(12, "f", 1, "0", 1),
        KeyChange(13, "g", -1, "0|1", -1), EngineDrop(8, (13,)),
        KeyChange(14, "f", 1, "0", 0), EngineDrop(9, (15, 16, 17)),
    ]
    args = change_args(changes, 2)
    # Z(2 keys), F, S(2 blocks), F, R (with the drop beside it), K, X(3 keys)
    assert args[:3] == ["Z", "engine:7", 2] and args[5:11] == ["F", "f", "0", mine(2), "S", 2]
    assert lua_op_count(args) == 8


def test_a_shards_changes_run_in_runs_and_each_position_names_its_change():
    """A cluster shard gets its outbox changes as s/r runs under F (not an E and a B per change, each with its
    field, bit and value again; no engine key slot, which a shard never fills), and every position the script
    counts maps back to the change it runs."""
    two, nine = (2, b""), (9, b"")  # the changes' pods (their outbox entries: bit position, sibling bits)
    ops = [KeyChange(11, "f", 1, "0", 1), KeyChange(12, "f", 1, "0", 1), Probe(13, 5), KeyChange(13, "f", -1, "0", -1),
           KeyChange(14, "g", 1, "0", 1), KeyChange(15, "g", 1, "0", 0), KeyChange(16, "g", 1, "0", 1)]
    args, owners, folded = shard_args(ops, [two, two, two, two, nine, nine, nine])
    assert folded == {}  # the probe of 13 comes before its removal: sent
    assert args[:4] == ["F", "f", "0", mine(2)] and args[4:10] == ["s", 2, 11, presence_key(11), 12, presence_key(12)]
    assert args[10:13] == ["q", 13, 5] and args[13:17] == ["r", 1, 13, presence_key(13)]
    assert args[17:21] == ["F", "g", "0", mine(9)] and args[21:23] == ["s", 1]
    assert args[25] == "K"  # an entry without its bit: the general form
    assert args[34:38] == ["s", 1, 16, presence_key(16)]  # a new run after it
    assert len(args) == 38
    assert "E" not in args and "B" not in args
    assert len(owners) == lua_op_count(args)
    assert owners == [0, 0, 1, 2, 3, 4, 4, 5, 6]


def test_a_drops_probe_rides_on_its_keys_removal_just_before_it():
    """A probe right after the removal of its key's entry (an r block) is answered by that block, so it is not
    sent; one after a store, after another key's removal, or after the general form is."""
    ops = [KeyChange(13, "f", -1, "0", -1), Probe(13, 7), KeyChange(14, "f", -1, "0", -1), Probe(13, 8),
           KeyChange(15, "f", 1, "0", 1), Probe(15, 9), KeyChange(16, "f", -1, "0", 0), Probe(16, 10)]
    assert [folds_probe(ops[i - 1], ops[i], b"") for i in (1, 3, 5, 7)] == [True, False, False, False]
    assert not folds_probe(ops[0], ops[1], b"\x02")  # a rank's removal goes in the general form, under G
    args, owners, folded = shard_args(ops, [(2, b"")] * len(ops))
    assert args[:8] == ["F", "f", "0", mine(2), "r", 2, 13, presence_key(13)]  # no q for 13's first probe
    assert folded == {2: 1}  # the script's op 2 (the r block of 13, after F) answers the probe at ops[1]
    assert args.count("q") == 3 and ["q", 13, 8] == args[10:13]
    assert len(owners) == lua_op_count(args)
    assert 1 not in owners and {3, 5, 7} <= set(owners)


_RK = st.sampled_from([0, 7, 13, 2**64 - 1, 10**18])
_K = st.builds(lambda rk, fld, e, bit: KeyChange(rk, fld, e, bit, e if bit else 0),
               _RK, st.sampled_from(["f", "g"]), st.sampled_from([1, -1]), st.sampled_from(["0", "1|1", ""]))
_Q = st.builds(Probe, _RK, st.integers(0, 50))
_POD = st.builds(lambda num: (num, b""), st.sampled_from([0, 2, 9, 63]))  # an entry's bit position, no siblings


@pytest.mark.skipif(changes._shard_args_c is None, reason="the C routines are not built")
@settings(max_examples=400, deadline=None)
@given(ops=st.lists(st.tuples(st.one_of(_K, _Q), _POD), max_size=30),
       general=st.lists(st.tuples(st.integers(0, 29), _RK), max_size=2),
       ranks=st.lists(st.tuples(st.integers(0, 29), _K, st.sampled_from([b"\x02", b"\x00\x01"])), max_size=2))
def test_a_shards_args_in_c_are_the_python_references(ops, general, ranks):
    """kv_preflight/index/_write_path.c builds a shard's share for s/r runs and probes (the usual case) and leaves
    anything else (a change in the general form; one of a pod with sibling ranks, sent under G) to Python: both
    give the same arguments, positions and folded probes; with only runs and probes the C routine is the one that
    answered."""
    for at, rk in general:  # an entry without its bit: the general form, left to Python
        ops.insert(min(at, len(ops)), (KeyChange(rk, "f", 1, "0", 0), (1, b"")))
    for at, c, sibs in ranks:
        ops.insert(min(at, len(ops)), (c, (3, sibs)))
    changes_, whose = [c for c, _ in ops], [pod for _, pod in ops]
    got = changes._shard_args_c(changes_, whose, mine, *changes._PRESENCE_NAME, changes._SHARD_TYPES)
    if not general and not ranks:
        assert got is not None
    assert shard_args(changes_, whose) == shard_args_py(changes_, whose)
    if got is not None:
        assert got == shard_args_py(changes_, whose)


_KC = st.builds(lambda rk, fld, e, bit: KeyChange(rk, fld, e, bit, e if bit else 0), _RK, st.sampled_from(["f", "g"]),
                st.sampled_from([1, -1]), st.sampled_from(["0", "1|1", ""]))
_EK = st.sampled_from([5, 2**64 - 1])
_RKS = st.one_of(_RK.map(lambda rk: (rk,)), st.lists(_RK, min_size=2, max_size=3).map(tuple))
_ENGINE = st.one_of(st.builds(EngineAdd, _EK, _RKS), st.builds(EngineDrop, _EK, _RKS))


@pytest.mark.skipif(changes._change_args_c is None, reason="the C routines are not built")
@settings(max_examples=400, deadline=None)
@given(pairs=st.lists(st.tuples(_KC, st.sampled_from(["add", "drop", "none"])), max_size=20),
       alone=st.lists(st.tuples(st.integers(0, 40), _ENGINE), max_size=4),
       general=st.lists(st.tuples(st.integers(0, 40), _RK), max_size=2), num=st.sampled_from([None, 0, 5, 70]))
def test_a_batchs_args_in_c_are_the_python_references(pairs, alone, general, num):
    """kv_preflight/index/_write_path.c builds a batch's arguments for S/R runs (with the engine key's add before a
    store, or its drop after a removal, riding on the block) and engine keys' adds and drops, and leaves the
    general form to Python: both give the same arguments; without the general form the C routine answered."""
    out: list = []
    for c, engine in pairs:  # as plans emit them: an add before its key's store, a drop after its removal
        if engine == "add":
            out += [EngineAdd(7, (c.rk,)), c]
        elif engine == "drop":
            out += [c, EngineDrop(7, (c.rk,))]
        else:
            out.append(c)
    for at, e in alone:
        out.insert(min(at, len(out)), e)
    for at, rk in general:  # an entry without its bit
        out.insert(min(at, len(out)), KeyChange(rk, "f", 1, "0", 0))
    got = changes._change_args_c(out, mine(num or 0), changes._CHANGE_TYPES, *changes._PRESENCE_NAME,
                                 changes.ENGINE_PREFIX)
    if not general:
        assert got is not None
    assert change_args(out, num) == change_args_py(out, num)
    if got is not None:
        assert got == change_args_py(out, num)


@pytest.mark.skipif(changes._change_args_c is None, reason="the C routines are not built")
def test_a_comparison_that_changes_the_list_cannot_free_what_change_args_reads():
    """The F register's comparison runs a field's __eq__, Python code: one that empties the list of changes
    frees the changes the C loop read (and the field and bit it kept as the register) unless it holds them."""
    code = """
        import gc
        from kv_preflight.index.changes import change_args, change_args_py
        from kv_preflight.index.pod_state import KeyChange
        held = []
        class Field(str):
            __hash__ = str.__hash__
            def __eq__(self, other):
                held.clear()
                gc.collect()
                return False
        held[:] = [KeyChange(1000 + i, Field("f%d" % i), 1, "b%d" % i, 1) for i in range(40)]
        kept = list(held)
        print(len(change_args(held, 3)) == len(change_args_py(kept, 3)))
        """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONMALLOC": "debug"}, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


@pytest.mark.parametrize("num", [2**61 + 1, 2**60 + 1, 2**63 - 1, 2**64, -1])
def test_a_bit_position_of_no_pod_is_pythons_error_not_another_pods_bit(num):
    """A change whose pod's bit position is far past any pod's (or negative) never becomes another pod's bit as F's
    value: the C routine leaves it to Python or calls ``mine`` with it as Python does, and both raise. (An outbox
    entry read from Valkey never gets here: ``decode_entry`` refuses a num past ``MAX_NUM``.)"""
    ops, whose = [KeyChange(5, "f", 1, "0", 1)], [(num, b"")]
    if changes._shard_args_c is not None:
        try:
            got = changes._shard_args_c(ops, whose, mine, *changes._PRESENCE_NAME, changes._SHARD_TYPES)
        except (MemoryError, OverflowError, ValueError):
            got = None
        assert got is None
    with pytest.raises((MemoryError, OverflowError, ValueError)):
        shard_args(ops, whose)
    with pytest.raises((MemoryError, OverflowError, ValueError)):
        shard_args_py(ops, whose)
