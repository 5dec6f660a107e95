"""``POST /v1/cache/explain`` and the ``warnings`` of predict/route, against a real valkey-server, a real
(small, trained) tokenizer with its chat template, and the simulator as the engine: each finding kind
from a constructed case, none on a clean hit."""
from __future__ import annotations

import unicodedata
from contextlib import asynccontextmanager

import httpx
import pytest

from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.tokens.local import LocalTokenizer
from kv_preflight.config import Config
from tests.integration.http_engine import HttpEngine
from tests.integration.sim import sim_engine
from tests.integration.test_predictor import IndexWriter
from tests.tokenizer_files import BOS, CHATML, write_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

M = "tok-model"
C = 16
SYSTEM = "You are a helpful assistant. " * 4
PROMPT = ("A prefix cache keeps the KV blocks of earlier prompts so a shared prefix is not computed again. " * 3).strip()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return LocalTokenizer.load(tok_dir)


@pytest.fixture
def writer(ix):
    return IndexWriter(ix)


@asynccontextmanager
async def running(cfg: Config):
    app = create_app(cfg)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as client:
            yield client


def cfg_for(valkey_url, tok_dir, **kw) -> Config:
    return Config(valkey_url=valkey_url, block_size=C, tokenizers={M: str(tok_dir)}, **kw)


async def explain(client, body) -> dict:
    r = await client.post("/v1/cache/explain", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def kinds(doc: dict) -> list[str]:
    return [f["kind"] for f in doc["findings"]]


async def test_a_clean_hit_has_no_finding_and_says_what_the_engine_drops(valkey_url, tok, tok_dir, writer):
    tokens = tok.encode_prompt(PROMPT)
    n = len(tokens)
    await writer.store("pod-a", tokens, engine_block=32, model=M)  # engine blocks of 32 over request keys of 16
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "prompt": PROMPT})
        assert doc["findings"] == [] and doc["warnings"] == [] and doc["divergence"] is None
        pod = doc["pods"][0]
        assert pod["pod_id"] == "pod-a" and pod["model"] == M
        whole32 = n // 32 * 32
        assert pod["stop_block"] == whole32 // C and pod["stop_token"] == whole32
        expected = min(whole32, (n - 1) // 32 * 32)
        assert pod["reused_tokens"] == expected == doc["predicted_cached_tokens"]
        lost = pod["lost_tokens"]
        assert lost["engine_block_rounding"] == 0
        assert lost["last_token_recomputed"] == whole32 - expected
        # the stored chain ends at the last whole 32-token block; the tail after it was never stored
        assert lost["partial_last_block"] == (n - n // C * C if whole32 // C >= n // C else 0)
        # the same prompt as the comparison: no divergence, no finding
        doc = await explain(client, {"model": M, "prompt": PROMPT, "compare": {"prompt": PROMPT}})
        assert doc["findings"] == [] and doc["divergence"] is None
        # predict and route always carry warnings, empty here
        for path in ("/v1/cache/predict", "/v1/cache/route"):
            r = await client.post(path, json={"model": M, "token_ids": tokens})
            assert r.status_code == 200 and r.json()["warnings"] == [], r.text


async def test_a_pod_the_filter_names_is_listed_even_before_the_index_has_seen_it(valkey_url, tok, tok_dir,
                                                                                     writer):
    """Each pod the pods filter names gets its chain, one holding nothing included, though the index has never
    listed it under the model (a pod whose first blocks are still on their way, as in `up --demo`)."""
    tokens = list(range(300, 300 + 64))
    await writer.store("pod-held", tokens, engine_block=16, model=M)
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "token_ids": tokens, "pods": ["pod-held", "pod-new"]})
        chains = {p["pod_id"]: p for p in doc["pods"]}
        assert set(chains) == {"pod-held", "pod-new"}
        assert (chains["pod-new"]["stop_block"], chains["pod-new"]["reused_tokens"]) == (0, 0)
        assert chains["pod-held"]["stop_block"] == 4


async def test_lost_tokens_by_rule(valkey_url, tok, tok_dir, writer):
    tokens = list(range(5, 5 + 100))  # 100 tokens: 6 request-key blocks of 16, a tail of 4
    await writer.store("pod-b", tokens, engine_block=16, model=M)
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "token_ids": tokens[:96]})  # every block held, no tail
        pod = doc["pods"][0]
        assert (pod["stop_block"], pod["reused_tokens"]) == (6, 80)
        assert pod["lost_tokens"] == {"engine_block_rounding": 0, "last_token_recomputed": 16,
                                      "partial_last_block": 0}
        doc = await explain(client, {"model": M, "token_ids": tokens})
        pod = doc["pods"][0]
        assert (pod["stop_block"], pod["reused_tokens"]) == (6, 96)
        assert pod["lost_tokens"] == {"engine_block_rounding": 0, "last_token_recomputed": 0,
                                      "partial_last_block": 4}


async def test_duplicate_bos_in_a_prompt_and_in_token_ids(valkey_url, tok, tok_dir, writer):
    bos = tok.tokenizer.token_to_id(BOS)
    tokens = tok.encode_prompt(PROMPT)
    await writer.store("pod-a", tokens, model=M)
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "prompt": BOS + PROMPT, "compare": {"prompt": PROMPT}})
        assert kinds(doc) == ["duplicate_bos"] and doc["findings"][0]["token_index"] == 1
        div = doc["divergence"]
        assert div["cause"] == "duplicate_bos" and div["token_index"] == 1 and div["block_index"] == 0
        assert div["ours"]["token"] == BOS and div["ours"]["token_id"] == bos and div["ours"]["before"] == BOS
        assert div["theirs"]["token_id"] == tokens[1] and div["theirs"]["after"].startswith(tok.token_text(tokens[2]))
        assert doc["decoded_by"] == "local"
        r = await client.post("/v1/cache/predict", json={"model": M, "token_ids": [bos, *tokens]})
        assert [w["kind"] for w in r.json()["warnings"]] == ["duplicate_bos"]
        r = await client.post("/v1/cache/route", json={"model": M, "prompt": BOS + PROMPT})
        assert [w["kind"] for w in r.json()["warnings"]] == ["duplicate_bos"]


async def test_missing_bos(valkey_url, tok, tok_dir, writer):
    tokens = tok.encode_prompt(PROMPT)
    await writer.store("pod-a", tokens, model=M)
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "token_ids": tokens[1:], "compare": {"prompt": PROMPT}})
        assert kinds(doc) == ["missing_bos"]
        assert doc["divergence"]["cause"] == "missing_bos" and doc["divergence"]["token_index"] == 0
        assert doc["predicted_cached_tokens"] == 0
        r = await client.post("/v1/cache/predict", json={"model": M, "token_ids": tokens[1:]})  # the fast path
        assert [(w["kind"], w["token_index"]) for w in r.json()["warnings"]] == [("missing_bos", 0)]


async def test_whitespace_and_unicode(valkey_url, tok, tok_dir):
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        spaced = PROMPT.replace("prefix cache", "prefix  cache", 1)
        doc = await explain(client, {"model": M, "prompt": spaced, "compare": {"prompt": PROMPT}})
        assert kinds(doc) == ["whitespace"] and doc["divergence"]["cause"] == "whitespace"
        doc = await explain(client, {"model": M, "prompt": PROMPT + "  "})  # no compare: from the text
        assert kinds(doc) == ["whitespace"]
        text = "naïve café " + PROMPT
        nfd = unicodedata.normalize("NFD", text)
        doc = await explain(client, {"model": M, "prompt": nfd, "compare": {"prompt": text}})
        assert doc["divergence"]["cause"] == "unicode_normalization"
        assert "unicode_normalization" in kinds(doc)
        # a different text is a content change, not a tokenizer quirk
        doc = await explain(client, {"model": M, "prompt": PROMPT.replace("prefix", "suffix"),
                                     "compare": {"prompt": PROMPT}})
        assert kinds(doc) == ["content_changed"]


async def test_rolling_context_counts_the_cut(valkey_url, tok, tok_dir, writer):
    turns = [{"role": "system", "content": SYSTEM}]
    for i in range(4):
        turns += [{"role": "user", "content": f"Question number {i}: the quick brown fox?"},
                  {"role": "assistant", "content": f"Answer {i}: it jumps over the lazy dog."}]
    full = turns + [{"role": "user", "content": "And now?"}]
    window = [turns[0]] + turns[3:] + [{"role": "user", "content": "And now?"}]  # first exchange dropped
    ours, theirs = tok.encode_messages(window), tok.encode_messages(full)
    cut = len(theirs) - len(ours)
    await writer.store("pod-a", theirs, model=M)
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "messages": window, "compare": {"messages": full}})
        assert kinds(doc) == ["rolling_context"]
        div = doc["divergence"]
        assert div["cause"] == "rolling_context" and div["tokens_cut"] == cut
        around = {side: div[side]["before"] + div[side]["token"] + div[side]["after"] for side in ("ours", "theirs")}
        assert "number 1" in around["ours"] and "number 0" in around["theirs"], around
        # the front cut with the BOS kept, as token ids
        bos = tok.encode_prompt("x")[0]
        plain = tok.encode_prompt(PROMPT)
        doc = await explain(client, {"model": M, "token_ids": [bos, *plain[20:]], "compare": {"token_ids": plain}})
        assert doc["divergence"]["cause"] == "rolling_context" and doc["divergence"]["tokens_cut"] == 19
        # and without it
        doc = await explain(client, {"model": M, "token_ids": plain[20:], "compare": {"token_ids": plain}})
        assert doc["divergence"]["cause"] == "rolling_context" and doc["divergence"]["tokens_cut"] == 20


async def test_template_drift_from_the_start_up_check_and_from_a_client_template(valkey_url, tok, tok_dir, tmp_path):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there!"}]

    def engine_tokenize(body: dict) -> list[int]:  # the engine's template puts a blank line after each message
        if "messages" in body:
            return tok.tokenizer.encode(tok.render_chat(body["messages"]).replace("<|im_end|>\n", "<|im_end|>\n\n"),
                                        add_special_tokens=False).ids
        return tok.encode_prompt(body["prompt"])

    eng = HttpEngine("pod-t", [M], tokenize_fn=engine_tokenize).start()
    try:
        cfg = cfg_for(valkey_url, tok_dir, engine_urls={M: eng.url})
        async with running(cfg) as client:
            status = (await client.get("/stats")).json()["tokenization"][M]
            assert status["check"] == "failed"
            r = await client.post("/v1/cache/predict", json={"model": M, "messages": msgs})
            assert [w["kind"] for w in r.json()["warnings"]] == ["template_drift"]
            # the client rendered the chat itself with the HF template: its tokens vs the engine's rendering
            client_tokens = tok.encode_messages(msgs)
            doc = await explain(client, {"model": M, "token_ids": client_tokens, "compare": {"messages": msgs}})
            assert doc["divergence"]["cause"] == "template_drift"
            assert "template_drift" in kinds(doc)
    finally:
        eng.stop()
    # a template that renders today's date drifts every day
    dated = write_tokenizer(tmp_path / "dated", chat_template=CHATML.replace(
        "{{ bos_token }}", "{{ bos_token }}Today is {{ strftime_now('%Y-%m-%d') }}. "))
    async with running(Config(valkey_url=valkey_url, block_size=C, tokenizers={M: str(dated)})) as client:
        r = await client.post("/v1/cache/route", json={"model": M, "messages": msgs})
        assert [w["kind"] for w in r.json()["warnings"]] == ["template_drift"]
        r = await client.post("/v1/cache/predict", json={"model": M, "prompt": "plain prompt"})
        assert r.json()["warnings"] == []


async def test_other_model_when_the_tokens_sit_under_an_adapter(valkey_url, tok, tok_dir, writer):
    tokens = tok.encode_prompt(PROMPT)
    await writer.store("pod-lora", tokens, model="my-lora")
    async with running(cfg_for(valkey_url, tok_dir)) as client:
        doc = await explain(client, {"model": M, "prompt": PROMPT})
        assert kinds(doc) == ["other_model"]
        assert "my-lora" in doc["findings"][0]["detail"] and "pod-lora" in doc["findings"][0]["detail"]
        assert doc["predicted_cached_tokens"] == 0


async def test_explain_validates_like_predict(valkey_url, tok_dir):
    async with running(cfg_for(valkey_url, tok_dir, max_tokens=64)) as client:
        for body, needle in [
            ({"model": M}, "give one of token_ids, prompt, messages"),
            ({"model": M, "prompt": "x", "pod": ["a"]}, "did you mean 'pods'"),
            ({"model": M, "token_ids": list(range(65))}, "too many tokens"),
            ({"model": M, "prompt": "x", "compare": {"prompt": "y", "model": "z"}}, "compare: unknown field 'model'"),
            ({"model": M, "prompt": "x", "compare": {}}, "compare: give one of"),
            ({"model": M, "prompt": "x", "compare": {"token_ids": [-1]}}, "compare: token_ids must be"),
            ({"model": M, "prompt": "x", "compare": "y"}, "compare must be an object"),
        ]:
            r = await client.post("/v1/cache/explain", json=body)
            assert r.status_code == 400 and needle in r.json()["error"], (body, r.text)
        r = await client.post("/v1/cache/explain", content=b"[" * 5000)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
        doc = (await client.get("/openapi.json")).json()
        assert "/v1/cache/explain" in doc["paths"] and "ExplainRequest" in doc["components"]["schemas"]


async def test_engine_tokenized_model_learns_bos_and_decodes_with_the_simulator(valkey_url, tmp_path):
    sim = sim_engine("pod-sim", tmp_path).start()
    try:
        cfg = Config(valkey_url=valkey_url, block_size=C, engine_urls={"sim": sim.url})
        async with running(cfg) as client:
            prompt = ("hello world, this is the simulator's byte tokenizer at work " * 2).strip()
            tokens = httpx.post(sim.url + "/tokenize", json={"model": "sim", "prompt": prompt}).json()["tokens"]
            doc = await explain(client, {"model": "sim", "token_ids": [0, *tokens], "compare": {"prompt": prompt}})
            assert doc["decoded_by"] == "engine"
            assert kinds(doc) == ["duplicate_bos"]
            assert doc["divergence"]["ours"]["token"] == "<|begin_of_text|>"
            # learnt once, the BOS now warns on the hot path too
            r = await client.post("/v1/cache/predict", json={"model": "sim", "token_ids": [0, 0, 5, 6]})
            assert [w["kind"] for w in r.json()["warnings"]] == ["duplicate_bos"]
    finally:
        sim.stop()
