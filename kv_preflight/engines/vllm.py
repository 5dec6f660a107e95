"""vLLM (0.32 observed, and main of late 2026).

Wire: vllm/distributed/kv_events.py. Events are tagged maps since vllm#42892 (0.2x); older releases sent
tagged arrays in ``BlockStored``'s field order, read here by position. Fields added after 0.32
(``locality``, ``ownership``, ``session_id``) are ignored; ``medium`` is ``GPU``, ``CPU`` or ``STORAGE``
and becomes the entry's tier lowercased, as llm-d writes it. The offloading connector's placeholder
events (``token_ids=[]``, ``block_size=0``, PR #51243) are skipped and counted, never an error.
Publishers are listed at ``GET /kv_event_sources`` (one entry per data-parallel rank; ingester/subscriber.py).
"""
from __future__ import annotations

from kv_preflight.engines.base import Engine, LoadMetrics
from kv_preflight.events import BlockRemoved, BlockStored, WireLayout

# Tagged arrays (before vllm#42892): each event's fields in BlockStored's order
# (``cache_salt`` is SGLang's field, never in vLLM's arrays).
_ARRAY_FIELDS = {
    "BlockStored": tuple(f for f in BlockStored.__struct_fields__ if f != "cache_salt"),
    "BlockRemoved": BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}

LAYOUT = WireLayout("vllm", positional=_ARRAY_FIELDS)

LOAD_METRICS = LoadMetrics(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: before the v1 engine
    prefix="vllm:",
)

ENGINE = Engine(
    name="vllm",
    layout=LAYOUT,
    replay_topic=True,  # 0.32 answers ["", topic, seq, payload]; older ["", seq, payload], also read
    default_block_size=16,
    discovery_path="/kv_event_sources",
    load_metrics=LOAD_METRICS,
    tokenize_path="/tokenize",
    since="0.2x (maps), older (arrays)",
)
