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
    # Ingester
    sources: tuple[str, ...] = ()
    binds: tuple[str, ...] = ()
    engines: tuple[str, ...] = ()
    replay_timeout_s: float = 2.0
    # Predictor
    host: str = "127.0.0.1"
    port: int = 8080
    engine_urls: dict[str, str] = field(default_factory=dict)
    max_tokens: int = 262_144
    max_body_bytes: int = 8 * 1024 * 1024
    engine_timeout_s: float = 5.0
    lookup: str = "script"  # "script" (one EVALSHA) or "pipeline" (HKEYS per key, Valkey Cluster)
    log_json: bool = False

    @classmethod
    def load(cls, **overrides: Any) -> "Config":
        """Flags given explicitly (not None) win over ``KVPF_<FIELD>`` env vars, which win over defaults."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env = os.environ.get(ENV_PREFIX + f.name.upper())
            if env is not None:
                values[f.name] = _parse_env(f, env)
        for name, value in overrides.items():
            if value is None or (isinstance(value, (tuple, list, dict)) and not value and name in values):
                continue
            values[name] = tuple(value) if isinstance(value, list) else value
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.entry_format not in ("json", "v08"):
            raise ValueError(f"entry_format must be 'json' or 'v08', got {self.entry_format!r}")
        if self.lookup not in ("script", "pipeline"):
            raise ValueError(f"lookup must be 'script' or 'pipeline', got {self.lookup!r}")
        if self.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if kind.startswith("int"):
        return int(raw)
    if kind.startswith("float"):
        return float(raw)
    if kind.startswith("bool"):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    if kind.startswith("tuple"):
        return tuple(x for x in (p.strip() for p in raw.split(",")) if x)
    if kind.startswith("dict"):
        return parse_model_urls(x for x in raw.split(",") if x.strip())
    return raw


def parse_model_urls(items: Any) -> dict[str, str]:
    """``MODEL=http://host:port`` pairs, as given to ``--engine-url``."""
    out: dict[str, str] = {}
    for item in items:
        model, sep, url = item.strip().partition("=")
        if not sep or not model or not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-url expects MODEL=http://HOST:PORT, got {item!r}")
        out[model] = url.rstrip("/")
    return out
