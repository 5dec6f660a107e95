"""A salted prompt's first block as vLLM 0.32 publishes it (kv_cache_utils ``to_event_extra_keys``:
``(lora name?, (mm id, offset)..., "<salt>", embeds digest?)``), keyed like llm-d-router's request side."""
from __future__ import annotations

from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.engines.vllm import read_extra_keys
from kv_preflight.ingester.bridge import ChainState, plan_batch
from kv_preflight.events import BlockStored, EventBatch
from kv_preflight.keys.chain import request_keys, salted_request_keys


def cache_salt_of(extra, lora_name):
    read = read_extra_keys(extra, lora_name)
    return read.salt if read else None


def test_cache_salt_of_vllm_extra_keys():
    assert cache_salt_of(("tenant-a",), None) == "tenant-a"
    assert cache_salt_of(("my-lora", ("mmhash", 3), "tenant-a", b"\x01" * 32), "my-lora") == "tenant-a"
    assert cache_salt_of(("my-lora",), "my-lora") is None  # the LoRA name alone is no salt
    assert cache_salt_of((("mmhash", 0),), None) is None
    assert cache_salt_of(None, None) is None


def plan(ev, hash_algo="fnv64a"):
    return plan_batch(EventBatch(ts=1.0, events=[ev]), pod_id="p", topic_model="m", state=ChainState(), hash_seed="",
                      block_size=16, entry_field=lambda *a: "f", hash_algo=hash_algo, extra_keys=VLLM.extra_keys)


def test_salt_keys_the_first_canonical_block_only():
    tokens = list(range(64))
    for algo in ("fnv64a", "xxh64"):
        for e in (16, 32, 64):
            ev = BlockStored(block_hashes=list(range(1, 64 // e + 1)), parent_block_hash=None, token_ids=tokens,
                             block_size=e, extra_keys=[("tenant-a",)] + [None] * (64 // e - 1))
            keys = [k for m in plan(ev, algo).mutations for k in m.request_keys]
            assert keys == salted_request_keys(tokens, model="m", cache_salt="tenant-a", hash_algo=algo), (algo, e)
            assert keys[0] != request_keys(tokens, model="m", hash_algo=algo)[0]


def test_multimodal_ids_stay_on_every_block_of_their_engine_block():
    tokens = list(range(32))
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=tokens, block_size=32,
                     extra_keys=[(("img", 0), "tenant-a")])
    keys = list(plan(ev).mutations[0].request_keys)
    assert keys == request_keys(tokens, model="m", extra_per_block=[["img", "tenant-a"], ["img"]])
