"""Dynamo's standalone-indexer shapes (predictor/dynamo/wire.py), checked against Dynamo's own fixtures.

Sources: ai-dynamo/dynamo lib/kv-router/src/services/overlap.rs @ 5ea3d18eaab82a2b7d2e8ffae5814aaa05ee67df
(test ``builds_cumulative_multi_rank_mooncake_summary``) and services/indexer/mod.rs
@ 0c496f291872a0bb02d5e9b6838db8ccabf418cf endpoint validation
(accepted ``tcp://*:5558``, ``tcp://127.0.0.1:0``, ``inproc://listener``, ``ipc:///tmp/dynamo.sock``;
rejected ``tcp://host``, ``tcp://:5558``, ``udp://host:5558``, ``not-an-endpoint``).
"""
from __future__ import annotations

import msgspec
import pytest

from kv_preflight.predictor.dynamo.wire import (EndpointError, EndpointRefused, build_score_response, check_endpoint,
                                   endpoint_host, stable_instance_id, tier_prefixes)
from kv_preflight.index.entries import PodEntry, encode_entry


def test_cumulative_multi_rank_summary_is_dynamos():
    # worker 7 rank 0: device 2 blocks, host extension 1, disk extension 2; rank 1: device 1, disk extension 1
    prefixes = {"r0": (2, 3, 5), "r1": (1, 1, 2)}
    got = build_score_response(prefixes, canonical_block=16, engine_blocks={"r0": 16, "r1": 16},
                               worker_of={"r0": (7, 0), "r1": (7, 1)}, block_size=16)
    s = got.instances["7"]
    assert (s.dp, s.gpu, s.cpu, s.disk, s.longest_matched) == ({"0": 32, "1": 16}, 32, 48, 80, 80)
    assert got.scores == {"7": {"0": 32, "1": 16}}
    assert got.frequencies == [2, 1]


def test_expected_worker_with_no_overlap_is_listed_with_zeros():
    got = build_score_response({}, canonical_block=16, engine_blocks={}, worker_of={}, expected=[(9, 3)],
                               block_size=16)
    assert msgspec.to_builtins(got) == {"scores": {"9": {"3": 0}}, "frequencies": [],
                                        "instances": {"9": {"longest_matched": 0, "gpu": 0, "dp": {"3": 0},
                                                            "cpu": 0, "disk": 0}}}


def test_tier_prefixes_are_cumulative_and_unbroken():
    def f(pod, tier):
        return encode_entry(PodEntry(pod, tier))
    keys = [[f("a", "gpu"), f("b", "cpu")], [f("a", "gpu"), f("b", "disk")], [f("a", "cpu_pinned")],
            [f("a", "storage"), f("b", "gpu")]]
    assert tier_prefixes(keys) == {"a": (2, 3, 4), "b": (0, 1, 2)}
    assert tier_prefixes(keys, ["b"]) == {"b": (0, 1, 2)}


def test_engine_blocks_round_down_to_whole_engine_blocks():
    got = build_score_response({"p": (3, 3, 3)}, canonical_block=16, engine_blocks={"p": 32},
                               worker_of={"p": (1, 0)}, block_size=32)
    assert got.instances["1"].gpu == 32 and got.frequencies == [1]


@pytest.mark.parametrize("endpoint", ["tcp://*:5558", "tcp://127.0.0.1:0", "inproc://listener", "ipc:///tmp/dynamo.sock",
                                      "tcp://[::1]:5557", "tcp://engine-0:5557"])
def test_endpoints_dynamo_accepts(endpoint):
    endpoint_host(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://host", "tcp://:5558", "udp://host:5558", "not-an-endpoint", "tcp://h:99999"])
def test_endpoints_dynamo_rejects(endpoint):
    with pytest.raises(EndpointError):
        endpoint_host(endpoint)


def test_register_allow_default_is_loopback():
    check_endpoint("tcp://127.0.0.1:5557", ())
    check_endpoint("tcp://[::1]:5557", ())
    check_endpoint("tcp://localhost:5557", ())
    check_endpoint("ipc:///tmp/engine.sock", ())
    for refused in ("tcp://10.0.0.7:5557", "tcp://engine-0:5557", "tcp://*:5557", "inproc://x"):
        with pytest.raises(EndpointRefused):
            check_endpoint(refused, ())
    check_endpoint("tcp://10.0.0.7:5557", ["10.0.0.0/8"])
    check_endpoint("tcp://engine-0:5557", ["engine-0"])
    with pytest.raises(EndpointRefused):
        check_endpoint("ipc:///tmp/engine.sock", ["10.0.0.0/8"])
    with pytest.raises(ValueError):
        check_endpoint("tcp://10.0.0.7:5557", ["not a host!"])


def test_stable_instance_id_is_stable_and_json_safe():
    assert stable_instance_id("vllm-0") == stable_instance_id("vllm-0") != stable_instance_id("vllm-1")
    assert 0 <= stable_instance_id("10.0.0.1:8000") < 2 ** 53


def test_an_ipc_path_must_normalize_into_an_allowed_folder():
    from kv_preflight.predictor.dynamo.wire import check_ipc_path

    check_ipc_path("ipc:///tmp/engine.sock", ["/tmp"])
    check_ipc_path("ipc:///tmp/a/../engine.sock", ["/tmp/"])
    check_ipc_path("ipc:///run/vllm/e.sock", ["/tmp", "/run/vllm"])
    for outside in ("ipc:///../../etc/passwd", "ipc:///tmp/../etc/passwd", "ipc:///tmpfoo/x", "ipc:///tmp",
                    "ipc://tmp/x", "ipc://@name", "ipc:///run/vllm2/e.sock"):
        with pytest.raises(EndpointRefused):
            check_ipc_path(outside, ["/tmp", "/run/vllm"])
    with pytest.raises(EndpointRefused):
        check_ipc_path("ipc:///tmp/engine.sock", [])


def test_own_services_are_refused_whatever_the_loopback_spelling():
    from kv_preflight.predictor.dynamo.wire import own_services

    services = own_services(["redis://127.0.0.1:6379/0", "rediss://:pw@10.0.0.5:7000"],
                            {"http://0.0.0.0:8080": "the predictor's HTTP port", "http://engine-0:8000": "an engine's"})
    for endpoint, what in (("tcp://localhost:6379", "Valkey"), ("tcp://10.0.0.5:7000", "Valkey"),
                           ("tcp://127.0.0.3:8080", "predictor"), ("tcp://engine-0:8000", "engine")):
        with pytest.raises(EndpointRefused, match=what):
            check_endpoint(endpoint, ["0.0.0.0/0", "::/0", "engine-0"], services=services)
    check_endpoint("tcp://127.0.0.1:5557", (), services=services)
    check_endpoint("tcp://engine-0:5557", ["engine-0"], services=services)
