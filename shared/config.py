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
    # Which PodEntry form writers emit: "json" (llm-d v0.9+) or "v08" (pod@tier).
    entry_format: str = "json"
    # Every Valkey call is bounded: an outage turns into a fast error, never a hang.
    valkey_timeout_s: float = 1.0
    # "auto" asks the node named by valkey_url (INFO cluster); "yes"/"no" say it up front.
    valkey_cluster: str = "auto"
    # Ingester
    sources: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    replay_timeout_s: float = 2.0
    # Hostile-input bounds (docs/operations.md, "Hostile publishers and memory"): ZMQ drops a connection
    # whose frame is larger than max_frame_bytes before allocating it; a socket's queue holds
    # max_queue_bytes of such frames.
    max_frame_bytes: int = 32 * 1024 * 1024
    max_queue_bytes: int = 256 * 1024 * 1024
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
    tokenizer_check: bool = True  # compare with the engine's /tokenize at start-up; fall back on a mismatch
    ttft_model: str = ""  # JSON written by `kv-preflight calibrate`; empty: the documented defaults
    # Routing (docs/routing.md): engine metrics to scrape, pod -> http://host:port, plus the --engine-url engines.
    pod_metrics: dict[str, str] = field(default_factory=dict)
    metrics_interval_s: float = 1.0
    route_tier_weights: dict[str, float] = field(default_factory=lambda: {"gpu": 1.0, "cpu": 0.8})
    route_waiting_weight: float = 2.0
    route_overload_abs: float = 6.0  # vs the fleet mean incl. the pod (docs/routing.md: why 6, measured)
    route_overload_rel: float = 1.5
    route_max_kv_usage: float = 0.95
    route_good_match: float = 0.5
    route_stale_s: float = 5.0
    # Request limits (predictor): the pods filter's length, and the time to read a request's headers, then
    # its body (a slow client must not hold a connection forever).
    max_pods_filter: int = 1024
    request_read_timeout_s: float = 10.0
    # Distinct pod label values per Prometheus metric (both processes); later pods are summed under "_other".
    max_pod_series: int = 256
    # API keys (Authorization: Bearer); none configured: no auth. Never logged or printed.
    api_keys_file: str = ""
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Ingester: Prometheus /metrics port (0: none).
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
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
            if env is not None and f.name != "given":
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
        if self.entry_format not in ("json", "v08"):
            raise ValueError(f"entry_format must be 'json' or 'v08', got {self.entry_format!r}")
        if not self.valkey_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"valkey_url {self.valkey_url.split('@')[-1]!r} needs a scheme: redis://HOST:PORT, "
                             "rediss:// (TLS) or unix:///path")
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
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("metrics_port must be a port number (0: off)")
        if self.max_frame_bytes < 4096 or self.max_queue_bytes < self.max_frame_bytes:
            raise ValueError("max_frame_bytes must be at least 4096, and max_queue_bytes at least max_frame_bytes")
        if self.curve_allow and not self.curve_secret_key_file:
            raise ValueError("--curve-allow needs --curve-secret-key-file (the ingester's own CURVE keypair)")
        if self.max_pods_filter <= 0 or self.max_pod_series <= 0:
            raise ValueError("max_pods_filter and max_pod_series must be positive")
        if self.request_read_timeout_s <= 0:
            raise ValueError("request_read_timeout_s must be positive")
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


_DICT_PARSERS = {"tokenizers": parse_tokenizer_dirs, "pod_metrics": parse_pod_urls,
                 "route_tier_weights": parse_tier_weights}
