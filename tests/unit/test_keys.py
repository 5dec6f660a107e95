import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.keys import chain as keys
from tests.conftest import fixture_path

VECTORS = json.loads(fixture_path("llmd-request-keys.json").read_text())


def _kwargs(v):
    return dict(
        model=v["model"], hash_seed=v["hash_seed"], block_size=v["block_size"],
        parent=int(v["parent_request_key"]) or None, extra_per_block=v.get("mm_hashes_per_block"),
    )


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_llmd_vectors(vector):
    got = keys.request_keys(vector["tokens"], **_kwargs(vector))
    assert [str(k) for k in got] == vector["expected_request_keys"]


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_llmd_vectors_reference(vector):
    got = keys.request_keys_reference(vector["tokens"], **_kwargs(vector))
    assert [str(k) for k in got] == vector["expected_request_keys"]


def test_c_extension_is_built():
    # The fast path is the product; a silent fallback would hide a 100x slowdown.
    assert keys.HAS_C_EXTENSION
    # and the write path's loops (kv_preflight/index/_write_path.c): without them an ingester takes 2-3x the CPU
    from kv_preflight.index import changes, pod_log, pod_state
    from kv_preflight.index.cluster import outbox_ops
    assert None not in (pod_state._plan_blocks, pod_log._snapshot_columns, pod_log._delta_columns,
                        changes._change_args_c, changes._shard_args_c, outbox_ops._c)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 20),
    parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_fast_path_equals_reference(tokens, block_size, parent):
    kw = dict(model="m", hash_seed="s", block_size=block_size, parent=parent)
    assert keys.request_keys(tokens, **kw) == keys.request_keys_reference(tokens, **kw)


def test_chain_continues_from_parent():
    tokens = list(range(64))
    full = keys.request_keys(tokens, model="m")
    tail = keys.request_keys(tokens[32:], model="m", parent=full[1])
    assert tail == full[2:]


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"]])
def test_rejects_tokens_llmd_cannot_hash(bad):
    with pytest.raises(ValueError):
        keys.request_keys(bad * 16, model="m")


def test_root_depends_on_seed_and_model():
    assert keys.root_key("m", "") != keys.root_key("m", "1")
    assert keys.root_key("a") != keys.root_key("b")


def test_fnv64a_known_values():
    assert keys.fnv64a(b"") == 0xCBF29CE484222325
    assert keys.fnv64a(b"a") == 0xAF63DC4C8601EC8C
