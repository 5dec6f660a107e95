"""The gateway's pure parts: what routing reads from an OpenAI body, the decision's headers (a data-parallel rank
included, on a decision built here: the field comes with the lead's DP-rank work), the command's defaults."""
from __future__ import annotations

import msgspec
import pytest

from kv_preflight.cli.gateway_cmd import config_values
from kv_preflight.keys.chain import request_keys
from kv_preflight.predictor.gateway.app import decision_headers
from kv_preflight.predictor.gateway.openai import read_routable
from kv_preflight.predictor.errors import BadRequest
from kv_preflight.predictor.request import KeyedRequest, PredictRequest
from kv_preflight.predictor.routed import RoutedState
from kv_preflight.predictor.scoring.route import RouteDecision

ARGS = dict(max_tokens=1000, hash_seed="", block_size=4, hash_algo="fnv64a")


def body(**fields) -> bytes:
    return msgspec.json.encode({"model": "m", **fields})


def test_a_token_prompt_is_keyed_from_the_json_text():
    got = read_routable(body(prompt=list(range(10)), max_tokens=7, stream=True, temperature=0.3), chat=False, **ARGS)
    assert isinstance(got.request, KeyedRequest)
    assert got.request.keys == request_keys(list(range(10)), model="m", hash_seed="", block_size=4)
    assert got.request.n_tokens == 10 and got.stream and got.max_tokens == 7


@pytest.mark.parametrize("prompt, want", [("hello", {"prompt": "hello"}), (["hello", "x"], {"prompt": "hello"}),
                                          ([[1, 2, 3], [4]], {"token_ids": [1, 2, 3]})])
def test_other_prompts_go_to_the_predictors_tokenization(prompt, want):
    got = read_routable(body(prompt=prompt), chat=False, **ARGS).request
    assert isinstance(got, PredictRequest) and got.model == "m"
    assert {k: getattr(got, k) for k in want} == want


def test_chat_messages_and_max_completion_tokens():
    got = read_routable(body(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=9, max_tokens=3),
                    chat=True, **ARGS)
    assert got.request.messages == [{"role": "user", "content": "hi"}] and got.max_tokens == 9 and not got.stream


@pytest.mark.parametrize("raw, chat, why", [
    (b"{", False, "invalid JSON"), (body(), False, "missing prompt"), (body(prompt=""), False, "prompt is empty"),
    (body(prompt=[1, "a"]), False, "prompt must be"), (body(messages=[]), True, "messages is empty"),
    (msgspec.json.encode({"prompt": "x"}), False, "missing model"), (body(prompt="x"), True, "missing messages"),
])
def test_bad_bodies_say_why(raw, chat, why):
    with pytest.raises(BadRequest, match=why):
        read_routable(raw, chat=chat, **ARGS)


class RankedDecision(RouteDecision, frozen=True):
    dp_rank: int | None = None


def decision(pod: str, **kw) -> RouteDecision:
    return RankedDecision(pod_id=pod, reason="best_overlap", detail="", total_prompt_tokens=64, cached_tokens=48,
                          estimated_ttft_ms=1.0, best_overlap_pod=pod, candidates=[], **kw)


def test_headers_name_the_pod_as_the_index_does():
    assert dict(decision_headers(decision("vllm-0"))) == {
        b"x-kvpf-pod": b"vllm-0", b"x-kvpf-predicted-cached-tokens": b"48", b"x-kvpf-reason": b"best_overlap"}
    assert dict(decision_headers(decision("vllm-0", dp_rank=0)))[b"x-kvpf-pod"] == b"vllm-0"
    ranked = dict(decision_headers(decision("vllm-0", dp_rank=2), failed="vllm-1"))
    assert ranked[b"x-kvpf-pod"] == b"vllm-0@dp2" and ranked[b"x-kvpf-retried-from"] == b"vllm-1"


def test_a_balancer_in_front_is_one_client_address():
    assert config_values({"max_connections_per_client": None})["max_connections_per_client"] == 0
    assert config_values({"max_connections_per_client": 5})["max_connections_per_client"] == 5
    values = config_values({"tier_weights": ("gpu=1", "cpu=0.5"), "engine_urls": (), "workers_unknown": 3})
    assert values["route_tier_weights"] == {"gpu": 1.0, "cpu": 0.5} and values["engine_urls"] is None
    assert "workers_unknown" not in values


def test_avoided_pods_are_left_out_while_another_is_left():
    now = [0.0]
    state = RoutedState(clock=lambda: now[0])
    state.avoid("a", 10)
    assert state.usable({"a", "b"}) == {"b"}
    assert state.usable({"a"}) == {"a"}  # a pod that failed beats no pod
    now[0] = 10.0
    assert state.usable({"a", "b"}) == {"a", "b"} and state.avoided() == frozenset()
