"""TensorRT-LLM's streaming ZMQ publisher (TensorRT-LLM PR #17023; tensorrt_llm/_torch/pyexecutor/kv_cache_events.py).

Events are tagged maps, vLLM-compatible (``KVCacheWireEvent``), in a positional batch
``[ts, events, data_parallel_rank]``; it never sends tagged arrays. Rules this adapter keeps:
* The block hash is the first 8 bytes, big-endian, of the block's SHA-256 radix key, sent as a signed
  int64 (``_kv_event_wire_hash_from_radix_key``); read as the same 64 bits unsigned, like every hash.
* 32 tokens per block by default (``tokens_per_block``); only full blocks are announced.
* Consecutive stores are merged into one ``BlockStored`` (``block_hashes`` several, ``token_ids`` their
  concatenation): the bridge keys each block from its slice.
* No KV cache group: ``group_idx`` and ``kv_cache_spec_*`` are never set, and only the layer group whose
  window is the largest (the "target lifecycle") is published; a variable sliding window model's smaller
  windows are not in the events, so its pods are not counted exactly (answers say so when ``--group-spec``
  declares the model hybrid; docs/engines.md, "Hybrid models").
* Multimodal blocks carry string tokens and ``mm_keys`` (13599e98): not keyed, counted as decode errors.
* The PUB socket always binds; the default topic is empty (name pod and model on the source); replay
  replies carry the topic frame, as vLLM 0.32's do. No HTTP endpoint lists the publishers.
"""
from __future__ import annotations

from kv_preflight.engines.vllm import EXTRA_KEYS as VLLM_EXTRA_KEYS
from kv_preflight.engines.base import Engine
from kv_preflight.events import WireLayout

LAYOUT = WireLayout("trtllm", positional=None)

ENGINE = Engine(
    name="trtllm",
    layout=LAYOUT,
    replay_topic=True,
    default_block_size=32,
    extra_keys=VLLM_EXTRA_KEYS,  # its events are vLLM's maps, extra_keys included
    discovery_path=None,
    read_publishers=None,
    read_pod_id=None,
    load_metrics=None,  # trtllm-serve's /metrics is JSON iteration stats, not Prometheus series
    prefix_cache_metrics=None,
    tokenize_path=None,
    tokenize_body=None,
    since="PR #17023 (streaming publisher, 2026-08)",
)
