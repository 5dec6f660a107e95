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
* No KV cache group: events have no group, kind or window field, and the hybrid caches (``SWARadixCache``,
  ``MambaRadixCache``) publish the full-attention radix tree only (an SWA node's eviction, tombstoning, sends
  no event; mem_cache/swa_radix_cache.py). A hybrid model's pods are counted by that tree, not exactly, and
  answers say so when ``--group-spec`` declares the model hybrid (docs/engines.md, "Hybrid models").
* The default topic is empty and replay replies carry no topic frame: name the pod and model on the
  source (``--source ENDPOINT,pod=P,model=M,engine=sglang``), or the ingester remembers them per replay
  endpoint once a live frame named them.
* ``GET /server_info`` gives ``page_size`` (and, on builds that have it, the ``kv_events_config``).
"""
from __future__ import annotations

import json
import logging
from typing import Any
from urllib.parse import urlsplit

from kv_preflight.engines.vllm import EXTRA_KEYS as VLLM_EXTRA_KEYS
from kv_preflight.engines.base import Engine, LoadMetrics, Publisher
from kv_preflight.engines.endpoints import bind_for, host_part, is_bind_endpoint, reachable
from kv_preflight.events import WireLayout, topic_or_none

_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "metadata"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

LAYOUT = WireLayout("sglang", positional=_ARRAY_FIELDS, pair_tokens=True)

log = logging.getLogger("kvpf.engines")

LOAD_METRICS = LoadMetrics(
    running="sglang:num_running_reqs",
    waiting="sglang:num_queue_reqs",
    kv_usage=("sglang:token_usage",),
    prefix="sglang:",
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


def read_server_info(engine_url: str, body: Any, target_ports: tuple[int, ...] = ()) -> list[Publisher] | None:
    """Publishers from ``GET /server_info`` (its server args), None if the answer is not SGLang's (it has no
    ``page_size``): ``kv_events_config`` gives the PUB and replay endpoints and the topic, each
    data-parallel rank publishing on ``port + rank`` (SGLang's ``offset_endpoint_port``); ``page_size`` is
    its block size. SGLang's topic is empty by default, so the pod is named by the serving address
    (``HOST:PORT`` of ``engine_url``) and the model by the served name. ``target_ports`` is not used: the
    pod is named by that address already."""
    if page_size_of(body) is None:
        return None
    conf = kv_events_config_of(body)
    if conf is None or conf.get("publisher", "null") != "zmq":
        return []
    parts = urlsplit(engine_url)
    host = parts.hostname or "127.0.0.1"
    endpoint, replay = conf.get("endpoint") or "tcp://*:5557", conf.get("replay_endpoint") or None
    topic = conf.get("topic") if isinstance(conf.get("topic"), str) else ""
    named = None
    if topic_or_none(topic) is None:
        model = body.get("served_model_name") or body.get("model_path")
        named = (f"{host_part(host)}:{parts.port or 80}", model if isinstance(model, str) and model else "default")
    ranks = body.get("dp_size") if body.get("enable_dp_attention") else 1
    ranks = ranks if isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 0 else 1
    log.info("SGLang engine %s: page size %s (its KV-event block size), %d rank(s)", engine_url,
             page_size_of(body), ranks)
    out = []
    for rank in range(ranks):
        pub, rep = _offset(endpoint, rank), _offset(replay, rank) if replay else None
        if pub is None or pub.startswith("inproc://"):
            log.warning("%s rank %d publishes on %s: not reachable from another process; skipped", engine_url, rank, pub)
            continue
        binds = is_bind_endpoint(pub) or "0.0.0.0" in pub  # newer SGLang binds 0.0.0.0 too
        out.append(Publisher(endpoint=reachable(pub, host) if binds else bind_for(pub), bind=not binds,
                             replay=reachable(rep, host) if rep and not rep.startswith("inproc://") else None,
                             topic=topic or None, rank=rank,
                             pod=named[0] if named else None, model=named[1] if named else None))
    return out


def _offset(endpoint: str, rank: int) -> str | None:
    """SGLang's per-rank endpoint: tcp port + rank, inproc/ipc name + ``_dp<rank>``; None if unreadable."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + rank}" if port.isdigit() else None


ENGINE = Engine(
    name="sglang",
    layout=LAYOUT,
    replay_topic=False,
    default_block_size=1,  # --page-size defaults to 1
    # It sends no extra_keys (its salt is a field of its own, cache_salt); a map that carries vLLM's field
    # anyway is read as vLLM's.
    extra_keys=VLLM_EXTRA_KEYS,
    discovery_path="/server_info",
    read_publishers=read_server_info,
    read_pod_id=None,  # its topic is empty by default: the ingester names the pod by its address
    load_metrics=LOAD_METRICS,
    prefix_cache_metrics=None,
    tokenize_path=None,
    tokenize_body=None,
    since="0.4 (arrays), PR #37482 (maps)",
)
