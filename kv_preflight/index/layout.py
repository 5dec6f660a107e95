"""Every Valkey key name, built in one place (llm-d's names for the keys llm-d shares).

Layout 3, the same on a single node and on Valkey Cluster (docs/architecture.md shows it and why).

llm-d's (v0.9+ Redis index), byte-compatible and with no hash tags, so they spread over every shard
and an llm-d scheduler (or a cluster-aware llm-d reader) reads the same index:

  <request key, decimal>      HASH  field = PodEntry (JSON in Go field order, or v0.8 ``pod@tier``), value ""
  engine:<engine key>         ZSET  member = request key (decimal), score = position within the engine block

Ours, all HASHes (llm-d's Clear() runs HKEYS on every key not starting with ``engine:``), under
``kvpf:``. Per-pod keys share the hash tag ``{<pod>}``, hence one slot,
so the seq check and the pod's whole state change are one atomic script on a cluster too:

  kvpf:{<pod>}:meta           model, engine_block_size, seq:<rank>, ts:<rank>, last_event_time,
                              incomplete, incomplete_reason, outbox_n, and the pod's counters
  kvpf:{<pod>}:blocks         "<engine key>|<tier>[|<group>]" -> "<field id>[*<copies>]:<rk>,<rk>..":
                              the reverse index (evictions and clears cost O(pod's blocks) and read
                              no shared key)
  kvpf:{<pod>}:fields         field id -> PodEntry field (a pod writes one or a few distinct fields)
  kvpf:{<pod>}:rks            "<request key>|<field id>" -> how many of the pod's blocks link it
  kvpf:{<pod>}:outbox         (cluster) "<n>|<writer>|<ms>" -> the shared-key effects of one batch,
                              until they have run (kv_preflight/index/cluster.py)
  kvpf:{b<n>}:barrier         (cluster) t -> 1: written, then WAITed on, to learn that a shard's replica has
                              our earlier writes (one such key per shard, in a slot that shard owns)
  kvpf:{engine:<key>}:pods    "<pod>|<tier>[|<group>]" -> 1: who holds the engine key; in the same slot
                              as engine:<key>, so creating and deleting it commute across pods
  kvpf:{<request key>}:bits   tier -> a bitmap of the pods holding the request key on that tier (bit n,
                              byte n // 8, value 1 << n % 8, for the pod numbered n; trailing zero bytes
                              trimmed): in the request key's slot, written with it. The lookup reads
                              these instead of llm-d's entries, so its cost is O(keys x pods / 8 bytes)
                              of plain reads rather than a probe per pod per key (layout 3; see
                              docs/architecture.md "Fleet-wide prefixes")
  kvpf:{<pod>}:rks also holds "<request key>|~<tier>" -> how many of the pod's field ids link the
                              request key on that tier: its bit is set when this leaves 0, cleared when
                              it returns there

Fleet-wide keys, which no per-batch atomic step touches:

  kvpf:registry               pod -> model (every pod the index has seen)
  kvpf:{nums}:byname          pod -> its number (the bit it owns in every bitmap); numbers are dense
  kvpf:{nums}:byid            number -> pod (what a lookup names the bits by)
  kvpf:{nums}:free            number -> Valkey ms it was freed (a forgotten pod's): reused, lowest first,
                              once free for NUM_REUSE_MS, so bitmaps stay as short as the fleet
  kvpf:{nums}:next            next -> the next number never given
  kvpf:counters               fleet-wide counters (decode errors, replays, foreign keys, ...)
  kvpf:feeds                  "<replay endpoint>|<dp rank>" -> "<pod>\\t<model>": which pod a replay
                              socket serves, so a restarted ingester resumes before any frame arrives
  kvpf:layout                 version -> "3": checked at start; a process refuses any other (``index
                              migrate`` moves layouts 1 and 2)

Fleet membership (ingester/fleet.py writes them, the predictor reads them; times are Valkey ``TIME``
in milliseconds, never a local clock, so hosts with skewed clocks agree):

  kvpf:ingesters              ingester id -> JSON {"expires_ms", "started_ms", "host", "engines": [url..],
                              "lag": {pod: seconds}}: the lease, renewed every second; a row whose
                              expires_ms is past is dead (any ingester deletes it)
  kvpf:fleet                  pod -> JSON PodRecord (kv_preflight/fleet/records.py): engine URL, models (base and LoRA
                              names), block size, state live|unreachable|retired, since_ms, reason,
                              owner: what a predictor needs to know the pod with no flag of its own
  kvpf:load                   pod -> JSON {"running", "waiting", "kv_usage", "at_ms"}: engine load, scraped
                              once per pod for the whole fleet by the pod's owning ingester
  kvpf:settings               hash_seed, block_size, hash_algo, entry_format: the index-wide settings,
                              set by the first writer (HSETNX); a process whose settings disagree refuses
  kvpf:engines                engine id -> JSON RegisteredEngine (kv_preflight/fleet/records.py): engines added at run time
                              (the remote-indexer API's /register); every ingester treats them as one
                              more discovery source, like ``--engines-from file://``

  kvpf:diagnosis              summary -> the last ``kv-preflight diagnose fleet`` summary (JSON, bounded),
                              at_ms -> its Valkey time; ``/stats`` serves it with its age
Layout 1 (kv-preflight 0.1: ``kvpf:pods``, ``kvpf:pod:<pod>``, ``kvpf:blocks:<pod>``,
``kvpf:fields:<pod>``) is moved by ``kv-preflight index migrate`` (kv_preflight/index/migrate.py); its names are
kept here only for that and for spotting a layout-1 writer.

The Lua scripts in ``lua/`` take our per-pod key names as KEYS from here; they derive request keys,
``engine:<key>`` and its membership set themselves (``engine_members_key``'s pattern, in
lua/apply_single.lua).
"""
from __future__ import annotations

ENGINE_PREFIX = "engine:"
OUR_PREFIX = "kvpf:"
LAYOUT_KEY = OUR_PREFIX + "layout"
LAYOUT_VERSION = "3"
PODS_KEY = OUR_PREFIX + "registry"
COUNTERS_KEY = OUR_PREFIX + "counters"
FEEDS_KEY = OUR_PREFIX + "feeds"
INGESTERS_KEY = OUR_PREFIX + "ingesters"
FLEET_KEY = OUR_PREFIX + "fleet"
LOAD_KEY = OUR_PREFIX + "load"
SETTINGS_KEY = OUR_PREFIX + "settings"
REGISTERED_KEY = OUR_PREFIX + "engines"
# --pod-id endpoint: a pod's other name -> the names it is indexed under ("\t"-separated), both ways
# (topic pod -> "<ip>:<port>" per rank, and back), so a pods filter may use either (docs/llm-d.md).
ALIASES_KEY = OUR_PREFIX + "aliases"
DIAGNOSIS_KEY = OUR_PREFIX + "diagnosis"


def request_key_name(request_key: int) -> str:
    return str(request_key)


def engine_key_name(engine_key: int | str) -> str:
    return ENGINE_PREFIX + str(engine_key)


def request_bits_key(request_key: int | str) -> str:
    return f"{OUR_PREFIX}{{{request_key}}}:bits"


NUMS_BYNAME_KEY = OUR_PREFIX + "{nums}:byname"
NUMS_BYID_KEY = OUR_PREFIX + "{nums}:byid"
NUMS_FREE_KEY = OUR_PREFIX + "{nums}:free"
NUMS_NEXT_KEY = OUR_PREFIX + "{nums}:next"
NUMS_KEYS = (NUMS_BYNAME_KEY, NUMS_BYID_KEY, NUMS_FREE_KEY, NUMS_NEXT_KEY)
NUM_REUSE_MS = 60_000  # a freed number waits this long: a predictor's cached number -> pod map has expired


def engine_members_key(engine_key: int | str) -> str:
    return f"{OUR_PREFIX}{{{ENGINE_PREFIX}{engine_key}}}:pods"


def _pod(pod_id: str, what: str) -> str:
    return f"{OUR_PREFIX}{{{pod_id}}}:{what}"


def pod_meta_key(pod_id: str) -> str:
    return _pod(pod_id, "meta")


def pod_blocks_key(pod_id: str) -> str:
    return _pod(pod_id, "blocks")


def pod_fields_key(pod_id: str) -> str:
    return _pod(pod_id, "fields")


def pod_rks_key(pod_id: str) -> str:
    return _pod(pod_id, "rks")


def pod_outbox_key(pod_id: str) -> str:
    return _pod(pod_id, "outbox")


def pod_keys(pod_id: str, *, cluster: bool = False) -> tuple[str, ...]:
    """KEYS of the apply script: meta, blocks, fields, request-key refs (and the outbox on a cluster)."""
    keys = (pod_meta_key(pod_id), pod_blocks_key(pod_id), pod_fields_key(pod_id), pod_rks_key(pod_id))
    return keys + (pod_outbox_key(pod_id),) if cluster else keys


def pod_state_keys(pod_id: str) -> tuple[str, ...]:
    """Every per-pod key (what ``index clear --forget`` deletes once the entries are gone)."""
    return pod_keys(pod_id, cluster=True)


def register_pod_args(pod_id: str, model: str) -> tuple[str, str, str]:
    return PODS_KEY, pod_id, model


def feed_field(replay_endpoint: str, rank: int) -> str:
    return f"{replay_endpoint}|{rank}"


# Layout 1, for `index migrate` and for spotting a layout-1 writer beside us.
V1_PODS_KEY = OUR_PREFIX + "pods"


def v1_pod_meta_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}pod:{pod_id}"


def v1_pod_blocks_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}blocks:{pod_id}"


def v1_pod_fields_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}fields:{pod_id}"
