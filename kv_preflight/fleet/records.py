"""Fleet membership records: what the ingesters know of each pod and of each other, as Valkey stores them.

Ingesters write them (ingester/fleet_member.py); predictors read them, so ``serve --valkey-url URL`` alone
knows every pod's engine, models and load (docs/fleet.md). Pure values and their JSON encodings
here; the Valkey commands are in kv_preflight/index/fleet_store.py, the key names in kv_preflight/index/layout.py.

Times are Valkey ``TIME`` in milliseconds: leases and ages are compared against the same clock by
every process, whatever the hosts' clocks say.
"""
from __future__ import annotations

from typing import Literal

import msgspec

PodState = Literal["live", "unreachable", "retired"]


class PodRecord(msgspec.Struct, omit_defaults=True):
    """One pod as the fleet knows it (``kvpf:fleet`` pod -> JSON)."""

    state: PodState = "live"
    since_ms: int = 0  # when the pod entered this state
    engine_url: str = ""  # the engine's HTTP base URL ("" for --source/--bind feeds given no URL)
    models: list[str] = msgspec.field(default_factory=list)  # base model first, then LoRA adapter names
    block_size: int = 0  # the engine's block size in tokens (0: not known yet)
    reason: str = ""  # why unreachable / retired ("left discovery", "health check failed 3 times", ...)
    owner: str = ""  # the ingester that health-checks and scrapes this pod
    unreachable_since_ms: int = 0  # first failed health check of the current run of failures (0: none)


class PodLoad(msgspec.Struct):
    """Engine load scraped by the pod's owner (``kvpf:load`` pod -> JSON)."""

    running: float
    waiting: float
    kv_usage: float  # 0..1
    at_ms: int  # Valkey time of the scrape


MAX_LEASE_SOURCES = 2048  # pods and endpoints a lease lists (sources and replays: the source cap keeps it far below)


class IngesterLease(msgspec.Struct, omit_defaults=True):
    """One live ingester (``kvpf:ingesters`` id -> JSON); dead once ``expires_ms`` has passed."""

    expires_ms: int
    started_ms: int = 0
    host: str = ""
    engines: list[str] = msgspec.field(default_factory=list)  # engine URLs this ingester owns
    lag_s: dict[str, float] = msgspec.field(default_factory=dict)  # pod -> seconds since its last event
    # every engine this ingester knows of ({"url", "pod", "origin"}, ingester/membership_rules.py EngineSpec):
    # the union over live leases is what the fleet ingests, so ingesters need not share one config
    known: list[dict] = msgspec.field(default_factory=list)
    # the newest ``kvpf:forget`` request (Valkey ms) this ingester has carried out: the pods asked for are let
    # go and their frames refused here; whoever forgets a pod clears its keys once every live lease shows it
    forget_seen_ms: int = 0
    renewed_ms: int = 0  # Valkey's time of this renewal
    # how often the ingester renews its lease (0: an ingester that predates it, every second): a predictor takes
    # a lease that missed two renewals for an ingester gone silent (frozen, its host stopped), not a current one
    renew_ms: int = 0
    # an ingester outside the fleet (``ingest --private``): its lease vouches for its pods' freshness only; the
    # fleet's ingesters neither hand it engines nor count on it, nor take the engines it knows
    private: bool = False
    # the ZMQ endpoints this ingester subscribes and replays from -> the pod they publish ("" not known yet):
    # a registration of one of them for another pod is refused
    sources: dict[str, str] = msgspec.field(default_factory=dict)
    # freshness (predictor/scoring/freshness.py): the ingester's own account of its ingestion, "current",
    # "behind" (a backlog, replays under way, Valkey failing briefly) or "stalled" (Valkey writes failing or
    # the loop stuck for STALL_S); "" from an ingester that predates it. ``current_ms``: the Valkey time it
    # last renewed while current. ``pods``: the pods it ingests; ``behind``: those with a replay under way or
    # their event stream down (ingester/subscriber.py);
    # ``batch_ts``: each pod's newest applied batch's engine timestamp (epoch seconds).
    # ``current_ms`` is the last renewal at which every pod not in ``behind`` was current: one pod's stream down
    # does not age the others. ``behind_since_ms``: per pod of ``behind``, the last renewal at which that pod was
    # current (0: not since this ingester took it), its own staleness; absent in a lease that predates it (then
    # ``current_ms`` stood still while any pod was behind, and is every pod's).
    state: str = ""
    current_ms: int = 0
    pods: list[str] = msgspec.field(default_factory=list)
    behind: list[str] = msgspec.field(default_factory=list)
    batch_ts: dict[str, float] = msgspec.field(default_factory=dict)
    behind_since_ms: dict[str, int] | None = None


class RegisteredEngine(msgspec.Struct, omit_defaults=True):
    """An engine added at run time (``kvpf:engines`` id -> JSON), ingested like a discovered one.

    Either ``url`` (the engine's HTTP base URL; its ``/kv_event_sources`` gives sources and topic) or
    ``source`` (a ZMQ PUB endpoint, with ``pod`` and ``model`` since its topic may say nothing)."""

    url: str = ""
    source: str = ""
    replay: str = ""
    pod: str = ""
    model: str = ""
    engine: str = "vllm"  # engine family (vllm, sglang, trtllm)
    instance_id: int | None = None  # the id a remote-indexer client registered it under
    registered_ms: int = 0
    # Dynamo /register (predictor/dynamo/api.py): the engine's block size, its data-parallel rank and the
    # routing group it was registered in (Dynamo partitions a model's workers by it).
    block_size: int = 0
    dp_rank: int = 0
    routing_group: str = "default"


class IndexSettings(msgspec.Struct, frozen=True):
    """Settings every writer and reader of one index must share (``kvpf:settings``).

    The writers' alone too: ``pod_id`` (an ingester with ``--pod-id endpoint`` in a ``topic`` fleet indexes a
    fleet engine a second time under its address: a ghost pod with the engine's blocks, never evicted) and
    ``kv_cache_report_mode`` (how a parentless run of held blocks is read: two ingesters reading it two ways
    would write one engine's pod two ways). An index written before a field was recorded takes the first
    value a writer claims for it (``claim_settings`` sets each missing field)."""

    hash_seed: str
    block_size: int
    hash_algo: str = "fnv64a"
    entry_format: str = "json"
    pod_id: str = "topic"
    kv_cache_report_mode: str = "incremental"

    def as_fields(self) -> dict[str, str]:
        return {"hash_seed": self.hash_seed, "block_size": str(self.block_size),
                "hash_algo": self.hash_algo, "entry_format": self.entry_format, "pod_id": self.pod_id,
                "kv_cache_report_mode": self.kv_cache_report_mode}

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> "IndexSettings | None":
        if "block_size" not in fields:
            return None
        return cls(hash_seed=fields.get("hash_seed", ""), block_size=int(fields["block_size"]),
                   hash_algo=fields.get("hash_algo", "fnv64a"),
                   entry_format=fields.get("entry_format", "json"), pod_id=fields.get("pod_id", "topic"),
                   kv_cache_report_mode=fields.get("kv_cache_report_mode", "incremental"))

    def disagreements(self, other: "IndexSettings") -> list[str]:
        """``name: ours != theirs`` for every setting that differs (empty: they agree)."""
        return [f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
                for name in SETTING_FLAGS if getattr(self, name) != getattr(other, name)]


# each index-wide setting and the flag that gives it (ingest and serve)
SETTING_FLAGS = {"hash_seed": "--hash-seed", "block_size": "--block-size", "hash_algo": "--hash-algo",
                 "entry_format": "--entry-format", "pod_id": "--pod-id",
                 "kv_cache_report_mode": "--kv-cache-report-mode"}


_pod_decoder = msgspec.json.Decoder(PodRecord)
_load_decoder = msgspec.json.Decoder(PodLoad)
_lease_decoder = msgspec.json.Decoder(IngesterLease)


def encode(record: msgspec.Struct) -> bytes:
    return msgspec.json.encode(record)


def decode_pod(raw: bytes | str) -> PodRecord | None:
    """None for a row that is not a PodRecord (a foreign or newer writer): skipped, never a crash."""
    try:
        return _pod_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_load(raw: bytes | str) -> PodLoad | None:
    try:
        return _load_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_registered(raw: bytes | str) -> RegisteredEngine | None:
    try:
        return msgspec.json.decode(raw, type=RegisteredEngine)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def decode_lease(raw: bytes | str) -> IngesterLease | None:
    try:
        return _lease_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class FleetView(msgspec.Struct):
    """One consistent read of the fleet keys, with the Valkey time it was taken at."""

    now_ms: int
    pods: dict[str, PodRecord]
    load: dict[str, PodLoad]
    ingesters: dict[str, IngesterLease]

    def live_ingesters(self) -> dict[str, IngesterLease]:
        return {i: lease for i, lease in self.ingesters.items() if lease.expires_ms > self.now_ms}

    def offered(self) -> set[str]:
        """Pods a route or prediction may name: every pod not retired."""
        return {p for p, r in self.pods.items() if r.state != "retired"}

    def load_age_s(self, pod_id: str) -> float | None:
        load = self.load.get(pod_id)
        return None if load is None else max(0.0, (self.now_ms - load.at_ms) / 1000)
