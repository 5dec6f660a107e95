"""The C routine's input forms (list, tuple, buffers) and the packed chain the lookup script reads."""
import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.keys import chain as keys


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70), block_size=st.integers(1, 17))
def test_every_input_form_gives_the_reference_keys(tokens, block_size):
    ref = keys.request_keys_reference(tokens, model="m", block_size=block_size)
    for form in (tokens, tuple(tokens), array.array("I", tokens), array.array("Q", tokens),
                 memoryview(array.array("L", tokens))):
        assert keys.request_keys(form, model="m", block_size=block_size) == ref


def test_large_ints_take_the_slow_path_and_still_agree():
    toks = [2**30 - 1, 2**30, 2**31, 2**32 - 1] * 8  # one and two 30-bit digits
    assert keys.request_keys(toks, model="m") == keys.request_keys_reference(toks, model="m")


@pytest.mark.parametrize("bad", [array.array("i", [-1] * 16), array.array("q", [2**32] * 16), array.array("d", [1.0] * 16),
                                 [2**64] * 16, [-(2**40)] * 16])
def test_buffers_and_ints_out_of_uint32_are_rejected(bad):
    with pytest.raises(ValueError):
        keys.request_keys(bad, model="m")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_pack_keys_is_fixed_width_decimal(ks):
    packed = keys.pack_keys(ks)
    assert packed == b"".join(b"%20d" % k for k in ks)
    assert [int(packed[i * 20:(i + 1) * 20]) for i in range(len(ks))] == ks


def test_pack_command_equals_the_python_packer():
    from kv_preflight.index.resp import _pack_c, _pack_py

    assert _pack_c is not None
    args = ("EVALSHA", "abc", 0, b"xy", 2**64 - 1, -5, "\u00e9", 1.5, bytearray(b"q"), memoryview(b"mv"), "")
    assert _pack_c(args) == _pack_py(args)
    with pytest.raises(OverflowError):
        _pack_c([2**64])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([0, 9, 10, -1, 2**63 - 1, 2**63, -(2**63)]),
                          st.text(max_size=30), st.binary(max_size=70)), min_size=1, max_size=40))
def test_pack_command_writes_every_int_and_length_as_python_does(args):
    """pack_command writes numbers with its own decimal routine (snprintf was most of its cost): every int of
    [-2**63, 2**64), every length and argument count, byte for byte as the Python packer."""
    from kv_preflight.index.resp import _pack_c, _pack_py

    assert _pack_c(args) == _pack_py(args)


@pytest.mark.parametrize("bad, error", [(2**64, OverflowError), (-1, OverflowError), (2**90, OverflowError),
                                         ("7", TypeError), (7.0, TypeError)])
def test_keys_outside_uint64_are_refused_as_before(bad, error):
    from kv_preflight._speedups import slot_groups

    with pytest.raises(error):
        keys.pack_keys([1, bad])
    with pytest.raises(error):
        slot_groups([1, bad], bytes(16384), 1)
