"""``/v1/cache/explain`` against a real vLLM 0.32 (CPU, tiny model): its real tokenizer, chat template,
``/tokenize`` and ``/detokenize``, no local tokenizer in the predictor. Each finding kind from a
constructed case, none on a clean hit, and the predict answer's warnings."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kv_preflight.predictor.tokens.local import LocalTokenizer
from tests.e2e.conftest import VllmSpec
from tests.e2e.harness import kvpf_stack
from tests.e2e.test_vllm_features import tiny_model_dir

pytestmark = pytest.mark.e2e
VLLM_ENGINES = (VllmSpec("e2e-explain", 64),)

SYSTEM = "You are a careful assistant. Answer briefly and cite your sources when you can. " * 2


@pytest.fixture(scope="module")
def vllm(vllm_pool):
    engine = vllm_pool.take(VLLM_ENGINES[0])
    yield engine
    engine.stop()


def kinds(doc: dict) -> list[str]:
    return [f["kind"] for f in doc["findings"]]


def test_explain_against_vllm(vllm, valkey_url, tmp_path):
    serve = ["--engine-url", f"tiny={vllm.url}", "--engine-url", f"tiny-alias={vllm.url}"]
    with kvpf_stack(valkey_url, ["--engine", vllm.url], serve, "e2e-explain") as stack, \
            httpx.Client(timeout=60) as c:
        def explain(body: dict) -> dict:
            r = c.post(stack.predictor_url + "/v1/cache/explain", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        def tokenize(**body) -> list[int]:
            r = c.post(vllm.url + "/tokenize", json={"model": "tiny", **body})
            r.raise_for_status()
            return r.json()["tokens"]

        turns = [{"role": "system", "content": SYSTEM}]
        for i in range(3):
            turns += [{"role": "user", "content": f"Tell me fact number {i} about prefix caches, please."},
                      {"role": "assistant", "content": f"Fact {i}: a cached prefix is not computed again."}]
        full = turns + [{"role": "user", "content": "Thanks. One more?"}]
        c.post(vllm.url + "/v1/chat/completions", json={"model": "tiny", "messages": full, "max_tokens": 1}) \
            .raise_for_status()
        prompt = "The quick brown fox jumps over the lazy dog, again and again, for a long while. " * 3
        prompt = prompt.strip()
        c.post(vllm.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}) \
            .raise_for_status()
        deadline = time.monotonic() + 60
        while explain({"model": "tiny", "prompt": prompt})["predicted_cached_tokens"] == 0:
            assert time.monotonic() < deadline, "the index never caught up"
            time.sleep(0.2)
        while explain({"model": "tiny", "messages": full})["predicted_cached_tokens"] == 0:
            assert time.monotonic() < deadline, "the index never caught up"
            time.sleep(0.2)

        # a clean hit: no finding; the engine's blocks (32) are larger than the request keys' (16)
        doc = explain({"model": "tiny", "messages": full})
        assert doc["findings"] == [] and doc["warnings"] == [], doc["findings"]
        pod = doc["pods"][0]
        n = doc["total_prompt_tokens"]
        assert pod["pod_id"] == vllm.pod_id and pod["engine_block_size"] == 32
        assert pod["reused_tokens"] == doc["predicted_cached_tokens"] == (n - 1) // 32 * 32
        lost = pod["lost_tokens"]
        assert pod["matched_tokens"] - lost["engine_block_rounding"] - lost["last_token_recomputed"] == \
            pod["reused_tokens"]
        print("\nclean hit:", json.dumps(pod))

        tokens = tokenize(prompt=prompt)
        bos = tokens[0]
        # duplicate BOS: the text already starts with the BOS string; decoded by the engine's /detokenize
        doc = explain({"model": "tiny", "prompt": "<|begin_of_text|>" + prompt, "compare": {"prompt": prompt}})
        assert kinds(doc) == ["duplicate_bos"] and doc["decoded_by"] == "engine"
        assert doc["divergence"]["ours"]["token"] == "<|begin_of_text|>" and doc["divergence"]["token_index"] == 1
        print("duplicate_bos:", json.dumps(doc["divergence"]))
        # missing BOS: tokens made without special tokens
        doc = explain({"model": "tiny", "token_ids": tokens[1:], "compare": {"prompt": prompt}})
        assert kinds(doc) == ["missing_bos"] and doc["predicted_cached_tokens"] == 0
        r = c.post(stack.predictor_url + "/v1/cache/predict", json={"model": "tiny", "token_ids": [bos, *tokens]})
        assert [w["kind"] for w in r.json()["warnings"]] == ["duplicate_bos"]
        # whitespace
        doc = explain({"model": "tiny", "prompt": prompt.replace("brown fox", "brown  fox", 1),
                       "compare": {"prompt": prompt}})
        assert kinds(doc) == ["whitespace"]
        # rolling context: the first exchange cut, the system prompt kept
        window = [turns[0], *turns[3:], full[-1]]
        doc = explain({"model": "tiny", "messages": window, "compare": {"messages": full}})
        assert kinds(doc) == ["rolling_context"]
        cut = len(tokenize(messages=full, add_generation_prompt=True)) - \
            len(tokenize(messages=window, add_generation_prompt=True))
        assert doc["divergence"]["tokens_cut"] == cut > 0
        print("rolling_context:", json.dumps(doc["divergence"]))
        # template drift: the client rendered the chat with a template of its own
        tok_dir = tmp_path / "client-template"
        tok_dir.mkdir()
        (tok_dir / "tokenizer.json").write_bytes((tiny_model_dir() / "tokenizer.json").read_bytes())
        config = json.loads((tiny_model_dir() / "tokenizer_config.json").read_text())
        config["chat_template"] = config["chat_template"].replace("<|im_end|>\n", "<|im_end|>\n\n")
        (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
        client_tokens = LocalTokenizer.load(tok_dir).encode_messages(full)
        doc = explain({"model": "tiny", "token_ids": client_tokens, "compare": {"messages": full}})
        assert kinds(doc) == ["template_drift"] and doc["divergence"]["cause"] == "template_drift"
        # the same tokens, asked for under another model name: cached under tiny's root, not this one's
        doc = explain({"model": "tiny-alias", "token_ids": tokens})
        assert kinds(doc) == ["other_model"] and "'tiny'" in doc["findings"][0]["detail"]
        print("other_model:", doc["findings"][0]["detail"])
