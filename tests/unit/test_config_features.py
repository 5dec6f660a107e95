"""The new Config fields from env and flags: tokenizers, pod metrics, tier weights, API keys (never in repr)."""
from __future__ import annotations

import pytest

from kv_preflight.config import Config, parse_pod_urls, parse_tier_weights, parse_tokenizer_dirs


def test_env_dicts_and_keys(monkeypatch):
    monkeypatch.setenv("KVPF_TOKENIZERS", "m1=/models/a, m2=/models/b")
    monkeypatch.setenv("KVPF_POD_METRICS", "pod-0=http://h0:8000/,pod-1=http://h1:8000/metrics")
    monkeypatch.setenv("KVPF_ROUTE_TIER_WEIGHTS", "GPU=1,cpu=0.5")
    monkeypatch.setenv("KVPF_API_KEYS", "secret-a,secret-b")
    monkeypatch.setenv("KVPF_ROUTE_OVERLOAD_ABS", "8")
    cfg = Config.load(route_overload_rel=2.0)
    assert cfg.tokenizers == {"m1": "/models/a", "m2": "/models/b"}
    assert cfg.pod_metrics == {"pod-0": "http://h0:8000", "pod-1": "http://h1:8000/metrics"}
    assert cfg.route_tier_weights == {"gpu": 1.0, "cpu": 0.5}
    assert cfg.api_keys == ("secret-a", "secret-b") and "secret" not in repr(cfg)
    assert (cfg.route_overload_abs, cfg.route_overload_rel) == (8.0, 2.0)


def test_parsers_and_validation():
    assert parse_tokenizer_dirs(["m=/d"]) == {"m": "/d"}
    with pytest.raises(ValueError, match="--tokenizer"):
        parse_tokenizer_dirs(["/just/a/dir"])
    with pytest.raises(ValueError, match="--pod-metrics"):
        parse_pod_urls(["pod=h:8000"])
    with pytest.raises(ValueError, match="NUMBER"):
        parse_tier_weights(["gpu=high"])
    for bad in ({"route_max_kv_usage": 0}, {"route_overload_rel": 0.5}, {"route_good_match": 2},
                {"metrics_interval_s": 0}, {"route_tier_weights": {"gpu": -1}}, {"metrics_port": 70000}):
        with pytest.raises(ValueError):
            Config.load(**bad)
