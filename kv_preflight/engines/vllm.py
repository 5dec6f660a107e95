"""vLLM (0.32 observed, and main of late 2026).

Wire: vllm/distributed/kv_events.py. Events are tagged maps since vllm#42892 (0.2x); older releases sent
tagged arrays in ``BlockStored``'s field order, read here by position. Fields added after 0.32
(``locality``, ``ownership``, ``session_id``) are ignored; ``medium`` is ``GPU``, ``CPU`` or ``STORAGE``
and becomes the entry's tier lowercased, as llm-d writes it. The offloading connector's placeholder
events (``token_ids=[]``, ``block_size=0``, PR #51243) are skipped and counted, never an error.
Publishers are listed at ``GET /kv_event_sources`` (one entry per data-parallel rank: ``read_kv_event_sources``).
"""
from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import urlsplit

from kv_preflight.engines.base import BlockExtras, Engine, ExtraKeys, LoadMetrics, PrefixCacheMetrics, Publisher
from kv_preflight.engines.endpoints import bind_for, is_bind_endpoint, reachable, serving_address
from kv_preflight.events import BlockRemoved, BlockStored, WireLayout, topic_or_none

# Tagged arrays (before vllm#42892): each event's fields in BlockStored's order
# (``cache_salt`` is SGLang's field, never in vLLM's arrays).
_ARRAY_FIELDS = {
    "BlockStored": tuple(f for f in BlockStored.__struct_fields__ if f != "cache_salt"),
    "BlockRemoved": BlockRemoved.__struct_fields__,
    "AllBlocksCleared": (),
}

LAYOUT = WireLayout("vllm", positional=_ARRAY_FIELDS)

log = logging.getLogger("kvpf.engines")

# What routing needs (0.32): requests running, requests waiting, and the fraction of KV blocks held by
# running requests (cached-but-free blocks do not count in kv_cache_usage_perc).
LOAD_METRICS = LoadMetrics(
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: before the v1 engine
    prefix="vllm:",
)

PREFIX_CACHE_METRICS = PrefixCacheMetrics(
    queries="vllm:prefix_cache_queries_total",
    hits="vllm:prefix_cache_hits_total",
    prefix="vllm:prefix_cache_",
)


# vLLM's tags for the extra keys of a block hash (kv_cache_utils ``generate_block_hash_extra_keys``): the hash
# uses each tagged; events publish them untagged (``to_event_extra_keys``), and would tagged with vllm PR #44706.
_LORA, _MM, _SALT, _EMBEDS = "lora", "mm", "cache_salt", "prompt_embeds"


def read_extra_keys(extra: Any, lora_name: str | None) -> BlockExtras | None:
    """One engine block's ``extra_keys`` as vLLM 0.32 publishes them, read by position, never guessed by type.

    ``generate_block_hash_extra_keys`` builds ``lora + mm + cache_salt + prompt_embeds`` and
    ``to_event_extra_keys`` drops the tags: the adapter's name first exactly when the event has a
    ``lora_name`` (the same name: skipped only then, so a lone salt of another publisher is never taken for it),
    then an ``(identifier, offset)`` pair per multimodal item overlapping the block, then the
    salt (the block starting at token 0 only), then the prompt-embeds digest (bytes). The tagged form (the
    tuples the hash itself uses: ``("lora", name, path)``, ``("mm", identifier, offset)``,
    ``("cache_salt", salt)``, ``("prompt_embeds", digest)``) is read too. An entry of neither shape keys the
    block by its text: such a block can miss, never be mistaken for another."""
    if not extra or not isinstance(extra, (list, tuple)):
        return None
    ids: list[str] = []
    salt = None
    for n, item in enumerate(extra):
        if isinstance(item, (list, tuple)):
            tag = item[0] if item else None
            if tag == _LORA and len(item) in (2, 3):
                continue
            if tag == _MM and len(item) == 3 and isinstance(item[2], int):
                ids.append(_identifier(item[1]))
            elif tag == _SALT and len(item) == 2 and isinstance(item[1], str):
                salt = item[1]
            elif tag == _EMBEDS and len(item) == 2 and isinstance(item[1], (bytes, bytearray)):
                ids.append(bytes(item[1]).hex())
            elif len(item) == 2 and isinstance(item[0], (str, bytes)) and isinstance(item[1], int):
                ids.append(_identifier(item[0]))  # untagged (identifier, offset)
            else:
                ids.append(repr(item))
        elif isinstance(item, str):
            if n == 0 and item == lora_name:
                continue  # untagged: the adapter's name, which keys the block as its model (llm-d-router #2929)
            salt = item
        elif isinstance(item, (bytes, bytearray)):
            ids.append(bytes(item).hex())  # untagged prompt-embeds digest
        elif item is not None:
            ids.append(repr(item))
    if not ids and salt is None:
        return None
    return BlockExtras(tuple(ids), salt)


def _identifier(value: Any) -> str:
    """A multimodal identifier: a string in vLLM 0.32 (``MultiModalFeatureSpec.identifier``); bytes as hex."""
    return value if isinstance(value, str) else bytes(value).hex()


EXTRA_KEYS = ExtraKeys(read=read_extra_keys)


def read_kv_event_sources(engine_url: str, body: Any, target_ports: tuple[int, ...] = ()) -> list[Publisher]:
    """Publishers from ``GET /kv_event_sources`` (one entry per data-parallel rank), for every endpoint
    form vLLM accepts: tcp with a host, ``*``, IPv6 (``[::]``), ipc (an engine on this host); inproc
    endpoints cannot be reached from another process and are skipped with a warning."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    out = []
    for rank, conf in sorted(body.items()):
        if not isinstance(conf, dict) or not conf.get("enable_kv_cache_events", True):
            continue
        endpoint = conf.get("endpoint")
        if not isinstance(endpoint, str) or not endpoint:
            continue
        if endpoint.startswith("inproc://"):
            log.warning("%s rank %s publishes on %s: not reachable from another process; skipped",
                        engine_url, rank, endpoint)
            continue
        replay = conf.get("replay_endpoint")
        replay = replay if isinstance(replay, str) and replay and not replay.startswith("inproc://") else None
        binds = is_bind_endpoint(endpoint)
        out.append(Publisher(
            endpoint=reachable(endpoint, host) if binds else bind_for(endpoint),
            bind=not binds,
            replay=reachable(replay, host) if replay else None,
            topic=conf.get("topic") if isinstance(conf.get("topic"), str) else None,
            rank=int(rank) if str(rank).isdigit() else None,
            serving=serving_address(engine_url, int(rank) if str(rank).isdigit() else 0, target_ports),
        ))
    return out


def pod_id_of_kv_event_sources(body: Any) -> str | None:
    """The pod id in the first rank's topic ``kv@POD@MODEL`` of ``GET /kv_event_sources``, if one has it."""
    if not isinstance(body, dict):
        return None
    for _rank, conf in sorted(body.items()):
        topic = conf.get("topic") if isinstance(conf, dict) else None
        parsed = topic_or_none(topic) if isinstance(topic, str) else None
        if parsed is not None:
            return parsed.pod_id
    return None


_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read_kv_capacity(text: str) -> tuple[int, int] | None:
    """(KV cache capacity in tokens, block size) from ``vllm:cache_config_info`` (0.32: ``kv_cache_size_tokens``,
    else ``num_gpu_blocks`` x ``block_size``); summed over data-parallel ranks (one series each); None if absent."""
    total, block = 0, 0
    for m in _CACHE_CONFIG.finditer(text):
        labels = dict(_LABEL.findall(m.group(1)))
        size = labels.get("block_size", "")
        tokens = labels.get("kv_cache_size_tokens", "")
        blocks = labels.get("num_gpu_blocks", "")
        if not size.isdigit():
            continue
        block = int(size)
        if tokens.isdigit():
            total += int(tokens)
        elif blocks.isdigit():
            total += int(blocks) * block
    return (total, block) if total and block else None


def tokenize_body(model: str, *, prompt: str | None = None, messages: list[Any] | None = None) -> dict[str, Any]:
    """The ``POST /tokenize`` request: completion form for a prompt, chat form (with generation prompt) for
    messages, so the tokens are those of the chat template the engine applies."""
    if messages is not None:
        return {"model": model, "messages": messages, "add_generation_prompt": True}
    return {"model": model, "prompt": prompt}


ENGINE = Engine(
    name="vllm",
    layout=LAYOUT,
    replay_topic=True,  # 0.32 answers ["", topic, seq, payload]; older ["", seq, payload], also read
    default_block_size=16,
    extra_keys=EXTRA_KEYS,
    discovery_path="/kv_event_sources",
    read_publishers=read_kv_event_sources,
    read_pod_id=pod_id_of_kv_event_sources,
    load_metrics=LOAD_METRICS,
    prefix_cache_metrics=PREFIX_CACHE_METRICS,
    tokenize_path="/tokenize",
    tokenize_body=tokenize_body,
    since="0.2x (maps), older (arrays)",
    read_kv_capacity=read_kv_capacity,
)
