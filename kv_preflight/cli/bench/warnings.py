"""Bench row: what the ``warnings`` of predict and route add to the hot path (predictor/explain/warnings.py).

Per request the predictor reads the first two token ids from the raw JSON (fast path), checks them
against the model's BOS, looks up template drift, copies the answer struct with the list, and counts
the prediction for ``diagnose fleet`` (predictor/diagnosis/traffic.py). Measured in-process, against doing none of it.
"""
from __future__ import annotations

import msgspec

from kv_preflight.predictor.explain.warnings import ModelHints, PromptWarnings
from kv_preflight.predictor.request import KeyedRequest
from kv_preflight.predictor.scoring.score import PodAffinity, Prediction
from kv_preflight.predictor.tokens.source import Tokenization
from kv_preflight.predictor.tokens.engine import EngineTokenizer
from kv_preflight.predictor.diagnosis.traffic import Traffic
from kv_preflight.keys.chain import request_keys


def bench_warnings(res, quick: bool, timeit) -> None:
    print("warnings on the hot path (BOS check, template drift, traffic totals)", flush=True)
    warnings = PromptWarnings(Tokenization(EngineTokenizer({}, 1.0), {}))
    warnings.hints["m"] = ModelHints(bos_id=1, adds_bos=True)
    raw = msgspec.Raw(b"[1, 2, " + b", ".join(b"%d" % (i % 30000) for i in range(4096)) + b"]")
    prediction = Prediction(64, 4096, 256, 4, 0.015, "pod-a", [PodAffinity("pod-a", 4, 64, "gpu")])
    traffic = Traffic()

    known = KeyedRequest(model="m", keys=[], n_tokens=4096, pods=None, raw_token_ids=raw)
    other = KeyedRequest(model="other", keys=[], n_tokens=4096, pods=None, raw_token_ids=raw)

    def with_warnings() -> None:
        msgspec.structs.replace(prediction, warnings=warnings.check_keyed(known))
        traffic.observe("m", 1234567890123, 4096, 64)

    ours = timeit(with_warnings, min_time=0.2 if quick else 0.5)
    unknown = timeit(lambda: warnings.check_keyed(other), min_time=0.2)
    # The same run's request keys of the same prompt, which every request computes anyway: the
    # ratio stays meaningful on a loaded machine, where every absolute figure is inflated.
    tokens = msgspec.json.decode(bytes(raw))
    keys = timeit(lambda: request_keys(tokens, model="m"), min_time=0.2)
    res.add("warnings + traffic per request (4K tokens)",
            f"{ours * 1e6:.2f} us = {ours / keys:.0%} of the request keys ({keys * 1e6:.0f} us); model with no "
            f"hints: {unknown * 1e6:.2f} us", "a few us, below the request keys", "none (0 us)", None, None,
            ours_s=ours, unknown_model_s=unknown, request_keys_s=keys)
