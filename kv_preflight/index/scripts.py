"""The Lua scripts, read once from kv_preflight/index/lua/ (package data) and assembled: preludes first, since Lua
has no include. apply = a prelude that says where shared-key effects go (apply_single.lua: run them
now; apply_cluster.lua: keep them in the pod's outbox) + pod.lua, the pod step both share."""
from __future__ import annotations

from importlib import resources


def lua(*names: str) -> str:
    base = resources.files("kv_preflight.index") / "lua"
    return "\n".join((base / f"{n}.lua").read_text() for n in names)


APPLY_SINGLE = lua("parse_entry", "links", "bits", "apply_single", "pod")
APPLY_CLUSTER = lua("parse_entry", "apply_cluster", "pod")
UNLINK_ENGINE = lua("unlink_engine")
EFFECTS_SHARD = lua("links", "bits", "effects_shard")
BIT_EFFECT = lua("bits", "bit_effect")
NUMS = lua("nums")
LOOKUP_BITS = lua("lookup_bits")
LOOKUP = lua("parse_entry", "chain", "lookup")
LOOKUP_LINEAR = lua("parse_entry", "chain", "lookup_linear")
CAS_FIELD = lua("cas_field")

__all__ = ["APPLY_CLUSTER", "APPLY_SINGLE", "BIT_EFFECT", "CAS_FIELD", "EFFECTS_SHARD", "LOOKUP", "LOOKUP_BITS", "LOOKUP_LINEAR", "NUMS",
           "UNLINK_ENGINE", "lua"]
