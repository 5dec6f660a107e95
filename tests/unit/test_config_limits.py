"""The request-limit and cardinality settings from flags and env, and an API key list that names no
key refused at start-up (it used to switch auth off silently)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kv_preflight.predictor.http.auth import load_api_keys
from kv_preflight.config import Config

REPO = Path(__file__).resolve().parents[2]


def test_defaults():
    cfg = Config()
    assert (cfg.max_pods_filter, cfg.request_read_timeout_s, cfg.max_pod_series) == (1024, 10.0, 256)


def test_env_then_flags(monkeypatch):
    monkeypatch.setenv("KVPF_MAX_PODS_FILTER", "64")
    monkeypatch.setenv("KVPF_REQUEST_READ_TIMEOUT_S", "2.5")
    monkeypatch.setenv("KVPF_MAX_POD_SERIES", "32")
    cfg = Config.load()
    assert (cfg.max_pods_filter, cfg.request_read_timeout_s, cfg.max_pod_series) == (64, 2.5, 32)
    cfg = Config.load(max_pods_filter=8, request_read_timeout_s=1.0, max_pod_series=4)
    assert (cfg.max_pods_filter, cfg.request_read_timeout_s, cfg.max_pod_series) == (8, 1.0, 4)


@pytest.mark.parametrize("bad", [{"max_pods_filter": 0}, {"max_pod_series": 0}, {"request_read_timeout_s": 0}])
def test_limits_must_be_positive(bad):
    with pytest.raises(ValueError):
        Config.load(**bad)


@pytest.mark.parametrize("value", [" , ", ",", "", "  ", " ,, , "])
def test_api_keys_naming_no_key_are_refused(monkeypatch, value):
    monkeypatch.setenv("KVPF_API_KEYS", value)
    with pytest.raises(ValueError, match="KVPF_API_KEYS is set but names no key"):
        Config.load()


def test_api_keys_with_blanks_between_keys_are_fine(monkeypatch):
    monkeypatch.setenv("KVPF_API_KEYS", " k1 , ,k2,")
    cfg = Config.load()
    assert load_api_keys(cfg.api_keys_file, cfg.api_keys) == ["k1", "k2"]
    monkeypatch.delenv("KVPF_API_KEYS")
    assert Config.load().api_keys == ()  # unset: no auth, as before


def test_a_config_built_by_hand_is_refused_where_the_keys_are_loaded():
    with pytest.raises(ValueError, match="names no key"):
        load_api_keys("", (" ", ""))


@pytest.mark.parametrize("command", [["serve"], ["ingest", "--source", "tcp://127.0.0.1:1"]])
def test_the_cli_exits_non_zero_saying_why(command):
    env = dict(os.environ, KVPF_API_KEYS=" , ")
    proc = subprocess.run([sys.executable, "-m", "kv_preflight", *command, "--valkey-url", "redis://127.0.0.1:1/0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "KVPF_API_KEYS is set but names no key" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
