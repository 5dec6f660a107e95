"""The OpenAPI 3.1 document served at ``/openapi.json``.

Response schemas are generated from the msgspec structs the handlers encode
(``Prediction``, ``RouteDecision``), so they cannot drift from what is sent. The
request schema is written out because the contract is stricter than the struct:
``model`` plus exactly one of ``token_ids``, ``prompt``, ``messages``. The test suite
fuzzes the running app against this document (schemathesis) and validates every
response it gets against it.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kv_preflight.predictor.explain.rules import Explanation
from kv_preflight.predictor.scoring.route import RouteDecision
from kv_preflight.predictor.scoring.score import Prediction
from kv_preflight.predictor.stats import DEFAULT_PODS_LIMIT, MAX_PODS_LIMIT
from kv_preflight.config import Config
from kv_preflight.keys.chain import MAX_TOKEN_ID

REF = "#/components/schemas/{name}"


def _request_schema(cfg: Config) -> dict[str, Any]:
    models = sorted(set(cfg.engine_urls) | set(cfg.tokenizers))
    common = {
        "model": {"type": "string", "minLength": 1, "description": "Model name as the engine serves it; the "
                  "adapter name for a LoRA adapter.", **({"examples": models} if models else {})},
        "pods": {"type": "array", "items": {"type": "string"}, "maxItems": cfg.max_pods_filter,
                 "description": "Candidate pods; omitted: every pod. An empty list means none. At most "
                 "max_pods_filter entries."},
        "cache_salt": {"type": ["string", "null"], "description": "vLLM's cache_salt of the request: the prompt "
                       "is keyed as the engine keys a salted prompt (salt on the first block)."},
        "mm_items": {"type": ["array", "null"], "description": "The prompt's multimodal items as the engine sees "
                     "them: per item its identifier (vLLM's mm hash / identifier) and its placeholder's offset and "
                     "length in the token ids (placeholders expanded). Placeholders may not overlap nor run past "
                     "the prompt. The blocks they overlap are keyed as vLLM keys them.",
                     "items": {"type": "object", "required": ["identifier", "offset", "length"],
                               "additionalProperties": False, "properties": {
                                   "identifier": {"type": "string", "minLength": 1},
                                   "offset": {"type": "integer", "minimum": 0},
                                   "length": {"type": "integer", "minimum": 1},
                                   "modality": {"type": ["string", "null"]}}}},
    }
    inputs = {
        "token_ids": {"type": "array", "minItems": 1, "maxItems": cfg.max_tokens,
                      "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}},
        "prompt": {"type": "string", "minLength": 1, "description": "Tokenized as the engine's /v1/completions does."},
        "messages": {"type": "array", "minItems": 1, "description": "Chat messages; the model's chat template is "
                     "applied with add_generation_prompt, as /v1/chat/completions does.",
                     "items": {"$ref": REF.format(name="ChatMessage")}},
    }
    return {"oneOf": [
        {"type": "object", "title": f"by {name}", "required": ["model", name], "additionalProperties": False,
         "properties": {**common, name: schema}}
        for name, schema in inputs.items()
    ]}


def _explain_request_schema(cfg: Config) -> dict[str, Any]:
    """The predict body plus ``compare``: a second prompt in one of the same three forms."""
    predict = _request_schema(cfg)
    forms = [v["properties"] for v in predict["oneOf"]]
    inputs = {name: props[name] for props, name in zip(forms, ("token_ids", "prompt", "messages"))}
    compare = {"description": "The earlier request this one was expected to hit (same model); the answer's "
               "divergence says where and why they part.", "oneOf": [
                   {"type": "object", "required": [name], "additionalProperties": False, "properties": {name: schema}}
                   for name, schema in inputs.items()]}
    return {"oneOf": [{**v, "properties": {**v["properties"], "compare": compare}} for v in predict["oneOf"]]}


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}


def _errors(*codes: int) -> dict[str, Any]:
    what = {400: "Bad input: unknown model, missing or several inputs, bad token ids, too many tokens or pods, "
                 "JSON nested too deeply.",
            401: "Missing or wrong API key (only when keys are configured).",
            404: "No such pod in the index.",
            408: "The body did not arrive within request_read_timeout; the connection is closed.",
            413: "Body larger than max_body_bytes.",
            415: "A Content-Type that is not JSON (none at all is read as JSON).",
            503: "Valkey or the engine is unreachable or too slow (answered fast, never a hang)."}
    return {str(c): {"description": what[c], "content": {"application/json": {
        "schema": {"$ref": REF.format(name="Error")}}}} for c in codes}


_STATS_PARAMETERS = [
    {"name": "pods_offset", "in": "query", "schema": {"type": "integer", "minimum": 0, "default": 0},
     "description": "First pod of the page, in pod id order."},
    {"name": "pods_limit", "in": "query",
     "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PODS_LIMIT, "default": DEFAULT_PODS_LIMIT},
     "description": "Pods per page."},
    {"name": "pod", "in": "query", "schema": {"type": "string", "minLength": 1},
     "description": "Only this pod (no summary); 404 if the index does not know it."},
]


def openapi_document(cfg: Config, *, auth: bool = False) -> dict[str, Any]:
    _, components = msgspec.json.schema_components([Prediction, RouteDecision, Explanation],
                                                    ref_template=REF)
    components["PredictRequest"] = _request_schema(cfg)
    components["ExplainRequest"] = _explain_request_schema(cfg)
    components["ChatMessage"] = {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"type": "string"}, "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "object", "properties": {"type": {"type": "string"},
                                                                       "text": {"type": "string"}}}},
        ]}},
    }
    components["Error"] = _ERROR

    def body_op(summary: str, response: str, description: str, request: str = "PredictRequest") -> dict[str, Any]:
        op: dict[str, Any] = {
            "summary": summary, "description": description,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": REF.format(name=request)}}}},
            "responses": {"200": {"description": "OK", "content": {"application/json": {
                "schema": {"$ref": REF.format(name=response)}}}}, **_errors(400, 408, 413, 415, 503)},
        }
        if auth:
            op["responses"].update(_errors(401))
        return op

    def get_op(summary: str, content: dict[str, Any], codes: tuple[int, ...] = (),
               parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        op: dict[str, Any] = {"summary": summary,
                              "responses": {"200": {"description": "OK", "content": content}, **_errors(*codes)}}
        if parameters:
            op["parameters"] = parameters
        if auth:
            op["responses"].update(_errors(401))
        return op

    any_json = {"application/json": {"schema": {"type": "object"}}}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "kv-preflight", "version": "1",
                 "description": "Prefix-cache hit prediction, TTFT estimates and cache-aware routing for vLLM pods."},
        "paths": {
            "/v1/cache/predict": {"post": body_op(
                "Predict cached tokens per pod", "Prediction",
                "How many prompt tokens each pod would reuse from its prefix cache, the best pod, and the "
                "estimated time to first token on each.")},
            "/v1/cache/route": {"post": body_op(
                "Choose a pod", "RouteDecision",
                "The pod to send the request to: the best cache overlap unless that pod is overloaded, then "
                "the least loaded among the good matches (docs/routing.md).")},
            "/v1/cache/explain": {"post": body_op(
                "Explain a hit or a miss", "Explanation",
                "The prediction plus, per pod, where its cached chain stops and the tokens the engine's rules "
                "drop; findings (duplicate or missing BOS, whitespace, template drift, rolling context, another "
                "model's root...); with compare, where and why the two prompts part (docs/explain.md).",
                request="ExplainRequest")},
            "/health": {"get": {"summary": "Liveness and Valkey reachability", "security": [], "responses": {
                "200": {"description": "OK", "content": any_json},
                "503": {"description": "Valkey unreachable", "content": any_json}}}},
            "/ready": {"get": {"summary": "Readiness: Valkey answers and the fleet records were read", "security": [],
                               "responses": {
                "200": {"description": "Ready", "content": any_json},
                "503": {"description": "Not ready yet (or Valkey unreachable); retry", "content": any_json}}}},
            "/stats": {"get": get_op("Index summary, a page of pods (or one pod), tokenization sources, engine load",
                                     any_json, (400, 404, 503), _STATS_PARAMETERS)},
            "/metrics": {"get": get_op("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}})},
            "/metrics/pods": {"get": get_op("Prometheus metrics of the index per pod (blocks, memory; the 100 pods "
                                            "holding most, the rest under pod=\"_other\")",
                                            {"text/plain": {"schema": {"type": "string"}}})},
            "/openapi.json": {"get": get_op("This document", any_json)},
        },
        "components": {"schemas": components},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
