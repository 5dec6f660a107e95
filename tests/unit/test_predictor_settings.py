"""A predictor's settings against the index's (predictor/settings.py): adopt what was not given, refuse what disagrees."""
from __future__ import annotations

import pytest

from kv_preflight.predictor.settings import reconcile, refusal
from kv_preflight.config import Config
from kv_preflight.fleet.records import IndexSettings

INDEX = IndexSettings(hash_seed="42", block_size=32, entry_format="v08")


def test_defaults_adopt_the_index_settings():
    cfg, adopted, problems = reconcile(Config(), INDEX)
    assert problems == [] and (cfg.hash_seed, cfg.block_size, cfg.entry_format) == ("42", 32, "v08")
    assert adopted == ["hash_seed='42'", "block_size=32", "entry_format='v08'"]


def test_no_settings_in_the_index_keeps_our_own():
    cfg = Config.load(block_size=64)
    assert reconcile(cfg, None) == (cfg, [], [])


def test_given_values_that_agree_are_fine_and_the_rest_is_adopted():
    cfg, adopted, problems = reconcile(Config.load(block_size=32), INDEX)
    assert problems == [] and adopted == ["hash_seed='42'", "entry_format='v08'"] and cfg.block_size == 32


def test_given_values_that_disagree_are_each_named(monkeypatch):
    monkeypatch.setenv("KVPF_HASH_SEED", "7")
    cfg = Config.load(block_size=16)
    assert set(cfg.given) >= {"hash_seed", "block_size"} and "entry_format" not in cfg.given
    same, adopted, problems = reconcile(cfg, INDEX)
    assert same is cfg and adopted == []
    assert problems == ["hash_seed: given '7' (--hash-seed or KVPF_HASH_SEED), the index has '42'",
                        "block_size: given 16 (--block-size or KVPF_BLOCK_SIZE), the index has 32"]
    line = refusal(problems)
    assert "\n" not in line and "hash_seed" in line and "block_size" in line


def test_another_hash_algorithm_is_refused():
    _, _, problems = reconcile(Config(), IndexSettings(hash_seed="", block_size=16, hash_algo="sha256"))
    assert problems and "hash_algo" in problems[0]


@pytest.mark.parametrize("given", [["m=http://a:1", "m=http://b:2", "n=http://c:3"]])
def test_engine_url_keeps_every_url_of_a_model(given, monkeypatch):
    from kv_preflight.config import parse_model_urls

    assert parse_model_urls(given) == {"m": ("http://a:1", "http://b:2"), "n": ("http://c:3",)}
    monkeypatch.setenv("KVPF_ENGINE_URLS", ",".join(given))
    assert Config.load().engine_urls["m"] == ("http://a:1", "http://b:2")
    assert Config(engine_urls={"m": "http://a:1"}).engine_urls == {"m": ("http://a:1",)}
