"""One typed config for every kv-preflight process: CLI flags, then ``KVPF_*`` env, then defaults."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "KVPF_"


@dataclass(frozen=True)
class Config:
    valkey_url: str = "redis://127.0.0.1:6379/0"
    # Request keys: must equal the llm-d scheduler's settings for a shared index.
    hash_seed: str = ""
    block_size: int = 16
    # "fnv64a" (llm-d's default cbor-fnv chain) or "xxh64" (llm-d-router's opt-in hashAlgorithm, kv_preflight/keys/xxh64.py).
    hash_algo: str = "fnv64a"
    # Which PodEntry form writers emit: "json" (llm-d v0.9+) or "v08" (pod@tier).
    entry_format: str = "json"
    kv_cache_report_mode: str = "incremental"  # "full": vLLM may re-announce reused blocks (PodState.reannouncements)
    # Every Valkey call is bounded: an outage turns into a fast error, never a hang.
    valkey_timeout_s: float = 1.0
    # "auto" asks the node named by valkey_url (INFO cluster); "yes"/"no" say it up front.
    valkey_cluster: str = "auto"
    # Ingester
    sources: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    replay_timeout_s: float = 2.0
    # Fleet membership (docs/fleet.md): engines discovered by DNS or file, shared among ingesters by lease.
    engines_from: tuple[str, ...] = ()
    registered_engines: bool = True  # also ingest engines registered at run time (kvpf:engines)
    copies: int = 2  # ingesters per engine (exactly-once by seq makes copies safe)
    # --private: ingest exactly the engines given here, outside the fleet: no lease (nobody hands it engines,
    # it takes none of theirs), no pod records, health or retirement (docs/fleet.md#a-private-ingester)
    private: bool = False
    ingester_id: str = ""  # default: host:pid:random
    lease_ttl_s: float = 5.0
    membership_hold_s: float = 3.0  # a membership change counts once it has held this long
    discovery_interval_s: float = 2.0
    health_failures: int = 3  # failed /health checks in a row that make a pod unreachable
    health_timeout_s: float = 2.0
    retire_after_s: float = 60.0  # unreachable this long: retired (entries cleared)
    retired_retention_s: float = 3600.0  # a retired pod's registry row is kept this long
    # Sources one ingester subscribes at most (each holds ~3 ZMQ sockets; libzmq allows 1,023 per context);
    # also bounded by the open-file limit. An engine past it is refused (logged, counted), never a crash.
    max_sources: int = 256
    # Hostile-input bounds (docs/operations.md, "Hostile publishers and memory"): ZMQ drops a connection
    # whose frame is larger than max_frame_bytes before allocating it; a socket's queue holds
    # max_queue_bytes of such frames.
    max_frame_bytes: int = 32 * 1024 * 1024
    max_queue_bytes: int = 256 * 1024 * 1024
    # Liveness of every event stream (ingester/sources.py Liveness, docs/operations.md): ZMTP heartbeats on every
    # SUB and DEALER socket (a PING each zmq_heartbeat_s; no answer within zmq_heartbeat_timeout_s closes the
    # connection and it is made again), TCP keepalive (first probe after tcp_keepalive_s idle), and a source
    # silent for silence_probe_s (and four times its usual gap) has its replay socket asked whether the engine
    # published batches that never came. 0 turns each off.
    zmq_heartbeat_s: float = 2.0
    zmq_heartbeat_timeout_s: float = 6.0
    tcp_keepalive_s: float = 30.0
    silence_probe_s: float = 10.0
    # CURVE: the ingester's keypair (a zmq.auth *.key_secret, or the z85 secret key alone) and the
    # publisher public keys a --bind socket admits (a directory of certificates, or one key per line).
    curve_secret_key_file: str = field(default="", repr=False)  # a path, but repr stays free of "secret"
    curve_allow: str = ""
    # Predictor
    host: str = "127.0.0.1"
    port: int = 8080
    # model -> engine base URLs serving it (``--engine-url m=A --engine-url m=B``: both; tokenization
    # fails over between them). A plain string per model is taken as a list of one.
    engine_urls: dict[str, tuple[str, ...]] = field(default_factory=dict)
    max_tokens: int = 262_144
    max_body_bytes: int = 8 * 1024 * 1024
    engine_timeout_s: float = 5.0
    lookup: str = "script"  # "script" (one EVALSHA) or "pipeline" (HKEYS per key, Valkey Cluster)
    log_json: bool = False
    # Local tokenization: model -> directory holding tokenizer.json + tokenizer_config.json.
    tokenizers: dict[str, str] = field(default_factory=dict)
    # Hybrid models: model -> KV cache group -> what its hit rule needs and the engine's events do not say
    # (``--group-spec MODEL:GROUP=KIND/chunk=N``; kv_preflight/engines/hit_rules.py, docs/engines.md).
    group_specs: dict[str, dict[int, Any]] = field(default_factory=dict)
    tokenizer_check: bool = True  # compare with the engine's /tokenize at start-up; fall back on a mismatch
    ttft_model: str = ""  # JSON written by `kv-preflight calibrate`; empty: the documented defaults
    # Routing (docs/routing.md): engine metrics to scrape, pod -> http://host:port, plus the --engine-url engines.
    pod_metrics: dict[str, str] = field(default_factory=dict)
    metrics_interval_s: float = 1.0
    route_tier_weights: dict[str, float] = field(
        default_factory=lambda: {"gpu": 1.0, "cpu": 0.8, "cpu_pinned": 0.8})  # cpu_pinned: SGLang's host tier
    route_waiting_weight: float = 2.0
    route_overload_abs: float = 6.0  # vs the fleet mean incl. the pod (docs/routing.md: why 6, measured)
    route_overload_rel: float = 1.5
    route_max_kv_usage: float = 0.95
    route_good_match: float = 0.5
    route_stale_s: float = 5.0
    # New prefixes placed by cache room (docs/routing.md, predictor/scoring/placement.py): a prefix not routed for
    # this long no longer counts on its pod (0: no placement memory, new prefixes by load only), and one
    # placed less than route_pending_s ago that the index does not show yet goes to the same pod again.
    route_placement_window_s: float = 60.0
    route_pending_s: float = 5.0
    # Request limits (predictor): the pods filter's length, and the time to read a request's headers, then
    # its body (a slow client must not hold a connection forever).
    max_pods_filter: int = 1024
    request_read_timeout_s: float = 10.0
    # Connections one client address may hold open at once, and all clients together (0: what the open-file
    # limit leaves); past either, a new connection is answered 503 and closed (kvpf_connections_refused).
    max_connections_per_client: int = 64
    max_connections: int = 0
    # Distinct pod label values per Prometheus metric (both processes); later pods are summed under "_other".
    max_pod_series: int = 256
    # API keys (Authorization: Bearer); none configured: no auth. Never logged or printed.
    api_keys_file: str = ""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Ingester: Prometheus /metrics port (0: none).
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # Ingester: engine LoRA ids -> adapter names (``--lora-name ID=NAME``), for engines whose events carry
    # only the id (SGLang, TensorRT-LLM); blocks are keyed by adapter name, as llm-d's scheduler asks.
    lora_names: dict[str, str] = field(default_factory=dict)
    # Remote-indexer API (predictor/dynamo/api.py): NVIDIA Dynamo's standalone KV indexer routes on this
    # port (0: off; Dynamo's own default is 8090), and the hosts/CIDRs /register may name (empty: loopback).
    dynamo_port: int = 0
    register_allow: tuple[str, ...] = ()
    # ... and the folders a registered ipc:// socket may be in (its path normalized first)
    register_ipc_dirs: tuple[str, ...] = ("/tmp",)
    # /register's bounds: engines in all and per model (429 past them); every registration is re-read by
    # every ingester each discovery interval and listed by /workers, so they stay bounded
    max_registered_engines: int = 1024
    max_registered_per_model: int = 256
    # Ingester: the pod id written into the index: "topic" (the topic's kv@<pod>@model) or "endpoint" (llm-d
    # v0.10's "<pod IP>:<target port of the rank>", router PR #2233); target_ports: the InferencePool's
    # targetPorts, rank r -> target_ports[r] (empty: the engine URL's port + r). docs/llm-d.md.
    pod_id: str = "topic"
    target_ports: tuple[str, ...] = ()  # decimal port numbers (strings, as env and flags give them)
    # Gateway (``kv-preflight gateway``, docs/gateway.md; its engines without an ingester: ``engines``). Upstream
    # requests in flight at most (past it: 503), the time to connect to an engine and to wait for its next
    # bytes, how long a pod that failed a request is avoided, and the decode tokens a request that names no
    # max_tokens is booked for, how long a booking outlives a gateway that stopped renewing it (0: no bookings), and
    # how long a routed prompt's blocks count on its pod before its events confirm them (0: no speculative entries),
    # and the KV capacity (tokens) an engine no ingester feeds is indexed to (0: what its metrics say).
    gateway_max_inflight: int = 1024
    gateway_connect_timeout_s: float = 2.0
    gateway_read_timeout_s: float = 600.0
    gateway_avoid_s: float = 10.0
    gateway_decode_tokens: int = 256
    gateway_booking_ttl_s: float = 10.0
    gateway_speculative_ttl_s: float = 2.0
    gateway_kv_capacity: int = 0
    # Which fields were given explicitly (flag or env) rather than defaulted, set by ``load``: a predictor
    # adopts the index's hash_seed / block_size / entry_format unless it was given its own (predictor/settings.py).
    given: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if any(isinstance(u, str) for u in self.engine_urls.values()):
            object.__setattr__(self, "engine_urls", {m: (u,) if isinstance(u, str) else tuple(u)
                                                     for m, u in self.engine_urls.items()})

    @classmethod
    def load(cls, **overrides: Any) -> "Config":
        """Flags given explicitly (not None) win over ``KVPF_<FIELD>`` env vars, which win over defaults."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env = os.environ.get(ENV_PREFIX + f.name.upper())
            # empty means unset (KVPF_X="" from a template); KVPF_API_KEYS keeps it, validate() refuses it
            if env is not None and f.name != "given" and (env.strip() or f.name == "api_keys"):
                values[f.name] = _parse_env(f, env)
        for name, value in overrides.items():
            if value is None or (isinstance(value, (tuple, list, dict)) and not value and name in values):
                continue
            values[name] = tuple(value) if isinstance(value, list) else value
        values["given"] = tuple(sorted(values))
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def cluster_mode(self) -> bool | None:
        """What Index.from_url takes: None (ask the node), True or False."""
        return {"auto": None, "yes": True, "no": False}[self.valkey_cluster]

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.hash_algo not in ("fnv64a", "xxh64"):
            raise ValueError(f"hash_algo must be 'fnv64a' or 'xxh64', got {self.hash_algo!r}")
        if self.entry_format not in ("json", "v08"):
            raise ValueError(f"entry_format must be 'json' or 'v08', got {self.entry_format!r}")
        if self.kv_cache_report_mode not in ("incremental", "full"):
            raise ValueError(f"kv_cache_report_mode must be 'incremental' or 'full', got {self.kv_cache_report_mode!r}")
        if not self.valkey_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"valkey_url {self.valkey_url.split('@')[-1]!r} needs a scheme: redis://HOST:PORT, "
                             "rediss:// (TLS) or unix:///path")
        for url in self.engines:  # else the ingester retries a URL that can never work, forever
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--engine expects http://HOST:PORT, got {url!r}")
        if self.valkey_cluster not in ("auto", "yes", "no"):
            raise ValueError(f"valkey_cluster must be auto, yes or no, got {self.valkey_cluster!r}")
        if self.lookup not in ("script", "pipeline"):
            raise ValueError(f"lookup must be 'script' or 'pipeline', got {self.lookup!r}")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        if self.metrics_interval_s <= 0:
            raise ValueError("metrics_interval_s must be positive")
        if not 0 < self.route_max_kv_usage <= 1:
            raise ValueError("route_max_kv_usage must be in (0, 1]")
        if self.route_overload_rel < 1 or self.route_overload_abs < 0 or self.route_waiting_weight < 0:
            raise ValueError("route_overload_rel must be >= 1; route_overload_abs and route_waiting_weight >= 0")
        if not 0 <= self.route_good_match <= 1:
            raise ValueError("route_good_match must be in [0, 1]")
        if any(w < 0 for w in self.route_tier_weights.values()):
            raise ValueError("route_tier_weights must not be negative")
        if self.route_placement_window_s < 0 or self.route_pending_s < 0:
            raise ValueError("route_placement_window_s and route_pending_s must be >= 0")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a port number (0: off)")
        if min(self.zmq_heartbeat_s, self.tcp_keepalive_s, self.silence_probe_s) < 0:
            raise ValueError("zmq_heartbeat_s, tcp_keepalive_s and silence_probe_s must be >= 0 (0: off)")
        if self.zmq_heartbeat_s and not self.zmq_heartbeat_s < self.zmq_heartbeat_timeout_s <= 6553:
            raise ValueError("zmq_heartbeat_timeout_s must be longer than zmq_heartbeat_s (at most 6553 s)")
        if self.max_frame_bytes < 4096 or self.max_queue_bytes < self.max_frame_bytes:
            raise ValueError("max_frame_bytes must be at least 4096, and max_queue_bytes at least max_frame_bytes")
        if self.curve_allow and not self.curve_secret_key_file:
            raise ValueError("--curve-allow needs --curve-secret-key-file (the ingester's own CURVE keypair)")
        if self.max_pods_filter <= 0 or self.max_pod_series <= 0:
            raise ValueError("max_pods_filter and max_pod_series must be positive")
        if self.request_read_timeout_s <= 0:
            raise ValueError("request_read_timeout_s must be positive")
        if self.copies < 1 or self.health_failures < 1:
            raise ValueError("copies and health_failures must be at least 1")
        if min(self.lease_ttl_s, self.discovery_interval_s, self.health_timeout_s) <= 0 or self.membership_hold_s < 0:
            raise ValueError("lease_ttl_s, discovery_interval_s and health_timeout_s must be positive, "
                             "membership_hold_s not negative")
        if self.lease_ttl_s < 2:
            raise ValueError("lease_ttl_s must be at least 2 s (leases are renewed every second)")
        if self.retire_after_s < 0 or self.retired_retention_s < 0:
            raise ValueError("retire_after_s and retired_retention_s must not be negative")
        for spec in self.engines_from:
            if not spec.startswith(("dns://", "file://")):
                raise ValueError(f"--engines-from {spec!r}: expected dns://NAME:PORT or file://PATH")
        if self.pod_id not in ("topic", "endpoint"):
            raise ValueError(f"pod_id must be 'topic' or 'endpoint', got {self.pod_id!r}")
        if not all(str(p).isdigit() and 0 < int(p) <= 65535 for p in self.target_ports):
            raise ValueError(f"target_ports must be port numbers, got {','.join(map(str, self.target_ports))}")
        if not all(d.startswith("/") for d in self.register_ipc_dirs):
            raise ValueError(f"register_ipc_dirs must be absolute folders, got {','.join(self.register_ipc_dirs)}")
        if not 0 <= self.dynamo_port <= 65535:
            raise ValueError("dynamo_port must be a port number (0: off)")
        if self.gateway_max_inflight < 1 or min(self.gateway_decode_tokens, self.gateway_kv_capacity) < 0:
            raise ValueError("gateway_max_inflight must be at least 1, gateway_decode_tokens and gateway_kv_capacity "
                             "not negative")
        if min(self.gateway_connect_timeout_s, self.gateway_read_timeout_s) <= 0 or \
                min(self.gateway_avoid_s, self.gateway_booking_ttl_s, self.gateway_speculative_ttl_s) < 0:
            raise ValueError("gateway_connect_timeout_s and gateway_read_timeout_s must be positive, "
                             "gateway_avoid_s, gateway_booking_ttl_s and gateway_speculative_ttl_s not negative")
        if self.api_keys and not any(k.strip() for k in self.api_keys):
            # a typo or an unset secret (KVPF_API_KEYS="${KEYS}") must not quietly switch auth off
            raise ValueError("KVPF_API_KEYS is set but names no key (only blanks and commas): give k1,k2, "
                             "or unset it to serve without API keys")


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if kind.startswith("tuple"):
        items = tuple(p.strip() for p in raw.split(","))
        # api_keys keeps its blanks so validate() can refuse a KVPF_API_KEYS that names no key
        return items if f.name == "api_keys" else tuple(x for x in items if x)
    if kind.startswith("dict"):
        items = [x for x in raw.split(",") if x.strip()]
        return _DICT_PARSERS.get(f.name, parse_model_urls)(items)
    return raw


def parse_model_urls(items: Any) -> dict[str, tuple[str, ...]]:
    """``MODEL=http://host:port`` pairs, as given to ``--engine-url``; a model given twice has both URLs."""
    out: dict[str, tuple[str, ...]] = {}
    for item in items:
        model, sep, url = item.strip().partition("=")
        if not sep or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-url expects MODEL=http://HOST:PORT, got {item!r}")
        url = url.rstrip("/")
        if url not in out.get(model, ()):
            out[model] = out.get(model, ()) + (url,)
    return out


def parse_pairs(items: Any, flag: str, what: str) -> dict[str, str]:
    """``NAME=VALUE`` pairs of a repeatable flag."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.strip().partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag} expects NAME={what}, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def parse_tokenizer_dirs(items: Any) -> dict[str, str]:
    """``MODEL=DIR`` pairs, as given to ``serve --tokenizer``."""
    return parse_pairs(items, "--tokenizer", "DIR")


def parse_pod_urls(items: Any) -> dict[str, str]:
    """``POD=http://host:port`` pairs, as given to ``serve --pod-metrics``."""
    out = parse_pairs(items, "--pod-metrics", "http://HOST:PORT")
    for pod, url in out.items():
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--pod-metrics expects POD=http://HOST:PORT, got {pod}={url}")
        out[pod] = url.rstrip("/")
    return out


def parse_tier_weights(items: Any) -> dict[str, float]:
    """``TIER=WEIGHT`` pairs (``gpu=1.0 cpu=0.8``), as given to ``serve --route-tier-weight``."""
    out: dict[str, float] = {}
    for tier, value in parse_pairs(items, "--route-tier-weight", "WEIGHT").items():
        try:
            out[tier.lower()] = float(value)
        except ValueError:
            raise ValueError(f"--route-tier-weight expects TIER=NUMBER, got {tier}={value}") from None
    return out


def parse_lora_names(items: Any) -> dict[str, str]:
    """``ID=NAME`` pairs (``3=sql-lora``), as given to ``ingest --lora-name``."""
    out = parse_pairs(items, "--lora-name", "NAME")
    for lora_id in out:
        if not lora_id.isdigit():
            raise ValueError(f"--lora-name expects ID=NAME with a numeric LoRA id, got {lora_id}={out[lora_id]}")
    return {str(int(k)): v for k, v in out.items()}


def parse_group_specs(items: Any) -> dict[str, dict[int, Any]]:
    """``MODEL:GROUP=KIND[/block=N][/window=N][/chunk=N][/eagle]`` values, as given to ``--group-spec``."""
    from kv_preflight.engines.hit_rules import parse_group_specs as parse

    return parse(items)


_DICT_PARSERS = {"tokenizers": parse_tokenizer_dirs, "pod_metrics": parse_pod_urls,
                 "route_tier_weights": parse_tier_weights, "lora_names": parse_lora_names,
                 "group_specs": parse_group_specs}
