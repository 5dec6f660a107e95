"""SGLang (python/sglang/srt/disaggregation/kv_events.py; radix cache events in mem_cache/radix_cache.py).

Two layouts share one stream format: tagged arrays until sglang PR #37482 (autumn 2026),
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium?, metadata?]``
(``metadata`` a ``{"cache_salt": ...}`` map since #30827), and tagged maps after it, with ``cache_salt``
and ``session_id`` as optional fields. The batch stays positional, ``[ts, events, attn_dp_rank]``.

Engine rules this adapter keeps:
* One event per radix page: ``block_size`` is the page size (1 to 64 in practice), not 16; the bridge
  keys any ratio against the 16-token request keys (ingester/bridge.py).
* Under EAGLE speculative decoding the radix tree keys bigrams, so each ``token_ids`` element is a
  ``[t_i, t_i+1]`` pair (mem_cache/utils.py ``convert_to_bigram_key``); the block's token is ``t_i``.
* Hashes are signed int64 (the first 16 hex digits of a SHA-256 page hash, ``hash_str_to_int64``);
  they are read as the same 64 bits unsigned.
* ``medium`` is ``GPU``, ``CPU_PINNED``, ``DISK`` or ``EXTERNAL``: tiers ``gpu``, ``cpu_pinned``, ...
* ``lora_id`` comes without a name: ``--lora-name ID=NAME`` maps it (ingester/bridge.py ``model_for``).
* The default topic is empty and replay replies carry no topic frame: name the pod and model on the
  source (``--source ENDPOINT,pod=P,model=M,engine=sglang``), or the ingester remembers them per replay
  endpoint once a live frame named them.
* ``GET /server_info`` gives ``page_size`` (and, on builds that have it, the ``kv_events_config``).
"""
from __future__ import annotations

import json
from typing import Any

from kv_preflight.engines.base import Engine, LoadMetrics
from kv_preflight.events import WireLayout

_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "metadata"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

LAYOUT = WireLayout("sglang", positional=_ARRAY_FIELDS, pair_tokens=True)

LOAD_METRICS = LoadMetrics(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
    prefix="sglang:",
)

ENGINE = Engine(
    name="sglang",
    layout=LAYOUT,
    replay_topic=False,
    default_block_size=1,  # --page-size defaults to 1
    discovery_path="/server_info",
    load_metrics=LOAD_METRICS,
    tokenize_path=None,
    since="0.4 (arrays), PR #37482 (maps)",
)


def page_size_of(server_info: Any) -> int | None:
    """The engine's page size (its KV-event block size) from ``GET /server_info``, if it says."""
    if not isinstance(server_info, dict):
        return None
    size = server_info.get("page_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def kv_events_config_of(server_info: Any) -> dict | None:
    """``--kv-events-config`` as the server reports it (a JSON string in ``server_args``), if it does."""
    if not isinstance(server_info, dict):
        return None
    raw = server_info.get("kv_events_config")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return raw if isinstance(raw, dict) else None
