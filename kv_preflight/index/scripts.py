"""The Lua scripts, read once from kv_preflight/index/lua/ (package data) and assembled: preludes first, since Lua
has no include. A batch: seq.lua (the seq and generation checks) and pod_write.lua (the pod's own writes),
then on a single node changes.lua and apply.lua (the batch's changes run in the same script), on a cluster
pod_step.lua (they go to the pod's outbox) and, per shard, changes.lua and effects.lua. Key names come from
kv_preflight/index/layout.py as arguments: no script builds one."""
from __future__ import annotations

from importlib import resources


def lua(*names: str) -> str:
    base = resources.files("kv_preflight.index") / "lua"
    return "\n".join(_without_comment_lines((base / f"{n}.lua").read_text()) for n in names)


def _without_comment_lines(source: str) -> str:
    """The source with its comment-only lines emptied: Valkey keeps every script's body for as long as it
    runs (about 11 KB of these are comments), and an empty line keeps the line numbers errors name."""
    return "\n".join("" if line.lstrip().startswith("--") else line for line in source.split("\n"))


APPLY = lua("seq", "pod_write", "changes", "apply")  # a single node: a batch and its changes in one script
POD_STEP = lua("seq", "pod_write", "pod_step")  # a cluster: the pod's own step (its changes go to the outbox)
EFFECTS = lua("changes", "effects")  # a cluster shard: its share of a batch's changes
NUMS = lua("nums")
LOOKUP_BITS = lua("lookup_bits")
LOOKUP = lua("parse_entry", "chain", "lookup")
LOOKUP_LINEAR = lua("parse_entry", "chain", "lookup_linear")
CAS_FIELD = lua("cas_field")
FLAG_POD = lua("flag_pod")  # a pod flagged incomplete unless rebuilt in this epoch (kv_preflight/index/pod_meta.py)
MAX_FIELD = lua("max_field")  # a cluster: the numbering's high-water mark copied (kv_preflight/index/numbering.py)
# a pod whose state log does not read, cleared by a scan of the keyspace (kv_preflight/index/scan_clear.py): one
# request key's entries and bits of the pod; the pod's own keys claimed and released
SCAN_CLEAR = lua("changes", "scan_clear")
SCAN_POD = lua("scan_pod")
DRAIN_LEASE = lua("drain_lease")  # a cluster: one drain of a pod's outbox at a time (kv_preflight/index/cluster/drain_lease.py)
ADOPT = lua("adopt")  # a cluster: a writer takes over a pod's outbox entries it ran (kv_preflight/index/cluster/writes.py)
# what gateways routed, per pod (kv_preflight/index/routed.py): bookings; a routed prompt's chain; the prefixes
# homed there; the read of all of it
BOOKED = lua("booked_drop", "booked")
ROUTED_CHAIN = lua("routed_chain")
HOMES = lua("homes_drop", "homes")
PLACING = lua("placing")  # a new prefix's pod claimed fleet-wide, with the placements of the last moment
ROUTED_READ = lua("booked_drop", "homes_drop", "routed_read")

__all__ = ["ADOPT", "APPLY", "BOOKED", "CAS_FIELD", "DRAIN_LEASE", "EFFECTS", "FLAG_POD", "HOMES", "LOOKUP", "LOOKUP_BITS", "LOOKUP_LINEAR", "MAX_FIELD",
           "NUMS", "PLACING", "POD_STEP", "ROUTED_CHAIN", "ROUTED_READ", "SCAN_CLEAR", "SCAN_POD", "lua"]
