"""``kv-preflight index ...`` against a real Valkey and a simulated engine process."""
from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner

from kv_preflight.cli.main import cli
from kv_preflight.index.transfer import held_blocks
from tests.integration.sim import sim_engine

pytestmark = pytest.mark.integration


def run(*args: str, input: str | None = None) -> str:
    result = CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout  # progress lines go to stderr


async def held(pod: str, url: str | None = None) -> dict:
    """A pod's blocks as its state log says: (engine key, tier, group) -> (request keys, copies)."""
    from kv_preflight.index.index import Index

    ix = Index.from_url(url or held.url)
    try:
        return await held_blocks(ix.writer, pod)
    finally:
        await ix.close()


@pytest.fixture(autouse=True)
def _held_url(valkey_url):
    held.url = valkey_url


def complete(url: str, tokens: list[int]) -> int:
    r = httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1}, timeout=10)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture
def engine(tmp_path):
    e = sim_engine("sim-cli", tmp_path).start()
    yield e
    e.stop()


def test_rebuild_inspect_export_import_clear(valkey_url, engine):
    tokens = list(range(500, 600))  # 6 full engine blocks of 16, last token recomputed
    complete(engine.url, tokens)
    complete(engine.url, tokens[:40] + [7] * 30)
    # The index is empty; rebuild re-ingests the engine's whole history from its replay buffer.
    report = json.loads(run("index", "rebuild", "--valkey-url", valkey_url, "--engine", engine.url, "--json"))
    assert report[0]["pod_id"] == "sim-cli" and report[0]["covers_full_history"]
    assert report[0]["blocks"] > 0 and not report[0]["incomplete"]
    stats = json.loads(run("index", "stats", "--valkey-url", valkey_url, "--json"))
    pod = stats["pods"][0]
    assert pod["pod_id"] == "sim-cli" and pod["engine_block_size"] == 16 and pod["blocks"] == report[0]["blocks"]
    assert stats["keys"] > 0 and stats["used_memory_bytes"] > 0

    seen = json.loads(run("index", "inspect", "--valkey-url", valkey_url, "--model", "sim",
                          "--tokens", json.dumps(tokens + [1] * 16), "--json"))
    assert seen["prefix_blocks_per_pod"] == {"sim-cli": 6}
    assert seen["blocks"][5]["holders"][0]["pod_id"] == "sim-cli" and seen["blocks"][6]["holders"] == []
    human = run("index", "inspect", "--valkey-url", valkey_url, "--model", "sim", "--tokens", json.dumps(tokens + [1] * 16))
    assert "breaks at block #6" in human

    # --prompt is tokenized by the engine, then inspected the same way.
    prompt = "inspect me " * 12
    r = httpx.post(engine.url + "/v1/completions", json={"model": "sim", "prompt": prompt, "max_tokens": 1}, timeout=10)
    r.raise_for_status()
    run("index", "rebuild", "--valkey-url", valkey_url, "--engine", engine.url)
    by_prompt = json.loads(run("index", "inspect", "--valkey-url", valkey_url, "--model", "sim", "--prompt", prompt,
                               "--engine-url", engine.url, "--json"))
    n_tokens = r.json()["usage"]["prompt_tokens"]
    assert by_prompt["tokens"] == n_tokens and by_prompt["prefix_blocks_per_pod"] == {"sim-cli": n_tokens // 16}
    pod = json.loads(run("index", "pods", "--valkey-url", valkey_url, "--json"))[0]

    exported = run("index", "export", "--valkey-url", valkey_url)
    rows = [json.loads(line) for line in exported.splitlines() if line.startswith("{")]
    assert rows[0] == {"pod": "sim-cli", "model": "sim", "engine_block_size": 16, "seqs": pod["seq"]}
    assert len(rows) - 1 == pod["blocks"]

    cleared = json.loads(run("index", "clear", "--valkey-url", valkey_url, "--pod", "sim-cli", "--json"))
    assert cleared["blocks_removed"] == pod["blocks"]
    assert json.loads(run("index", "pods", "--valkey-url", valkey_url, "--json"))[0]["blocks"] == 0

    imported = json.loads(run("index", "import", "--valkey-url", valkey_url, "--json", input=exported))
    assert imported["imported_blocks"] == {"sim-cli": pod["blocks"]}
    again = json.loads(run("index", "inspect", "--valkey-url", valkey_url, "--model", "sim",
                           "--tokens", json.dumps(tokens), "--json"))
    assert again["prefix_blocks_per_pod"] == {"sim-cli": 6}


def test_unreachable_valkey_is_one_clear_line():
    result = CliRunner().invoke(cli, ["index", "stats", "--valkey-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert "cannot reach Valkey" in result.output or "Valkey error" in result.output



def test_export_import_keeps_kv_cache_groups(valkey_url):
    """A hybrid model's groups hold one hash each; after export + import each group's eviction
    still finds its own entry."""
    import asyncio

    import redis

    from kv_preflight.index.index import Index, RemoveBlock, StoreBlock, encode_entry, make_entry

    f0, f1 = encode_entry(make_entry("pod-g", "GPU", 0)), encode_entry(make_entry("pod-g", "GPU", 1))

    async def write(seq, muts):
        ix = Index.from_url(valkey_url)
        try:
            await ix.apply_batch(pod_id="pod-g", rank=0, seq=seq, ts=1.0 + seq, model="m", engine_block_size=16,
                                 mutations=muts)
        finally:
            await ix.close()

    asyncio.run(write(0, [StoreBlock(7, "gpu", f0, (70,), 0), StoreBlock(7, "gpu", f1, (70,), 1)]))
    exported = run("index", "export", "--valkey-url", valkey_url)
    run("index", "clear", "--valkey-url", valkey_url, "--pod", "pod-g")
    run("index", "import", "--valkey-url", valkey_url, input=exported)
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    assert sorted(asyncio.run(held("pod-g"))) == [(7, "gpu", 0), (7, "gpu", 1)]
    asyncio.run(write(1, [RemoveBlock(7, "gpu", 0), RemoveBlock(7, "gpu", 1)]))
    assert not r.exists("70", "engine:7")


def test_export_import_keeps_a_hybrid_pods_group_specs(valkey_url):
    """The export's pod line carries the pod's KV cache groups and the import gives them back: imported into an
    empty Valkey, a hybrid pod (full attention beside a 64-token sliding window that lost blocks 1 and 2) is
    answered by vLLM's rule (32 tokens), not as a plain pod whose full-attention chain holds 128 (the import
    once wrote no groups, so the pod was plain until its next BlockStored named them)."""
    import asyncio

    import redis

    from kv_preflight.config import Config
    from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec
    from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry
    from kv_preflight.keys.chain import request_keys
    from kv_preflight.predictor.http.app import create_app

    cfg = Config(valkey_url=valkey_url)
    tokens = list(range(3000, 3128))
    keys = request_keys(tokens, model="tiny", hash_seed=cfg.hash_seed, block_size=cfg.block_size)
    per = 32 // cfg.block_size  # request keys per 32-token engine block
    groups = {0: GroupSpec(FULL, 32), 1: GroupSpec(SLIDING, 32, 64)}
    stores = [StoreBlock(100 + b, "gpu", encode_entry(make_entry("pod-hy", "GPU", g)),
                         tuple(keys[b * per:(b + 1) * per]), g)
              for b in range(4) for g in (0, 1) if g == 0 or b in (0, 3)]

    async def write():
        ix = Index.from_url(valkey_url)
        try:
            await ix.apply_batch(pod_id="pod-hy", rank=0, seq=0, ts=1.0, model="tiny", engine_block_size=32,
                                 mutations=stores, groups=groups)
        finally:
            await ix.close()

    async def predict() -> int:
        app = create_app(Config(valkey_url=valkey_url))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
                r = await c.post("/v1/cache/predict", json={"model": "tiny", "token_ids": tokens + [7],
                                                             "pods": ["pod-hy"]})
                assert r.status_code == 200, r.text
                return r.json()["predicted_cached_tokens"]

    def inspect() -> dict:
        return json.loads(run("index", "inspect", "--valkey-url", valkey_url, "--model", "tiny", "--json",
                              "--tokens", json.dumps(tokens + [7])))

    asyncio.run(write())
    assert asyncio.run(predict()) == 32
    exported = run("index", "export", "--valkey-url", valkey_url)
    head = json.loads(exported.splitlines()[0])
    assert head["groups"] == {"0": ["full_attention", 32, None, None, False],
                              "1": ["sliding_window", 32, 64, None, False]}
    redis.Redis.from_url(valkey_url).flushall()  # an empty Valkey
    run("index", "import", "--valkey-url", valkey_url, "--exact", input=exported)
    seen = inspect()
    assert seen["groups_per_pod"]["pod-hy"] == {"0": "full_attention", "1": "sliding_window"}
    assert seen["prefix_blocks_per_pod"]["pod-hy"] == 8 and seen["cached_tokens_per_pod"]["pod-hy"] == 32
    assert asyncio.run(predict()) == 32


def test_import_cannot_corrupt(valkey_url):
    """Importing twice (or over a live pod) doubled copy counts, and a bad entry was written as is:
    now a pod with entries is refused unless --replace (which clears it first), every record is
    checked before anything is written, seqs are restored, and the pod is flagged until its reset."""
    import asyncio

    import redis

    from kv_preflight.index.index import Index, StoreBlock, encode_entry, make_entry

    f = encode_entry(make_entry("pod-x", "GPU", 0))

    async def write():
        ix = Index.from_url(valkey_url)
        try:
            await ix.apply_batch(pod_id="pod-x", rank=0, seq=0, ts=1.0, model="m", engine_block_size=16,
                                 mutations=[StoreBlock(5, "gpu", f, (50,)), StoreBlock(6, "gpu", f, (60,))])
            await ix.apply_batch(pod_id="pod-x", rank=0, seq=1, ts=2.0, model="m", engine_block_size=16,
                                 mutations=[StoreBlock(6, "gpu", f, (60,))])  # a second copy of 6
        finally:
            await ix.close()

    asyncio.run(write())
    r = redis.Redis.from_url(valkey_url, decode_responses=True)
    before = asyncio.run(held("pod-x"))
    assert before == {(5, "gpu", 0): ((50,), 1), (6, "gpu", 0): ((60,), 2)}
    exported = run("index", "export", "--valkey-url", valkey_url)

    refused = CliRunner().invoke(cli, ["index", "import", "--valkey-url", valkey_url], input=exported)
    assert refused.exit_code != 0 and "already has 2 block(s)" in refused.output
    assert asyncio.run(held("pod-x")) == before

    run("index", "import", "--valkey-url", valkey_url, "--replace", input=exported)
    assert asyncio.run(held("pod-x")) == before  # copies not doubled
    pod = json.loads(run("index", "pods", "--valkey-url", valkey_url, "--json"))[0]
    assert pod["seq"] == {"0": 1} and pod["incomplete"] and "imported" in pod["incomplete_reason"]

    bad = exported.replace(f'"entry": {json.dumps(f)}', '"entry": "x"', 1)
    assert bad != exported
    run("index", "clear", "--valkey-url", valkey_url, "--pod", "pod-x", "--forget")
    rejected = CliRunner().invoke(cli, ["index", "import", "--valkey-url", valkey_url], input=bad)
    assert rejected.exit_code != 0 and "not a PodEntry" in rejected.output and "nothing was imported" in rejected.output
    assert asyncio.run(held("pod-x")) == {} and not r.exists("50", "60")

    run("index", "import", "--valkey-url", valkey_url, "--exact", input=exported)
    assert not json.loads(run("index", "pods", "--valkey-url", valkey_url, "--json"))[0]["incomplete"]
    run("index", "clear", "--valkey-url", valkey_url, "--pod", "pod-x")
    pod = json.loads(run("index", "pods", "--valkey-url", valkey_url, "--json"))[0]
    assert pod["blocks"] == 0 and pod["incomplete"] and "cleared by hand" in pod["incomplete_reason"]
    r.close()


def test_export_import_keeps_a_pods_lora_adapters(valkey_url):
    """The pod line carries the LoRA adapters its events stored blocks of (``kvpf:adapters``) and the import writes
    them back: imported into an empty Valkey, a zero-config predictor still knows the adapter as a model of the
    pod (before, it answered 400 "unknown model" for it until the engine stored another of its blocks)."""
    import asyncio

    import redis

    from kv_preflight.config import Config
    from kv_preflight.index.index import Index, StoreBlock
    from kv_preflight.keys.chain import request_keys
    from kv_preflight.predictor.http.app import create_app

    cfg = Config(valkey_url=valkey_url)
    tokens = list(range(5000, 5064))
    keys = request_keys(tokens, model="sql", hash_seed=cfg.hash_seed, block_size=cfg.block_size)

    async def write():
        ix = Index.from_url(valkey_url)
        try:
            await ix.apply_batch(pod_id="pod-lora", rank=0, seq=0, ts=1.0, model="base", engine_block_size=16,
                                 mutations=[StoreBlock(200 + i, "gpu", ix.entry_field("pod-lora", "GPU", 0), (k,), 0)
                                            for i, k in enumerate(keys)], adapters={"sql"})
        finally:
            await ix.close()

    async def predict() -> httpx.Response:
        app = create_app(Config(valkey_url=valkey_url))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://p") as c:
                return await c.post("/v1/cache/predict", json={"model": "sql", "token_ids": tokens + [7]})

    asyncio.run(write())
    before = asyncio.run(predict())
    assert before.status_code == 200 and before.json()["predicted_cached_tokens"] == 64, before.text
    exported = run("index", "export", "--valkey-url", valkey_url)
    assert json.loads(exported.splitlines()[0])["adapters"] == ["sql"]
    redis.Redis.from_url(valkey_url).flushall()  # an empty Valkey
    run("index", "import", "--valkey-url", valkey_url, "--exact", input=exported)
    after = asyncio.run(predict())
    assert after.status_code == 200 and after.json()["predicted_cached_tokens"] == 64, after.text
    bad = exported.replace('"adapters": ["sql"]', '"adapters": ["a\\tb"]', 1)
    refused = CliRunner().invoke(cli, ["index", "import", "--valkey-url", valkey_url, "--replace"], input=bad)
    assert refused.exit_code != 0 and "adapters must be a list" in refused.output, refused.output
