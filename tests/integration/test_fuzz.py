"""Schemathesis fuzzes the running predictor from its own /openapi.json: no input, valid or not,
may produce a 5xx while Valkey is up, and every response must match the document."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import redis
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.http.openapi import openapi_document
from kv_preflight.config import Config
from kv_preflight.index.layout import PODS_KEY
from tests.integration.http_engine import HttpEngine
from tests.tokenizer_files import write_tokenizer

pytestmark = [pytest.mark.integration]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
MODELS = {"engine": "engine-model", "local": "local-model"}
LIMITS = {"max_tokens": 4096, "max_body_bytes": 256 * 1024}
# The document depends only on models and limits, so it is known before the server starts; a test
# below checks the server serves exactly this one.
DOCUMENT = openapi_document(Config(engine_urls={MODELS["engine"]: "http://engine"},
                                   tokenizers={MODELS["local"]: "dir"}, **LIMITS))


@pytest.fixture(scope="module")
def api_url(valkey_server, tmp_path_factory):
    r = redis.Redis.from_url(valkey_server.url)
    r.flushall()
    r.hset(PODS_KEY, "index-pod", INDEX_MODEL)  # as an ingester leaves it
    r.close()
    tok_dir = write_tokenizer(tmp_path_factory.mktemp("fuzz-tok"))
    engine = HttpEngine("fuzz-pod", [MODELS["engine"]], tokenize_fn=lambda body: [1, 2, 3] * 20, running=1).start()
    cfg = Config(valkey_url=valkey_server.url, engine_urls={MODELS["engine"]: engine.url},
                 tokenizers={MODELS["local"]: str(tok_dir)}, pod_metrics={"fuzz-pod": engine.url},
                 metrics_interval_s=0.2, **LIMITS)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "predictor did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    engine.stop()


INDEX_MODEL = "index-model"  # known from the index only: token_ids work, prompt/messages cannot be tokenized


def with_known_models(document: dict) -> dict:
    """The same document with ``model`` drawn from the models this server knows, so generated requests
    get past the model check into tokenization, lookup, scoring and routing."""
    deep = copy.deepcopy(document)
    for variant in deep["components"]["schemas"]["PredictRequest"]["oneOf"]:
        variant["properties"]["model"] = {"enum": [*MODELS.values(), INDEX_MODEL]}
    return deep


def fuzzed(document: dict):
    s = schemathesis.openapi.from_dict(document)
    # valid requests and invalid ones (every 4xx branch)
    s.config.generation.update(modes=list(schemathesis.GenerationMode))
    return s


schema = fuzzed(DOCUMENT)
deep_schema = fuzzed(with_known_models(DOCUMENT))


def test_the_server_serves_the_fuzzed_document(api_url):
    import httpx

    assert httpx.get(api_url + "/openapi.json", timeout=5).json() == DOCUMENT


@schema.parametrize()
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_responses_match_the_document(case, api_url):
    case.call_and_validate(base_url=api_url, checks=CHECKS)


def is_documented_outage(case, response) -> bool:
    """The one 5xx the API promises (docs/api.md): 503 for a prompt no engine or tokenizer can tokenize now.
    INDEX_MODEL has pods in the index and neither, so its prompts and messages get it; nothing else may."""
    body = case.body if isinstance(case.body, dict) else {}
    return (response.status_code == 503 and body.get("model") == INDEX_MODEL
            and ("prompt" in body or "messages" in body) and "cannot tokenize" in response.text)


@deep_schema.parametrize()
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
def test_known_models_reach_every_path_without_server_errors(case, api_url):
    response = case.call(base_url=api_url)
    if is_documented_outage(case, response):
        return
    case.validate_response(response, checks=CHECKS)
