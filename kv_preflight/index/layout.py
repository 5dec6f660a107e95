"""Every Valkey key name, built in one place (llm-d's names for the keys llm-d shares). Layout 4.

The same on a single node and on Valkey Cluster (docs/architecture.md shows it and why).

llm-d's (v0.9+ Redis index), byte-compatible and with no hash tags, so they spread over every shard
and an llm-d scheduler (or a cluster-aware llm-d reader) reads the same index:

  <request key, decimal>      HASH  field = PodEntry (JSON in Go field order, or v0.8 ``pod@tier``), value ""
  engine:<engine key>         ZSET  member = request key (decimal), score = position within the engine block;
                                    a pod's members leave when none of them holds an entry (llm-d's own
                                    pruning rule)

Ours, all HASHes (llm-d's Clear() runs HKEYS on every key not starting with ``engine:``), under ``kvpf:``:

  kvpf:{<request key>}        presence, what the lookup reads: per KV cache group and tier
                              (``<tier>`` for group 0, ``<tier>|<group>`` for the others) the value
                              ``<n>:<bitmap>``, the bitmap of the pods holding the request key there (bit k:
                              byte k // 8, value 1 << k % 8, for the pod numbered k; trailing zero bytes
                              trimmed) and ``n``, how many of the key's llm-d entries those bits stand for
                              (their sum is compared with the key's HLEN: an entry someone else wrote shows).
                              In the request key's slot: a shard writes both in one step. No suffix: one
                              per request key, so every byte of the name counts (a suffix put each key in the
                              next allocator size class, 16 bytes more per request key).
  kvpf:{<pod>}:meta           model, engine_block_size, seq:<rank>, ts:<rank>, last_event_time, gen (the
                              pod's generation: every writer of the pod plans at one and the apply script
                              refuses a plan made at another), num (its bit), groups (its KV cache groups),
                              blocks, orphan_keys/orphan_at, incomplete(_reason), counters, outbox_n
  kvpf:{<pod>}:state          the pod's private state (kv_preflight/index/pod_state.py) as a log (pod_log.py): "s" -> a
                              snapshot (past 8,186 bytes in chunks "s", "s:1", ..., joined in order),
                              "d:<gen>" -> each batch applied since, until the next snapshot
  kvpf:{<pod>}:outbox         (cluster) "<n>|<writer>|<ms>" -> one batch's shared-key changes, until they ran
  kvpf:{<pod>}:drain          (cluster) HASH by -> "<writer>#<token>", with a TTL: the one drain that may run the
                              outbox's entries now, renewed while it runs (kv_preflight/index/cluster/drain_lease.py)
  kvpf:{b<n>}:barrier         (cluster) t -> 1: written, then WAITed on, to learn that a shard's replica has
                              our earlier writes (one such key per shard, in a slot that shard owns)
  kvpf:{m<n>}:slot            (cluster) id -> the epoch it was written in: one per hash slot (n the least that
                              puts the key in that slot), so a shard that comes back without its data (a
                              restart without persistence and without a failover) is noticed, whichever
                              shard it is: its slots' markers are gone (kv_preflight/index/cluster/markers.py)
  kvpf:{m<n>}:nums            (cluster) next -> a copy of kvpf:{nums}:next's "next", in every 1,024th slot: if
                              the shard holding the numbering comes back empty, new numbers start at the
                              highest copy left (a pod's meta "num" gives it its own back: numbering.py)

What routing knows from the requests it sent (kv_preflight/index/routed.py; written by gateways, never by the
ingester, never into llm-d's keys or the presence bits), per pod in the pod's slot:

  kvpf:{<pod>}:bookings       ZSET booking id -> when it expires (Valkey ms): requests a gateway routed there and
                              has in flight, renewed while they run, gone with their gateway after the TTL
  kvpf:{<pod>}:booked         HASH n -> how many, tokens -> their summed cost (uncached prefill + decode), and
                              booking id -> its cost; kept equal to the live bookings by the one script that
                              changes them (lua/booked.lua)
  kvpf:{<pod>}:speculative    ZSET request key (8 bytes, big-endian) -> when it expires: the chains of prompts
                              gateways sent there lately, counted as held until the engine's events confirm them
                              or the TTL lapses (lua/routed_chain.lua; scores keep each chain's live keys a prefix)
  kvpf:{<pod>}:approximate    ZSET request key -> when it was last routed there: what an engine that publishes no
                              events holds, as far as the gateways' own requests tell (at most its KV capacity,
                              least recently used first out)
  kvpf:{<pod>}:homes          ZSET prefix (its first request key, 8 bytes) -> when last routed there: the
  kvpf:{<pod>}:homed          HASH prefix -> its blocks, sum -> theirs together: the pod's footprint, the cache
                              room other prefixes take there, which new prefixes are placed by (fleet-wide)

And fleet-wide, for new prefixes (lua/placing.lua), in one slot:

  kvpf:{placing}:claims       HASH prefix (its first request key, 8 bytes) -> the pod a gateway placed it on: one
                              new prefix keeps one pod through every gateway
  kvpf:{placing}:lapse        ZSET prefix -> when its claim lapses (Valkey ms; --route-pending after it was made)
  kvpf:{placing}:recent       ZSET prefix .. blocks .. pod -> when it was placed there: the placements of the last
                              moment, counted on their pods beside the footprints a gateway read (their homes may
                              not have reached its read), so gateways placing at once do not crowd one pod
  kvpf:{placing}:pods         ZSET pod -> when it was last claimed: ties go to the least lately claimed

Per-pod keys share the hash tag ``{<pod>}``, hence one slot, so the seq and generation checks and the pod's
state change are one atomic script on a cluster too.

Fleet-wide keys, which no per-batch atomic step touches:

  kvpf:registry               pod -> model (every pod the index has seen)
  kvpf:adapters               "<pod>\t<adapter>" -> the pod's model: every LoRA adapter a pod's events stored
                              blocks of (their lora_name, or a --lora-name mapping), so a predictor knows an
                              adapter as a model, and which pods serve it, from the index alone
  kvpf:{nums}:byname          pod -> its number (the bit it owns in every bitmap); numbers are dense
  kvpf:{nums}:byid            number -> pod (what a lookup names the bits by)
  kvpf:{nums}:free            number -> Valkey ms it was freed (a forgotten pod's): reused, lowest first,
                              once free for NUM_REUSE_MS, so bitmaps stay as short as the fleet
  kvpf:{nums}:next            next -> the next number never given; epoch -> when the numbering began;
                              adopt_below -> (created after a loss) the lost numbering's high-water mark
  kvpf:counters               fleet-wide counters (decode errors, replays, foreign keys, ...)
  kvpf:feeds                  "<replay endpoint>|<dp rank>" -> "<pod>\\t<model>": which pod a replay
                              socket serves, so a restarted ingester resumes before any frame arrives
  kvpf:epoch                  id -> a token the first writer puts: gone or another, the index lost its data;
                              id_at -> when it began (Valkey ms); marked, marked_at -> (cluster) the epoch
                              the slots' markers were last written in, and when
  kvpf:layout                 version -> "4": checked at start; a process refuses any other (``index
                              migrate`` moves layouts 1, 2 and 3)

Fleet membership (kv_preflight/index/fleet_store.py reads and writes them; times are Valkey ``TIME`` in
milliseconds, never a local clock, so hosts with skewed clocks agree):

  kvpf:ingesters              ingester id -> JSON lease {"expires_ms", "started_ms", "host", "engines", "lag"}
  kvpf:fleet                  pod -> JSON PodRecord (kv_preflight/fleet/records.py): engine URL, models,
                              block size, state live|unreachable|retired, since_ms, reason, owner
  kvpf:load                   pod -> JSON {"running", "waiting", "kv_usage", "at_ms"}: engine load
  kvpf:settings               hash_seed, block_size, hash_algo, entry_format: set by the first writer
  kvpf:engines                engine id -> JSON RegisteredEngine: engines added at run time (/register)
  kvpf:aliases                a pod's other name -> the names it is indexed under
  kvpf:diagnosis              summary -> the last ``kv-preflight diagnose fleet`` summary, at_ms -> its time

Earlier layouts (kept here only for ``index migrate`` and for spotting an old writer): layout 3 had, per
pod, ``kvpf:{<pod>}:blocks`` (engine key -> request keys), ``:fields`` and ``:rks`` (reference counts), per
engine key ``kvpf:{engine:<key>}:pods`` (its holders), and per request key ``kvpf:{<rk>}:bits`` (tier ->
bitmap, "#n" -> count); layout 1 (kv-preflight 0.1) ``kvpf:pods``, ``kvpf:pod:<pod>``, ``kvpf:blocks:<pod>``,
``kvpf:fields:<pod>``.

The Lua scripts take every key name from here, as KEYS or arguments: none builds one.
"""
from __future__ import annotations

ENGINE_PREFIX = "engine:"
OUR_PREFIX = "kvpf:"
LAYOUT_KEY = OUR_PREFIX + "layout"
LAYOUT_VERSION = "4"
PODS_KEY = OUR_PREFIX + "registry"
ADAPTERS_KEY = OUR_PREFIX + "adapters"
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
# field "id": a random token the first writer puts (HSETNX); a writer that finds it gone or changed knows the
# index lost its data (a restart without persistence, FLUSHALL, this key evicted) since it last looked; "id_at":
# when it began; "marked", "marked_at" (cluster): the epoch every slot's marker was written in (``slot_marker_key``),
# and when
EPOCH_KEY = OUR_PREFIX + "epoch"
# pod -> Valkey ms: pods being forgotten (``/unregister``, ``index clear --forget``): every ingester lets
# their engines go and refuses their frames, so their keys go after no ingester writes them any more
FORGET_KEY = OUR_PREFIX + "forget"


def request_key_name(request_key: int) -> str:
    return str(request_key)


def engine_key_name(engine_key: int | str) -> str:
    return ENGINE_PREFIX + str(engine_key)


# SCAN patterns for llm-d's keys when a pod's are sought without its state log (kv_preflight/index/scan_clear.py):
# a request key's name is its decimal (the pattern lets a few others through: ``is_request_key_name`` decides)
REQUEST_KEY_MATCH = "[0-9]*"
ENGINE_KEY_MATCH = ENGINE_PREFIX + "*"


def is_request_key_name(name: bytes | str) -> bool:
    """Whether a key name is a request key's (decimal digits only, as ``request_key_name`` writes it)."""
    n = name.decode("ascii", "replace") if isinstance(name, bytes) else name
    return n.isascii() and n.isdigit()


def presence_key(request_key: int | str) -> str:
    """The request key's pod bitmaps (layout 4), in its slot."""
    return f"{OUR_PREFIX}{{{request_key}}}"


def is_presence_key(name: bytes | str) -> bool:
    """Whether a key name is a presence hash (``kvpf:{<digits>}``, nothing after the tag)."""
    n = name.decode() if isinstance(name, bytes) else name
    return n.startswith(OUR_PREFIX + "{") and n.endswith("}") and n[len(OUR_PREFIX) + 1:-1].isdigit()


PRESENCE_PREFIX, PRESENCE_SUFFIX = OUR_PREFIX + "{", "}"  # what the lookup script puts around a key


NUMS_BYNAME_KEY = OUR_PREFIX + "{nums}:byname"
NUMS_BYID_KEY = OUR_PREFIX + "{nums}:byid"
NUMS_FREE_KEY = OUR_PREFIX + "{nums}:free"
NUMS_NEXT_KEY = OUR_PREFIX + "{nums}:next"
NUMS_KEYS = (NUMS_BYNAME_KEY, NUMS_BYID_KEY, NUMS_FREE_KEY, NUMS_NEXT_KEY)
NUM_REUSE_MS = 60_000  # a freed number waits this long: a predictor's cached number -> pod map has expired
NUMS_COPIES = 16  # a cluster's copies of the numbering's high-water mark: one in every 1,024th hash slot




def _pod(pod_id: str, what: str) -> str:
    return f"{OUR_PREFIX}{{{pod_id}}}:{what}"


# The names the lookup script builds keys from: a request key's presence hash (prefix + key + suffix), the
# numbering's byid and next, a pod's meta (prefix + pod + suffix); it takes them as arguments.
LOOKUP_NAMES = (PRESENCE_PREFIX, PRESENCE_SUFFIX, NUMS_BYID_KEY, NUMS_NEXT_KEY, OUR_PREFIX + "{", "}:meta")


def pod_meta_key(pod_id: str) -> str:
    return _pod(pod_id, "meta")


def pod_state_key(pod_id: str) -> str:
    return _pod(pod_id, "state")


def pod_outbox_key(pod_id: str) -> str:
    return _pod(pod_id, "outbox")


def pod_drain_key(pod_id: str) -> str:
    return _pod(pod_id, "drain")


def nums_copy_key(n: int) -> str:
    """A copy of the pod numbering's high-water mark (a HASH, field "next"), tagged ``{m<n>}`` as a slot's marker
    is (kv_preflight/index/cluster/markers.py picks n per slot). On a cluster the shard holding ``kvpf:{nums}:*``
    may come back without its data while the presence bits of the numbers it gave stand on the others: the
    copies there keep those numbers from being given again (kv_preflight/index/numbering.py)."""
    return f"{OUR_PREFIX}{{m{n}}}:nums"


def slot_marker_key(n: int) -> str:
    """The n-th candidate for a hash slot's marker (a HASH; kv_preflight/index/cluster/markers.py picks, per
    slot, the least n in it)."""
    return f"{OUR_PREFIX}{{m{n}}}:slot"


def barrier_key(i: int) -> str:
    """The i-th candidate for a shard's replication barrier key (a HASH, in some slot that shard owns)."""
    return f"{OUR_PREFIX}{{b{i}}}:barrier"


def pod_booking_keys(pod_id: str) -> tuple[str, str]:
    """A pod's bookings (ZSET id -> expiry ms) and their totals (HASH), in the pod's slot: one script changes both."""
    return _pod(pod_id, "bookings"), _pod(pod_id, "booked")


def pod_speculative_key(pod_id: str) -> str:
    return _pod(pod_id, "speculative")


def pod_approximate_key(pod_id: str) -> str:
    return _pod(pod_id, "approximate")


def pod_home_keys(pod_id: str) -> tuple[str, str]:
    """The prefixes homed on a pod (ZSET prefix -> last routed ms) and their blocks (HASH), in the pod's slot."""
    return _pod(pod_id, "homes"), _pod(pod_id, "homed")


def placement_claim_keys() -> tuple[str, str, str, str]:
    """New prefixes' claimed pods (HASH), when each claim lapses (ZSET), the placements of the last moment (ZSET),
    when each pod was last claimed (ZSET): one slot."""
    return tuple(f"{OUR_PREFIX}{{placing}}:{k}" for k in ("claims", "lapse", "recent", "pods"))


def pod_routed_keys(pod_id: str) -> tuple[str, ...]:
    """What the read beside a lookup takes (lua/routed_read.lua): bookings, their totals, speculative, approximate,
    homes and their blocks."""
    return (*pod_booking_keys(pod_id), pod_speculative_key(pod_id), pod_approximate_key(pod_id),
            *pod_home_keys(pod_id))


def pod_keys(pod_id: str, *, cluster: bool = False) -> tuple[str, ...]:
    """KEYS of the apply script: meta, state (and on a cluster the outbox and its drain's lease)."""
    keys = (pod_meta_key(pod_id), pod_state_key(pod_id))
    return keys + (pod_outbox_key(pod_id), pod_drain_key(pod_id)) if cluster else keys


def pod_state_keys(pod_id: str) -> tuple[str, ...]:
    """Every per-pod key (what ``index clear --forget`` deletes once the entries are gone)."""
    return pod_keys(pod_id, cluster=True)


def feed_field(replay_endpoint: str, rank: int) -> str:
    return f"{replay_endpoint}|{rank}"


def adapter_field(pod_id: str, adapter: str) -> str:
    """A pod's adapter in ``kvpf:adapters`` (a tab: no topic names one, ``kv@<pod>@<model>``)."""
    return f"{pod_id}\t{adapter}"


def parse_adapter_field(field: str) -> tuple[str, str] | None:
    pod, sep, adapter = field.partition("\t")
    return (pod, adapter) if sep and pod and adapter else None


# Layout 3, for `index migrate`.
def v3_bits_key(request_key: int | str) -> str:
    return f"{OUR_PREFIX}{{{request_key}}}:bits"


def v3_members_key(engine_key: int | str) -> str:
    return f"{OUR_PREFIX}{{{ENGINE_PREFIX}{engine_key}}}:pods"


def v3_pod_keys(pod_id: str) -> tuple[str, str, str]:
    """A layout-3 pod's reverse index, field ids and reference counts."""
    return _pod(pod_id, "blocks"), _pod(pod_id, "fields"), _pod(pod_id, "rks")


# Layout 1, for `index migrate` and for spotting a layout-1 writer beside us.
V1_PODS_KEY = OUR_PREFIX + "pods"


def v1_pod_meta_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}pod:{pod_id}"


def v1_pod_blocks_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}blocks:{pod_id}"


def v1_pod_fields_key(pod_id: str) -> str:
    return f"{OUR_PREFIX}fields:{pod_id}"
