"""Part of row ``fleet``: a hybrid fleet's predictions beside a plain fleet's, in the same run, on the same
predictor (issue 24: a hybrid fleet's p50 within 2x of the plain one's).

1,000 pods hold a 4K-token prompt at different lengths. Plain pods hold one KV cache group; hybrid pods hold
two, as vLLM's hybrid KV cache manager leaves a model with sliding-window layers beside full-attention ones
(gpt-oss: window 128): the full-attention group every block of their prefix, the window group only the
``ceil((window - 1) / block)`` blocks ending where a request stopped (vLLM 0.32's default retention), for a
third of the pods at an earlier boundary than their full-attention prefix, so the window rule cuts their hit.
Every answer's tokens and pod are checked against vLLM's rule (engines/hit_rules.py) over what was loaded.
"""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import redis

from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.bench.prompts import C, E, MODEL, PromptSet, load_set, run_load
from kv_preflight.cli.bench.results import fmt_us
from kv_preflight.cli.bench.workload import tokens
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec, longest_hit
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.index import Index, StoreBlock
from kv_preflight.keys.chain import request_keys

WINDOW = 128  # gpt-oss's sliding window, in tokens
SW, FA = 0, 1  # vLLM numbers the groups in layer order; gpt-oss's first layer is a sliding-window one
PODS = 1000
LENGTH = 4096


def groups(engine_block: int) -> dict[int, GroupSpec]:
    return {SW: GroupSpec(kind=SLIDING, block_size=engine_block, sliding_window=WINDOW),
            FA: GroupSpec(kind=FULL, block_size=engine_block)}


async def load_hybrid_set(index: Index, name: str, *, model: str, canonical: int, engine_block: int,
                          n_prompts: int, length: int, n_pods: int, seed: int) -> Any:
    """Like ``load_set`` (each pod holds its own share of each prompt), with two KV cache groups per pod."""
    rng = random.Random(seed)
    spec = groups(engine_block)
    need = -(-(WINDOW - 1) // engine_block)
    per = engine_block // canonical
    pods = [f"{name}-pod-{i}" for i in range(n_pods)]
    bodies, expected = [], []
    for p in range(n_prompts):
        toks = tokens(length, seed * 1000 + p)
        keys = request_keys(toks, model=model)
        n_engine = len(keys) // per
        boundary = (length - 1) // engine_block  # where a resend of the whole prompt stops (the last token)
        best: tuple[int, str] | None = None
        for i, pod in enumerate(pods):
            f = min(1.0, max(0.02, (i + 1) / n_pods + rng.uniform(-0.04, 0.04)))
            nb = max(1, int(round(n_engine * f)))
            end = min(nb, boundary)
            if i % 3 == 0:
                end = max(1, end // 2)  # the window blocks at the prefix's end evicted; an earlier tail kept
            window_blocks = set(range(max(0, end - need), end))
            held = {FA: set(range(nb)), SW: window_blocks}
            stores = []
            for g, field in ((SW, index.entry_field(pod, "GPU", SW)), (FA, index.entry_field(pod, "GPU", FA))):
                for j in sorted(held[g]):
                    stores.append(StoreBlock(keys[per * j + per - 1] ^ 0x5EED, "gpu", field,
                                             tuple(keys[per * j: per * (j + 1)]), group=g,
                                             parent=keys[per * j - 1] if j else CHAIN_ROOT))
            for s in range(0, len(stores), 512):
                await index.apply_batch(pod_id=pod, rank=0, seq=0, ts=0.0, model=model, engine_block_size=engine_block,
                                        mutations=stores[s:s + 512], mode="import", groups=spec)
            hit = longest_hit(spec, lambda g, b: b in held[g], length, engine_block)
            if best is None or (-hit, pod) < (-best[0], best[1]):
                best = (hit, pod)
        bodies.append(json.dumps({"model": model, "token_ids": toks}, separators=(",", ":")).encode())
        expected.append(best)
    return PromptSet(name, bodies, expected)


def bench_hybrid_fleet(res: Any, vk: ValkeyServer, quick: bool, tmp: Path) -> None:
    """Both fleets on the single node, one ``serve --workers 2``, rounds alternating plain and hybrid so the
    machine's moment weighs on both alike; the row is the ratio of their median p50s."""
    print(f"hybrid fleet beside the plain one: 4K tokens held by {PODS:,} pods, two KV cache groups "
          f"(sliding window {WINDOW}) vs one", flush=True)
    redis.Redis(port=vk.port).flushall()

    async def load() -> tuple[Any, Any]:
        async with Index.from_url(vk.url, timeout_s=30.0) as index:
            plain = await load_set(index, "plainfleet", n_prompts=2, length=LENGTH, n_pods=PODS, seed=290)
            hybrid = await load_hybrid_set(index, "hybridfleet", model=MODEL, canonical=C, engine_block=E,
                                           n_prompts=2, length=LENGTH, n_pods=PODS, seed=291)
            return plain, hybrid

    t = time.perf_counter()
    plain, hybrid = asyncio.run(load())
    print(f"  loaded {PODS:,} plain and {PODS:,} hybrid pods ({time.perf_counter() - t:.0f}s)", flush=True)
    port = free_port()
    srv = Server([python(), "-m", "kv_preflight", "serve", "--valkey-url", vk.url, "--port", str(port),
                  "--workers", "2"], port, tmp / "serve-fleet-hybrid.log").ready()
    runs: dict[str, list[dict]] = {"plain": [], "hybrid": []}
    try:
        for _ in range(3):
            for which, ps in (("plain", plain), ("hybrid", hybrid)):
                runs[which].append(run_load(port, ps, tmp, requests=40 if quick else 150, warmup=10))
    finally:
        srv.stop()
    p50 = {k: statistics.median(r["p50_us"] for r in v) for k, v in runs.items()}
    p99 = {k: statistics.median(r["p99_us"] for r in v) for k, v in runs.items()}
    ratio = p50["hybrid"] / p50["plain"]
    res.add(f"fleet-wide prefix, hybrid vs plain, single, 4K tokens, {PODS:,} pods",
            f"hybrid p50 {fmt_us(p50['hybrid'])} (p99 {fmt_us(p99['hybrid'])}), plain p50 {fmt_us(p50['plain'])} "
            f"(p99 {fmt_us(p99['plain'])}), side by side: hybrid/plain x{ratio:.2f}",
            "hybrid p50 <= 2x plain p50", "", None, ratio <= 2.0,
            pods=PODS, topology="single", p50_ratio=ratio, p50_us=p50, p99_us=p99,
            runs={k: [{f: r[f] for f in ("p50_us", "p99_us", "requests")} for r in v] for k, v in runs.items()})
