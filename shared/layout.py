"""Every Valkey key name, built in one place (llm-d's names for the keys llm-d shares).

llm-d's (v0.9+ Redis index), byte-compatible so an llm-d scheduler reads the same index:

  <request key, decimal>     HASH  field = PodEntry (JSON in Go field order, or v0.8 ``pod@tier``), value ""
  engine:<engine key>        ZSET  member = request key (decimal), score = position within the engine block

Ours, all HASHes under ``kvpf:`` because llm-d's Clear() runs HKEYS on every key that does not
start with ``engine:``:

  kvpf:pods                  pod -> model (the registry of pods)
  kvpf:pod:<pod>             model, engine_block_size, seq:<rank>, ts:<rank>, last_event_time,
                             incomplete, incomplete_reason, and the pod's counters
  kvpf:blocks:<pod>          "<engine key>|<tier>[|<group>]" -> field id [*copies]: the per-pod
                             reverse index that makes BlockRemoved and AllBlocksCleared cost
                             O(pod's blocks)
  kvpf:fields:<pod>          field id -> PodEntry field (a pod writes one or a few distinct fields)
  kvpf:rkref:<pod>           "<request key>|<field>" -> extra engine blocks backing that entry
                             (present only when two engine keys map to one request key)
  kvpf:counters              fleet-wide counters (decode errors, replays, foreign keys, ...)
  kvpf:feeds                 "<replay endpoint>|<dp rank>" -> "<pod>\t<model>": which pod a replay socket
                             serves, so a restarted ingester resumes every pod before any frame arrives

The Lua scripts in ``lua/`` take our key names as KEYS from here; they derive request keys and
``engine:<key>`` themselves (llm-d's fixed names).
"""
from __future__ import annotations

ENGINE_PREFIX = "engine:"
OUR_PREFIX = "kvpf:"
PODS_KEY = OUR_PREFIX + "pods"
COUNTERS_KEY = OUR_PREFIX + "counters"
FEEDS_KEY = OUR_PREFIX + "feeds"


def feed_field(replay_endpoint: str, rank: int) -> str:
    return f"{replay_endpoint}|{rank}"


def request_key_name(request_key: int) -> str:
    return str(request_key)


def engine_key_name(engine_key: int) -> str:
    return ENGINE_PREFIX + str(engine_key)


def pod_meta_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}pod:{pod_id}"


def pod_blocks_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}blocks:{pod_id}"


def pod_fields_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}fields:{pod_id}"


def pod_rkref_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}rkref:{pod_id}"


def pod_keys(pod_id: str) -> tuple[str, str, str, str, str, str]:
    """KEYS of the apply and clear scripts: meta, blocks, fields, rkref, the registry, counters."""
    return (pod_meta_key(pod_id), pod_blocks_key(pod_id), pod_fields_key(pod_id), pod_rkref_key(pod_id),
            PODS_KEY, COUNTERS_KEY)
