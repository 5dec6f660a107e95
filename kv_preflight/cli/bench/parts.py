"""Where one prediction of a prompt a whole fleet holds spends its time, part by part, in process.

    python -m kv_preflight.cli.bench.parts [--pods 1000] [--repeat 200]

The fleet rows of ``kv_preflight.cli.bench`` time a prediction end to end over HTTP; this splits one into
its parts (parsing the request, the lookup with Valkey's script, the pods' metadata from the cache,
scoring with the per-pod loop in C and in Python, encoding the answer), so a change to one part can be
measured alone. It starts its own valkey-server on a free loopback port, loads one 4K-token prompt held by
``--pods`` pods at different lengths (the fleet row's data), prints each part's median of five runs in
µs and Valkey's time per lookup script (INFO commandstats), then stops the server.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import redis

from kv_preflight.cli.bench.prompts import load_set
from kv_preflight.cli.valkey_server import ValkeyServer
from kv_preflight.predictor.scoring import score as scoring
from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.request import parse_keyed
from kv_preflight.config import Config
from kv_preflight.index.index import Index


async def _median_us(fn: Callable[[], Awaitable[object] | object], repeat: int) -> float:
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeat):
            r = fn()
            if asyncio.iscoroutine(r):
                await r
        runs.append((time.perf_counter() - t) / repeat * 1e6)
    return statistics.median(runs)


async def measure(url: str, pods: int, repeat: int) -> dict[str, float]:
    async with Index.from_url(url, timeout_s=30.0) as index:
        prompts = await load_set(index, f"parts{pods}", n_prompts=1, length=4096, n_pods=pods, seed=90 + pods)
    cfg = Config(valkey_url=url, block_size=16)
    app = create_app(cfg)
    predictor = app.state.predictor
    body = prompts.bodies[0]

    def parse():
        return parse_keyed(body, max_tokens=cfg.max_tokens, hash_seed=cfg.hash_seed, block_size=cfg.block_size,
                           max_pods=cfg.max_pods_filter)

    req = parse()
    try:
        found = await predictor.index.lookup_detailed(req.keys, None, mode=cfg.lookup)
        infos = await predictor.metadata.pod_infos(m.pod_id for m in found.matches)
        ttft = predictor.ttft.for_model(req.model)
        estimate = ttft.estimates_for(req.n_tokens)
        prediction = scoring.score(found.matches, prompt_len=req.n_tokens, canonical_block=16, infos=infos, ttft=ttft)
        encoder = msgspec.json.Encoder()
        vk = redis.Redis.from_url(url)
        vk.config_resetstat()
        parts = {
            "parse the request": await _median_us(parse, repeat),
            "lookup (Valkey's script and the walk)": await _median_us(
                lambda: predictor.index.lookup_detailed(req.keys, None, mode=cfg.lookup), repeat),
        }
        parts["  of which Valkey's script (commandstats)"] = vk.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
        parts.update({
            "pods' metadata (cache)": await _median_us(
                lambda: predictor.metadata.pod_infos(m.pod_id for m in found.matches), repeat),
            "per-pod loop, C": await _median_us(lambda: scoring._c_affinities(
                found.matches, req.n_tokens, 16, infos, None, estimate, scoring.PodAffinity), repeat),
            "per-pod loop, Python": await _median_us(lambda: scoring._affinities(
                found.matches, req.n_tokens, 16, None, (), None, estimate, infos), repeat),
            "scoring (loop and sort)": await _median_us(lambda: scoring.score(
                found.matches, prompt_len=req.n_tokens, canonical_block=16, infos=infos, ttft=ttft), repeat),
            "encoding the answer": await _median_us(lambda: encoder.encode(prediction), repeat),
            "whole prediction": await _median_us(lambda: predictor.predict_keyed(req), repeat),
        })
        parts["pods answered"] = len(prediction.pod_affinities)
        vk.close()
        return parts
    finally:
        await predictor.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=1000, help="pods holding the prompt, each at its own length")
    ap.add_argument("--repeat", type=int, default=200, help="calls per timed run (five runs, the median shown)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpf-parts-") as tmp:
        vk = ValkeyServer(Path(tmp) / "valkey", appendonly=False).start()
        try:
            parts = asyncio.run(measure(vk.url, a.pods, a.repeat))
        finally:
            vk.stop()
    print(f"one prediction of a 4K-token prompt {a.pods:,} pods hold, in process (median of 5 x {a.repeat}):")
    for name, value in parts.items():
        print(f"  {name:42s} {value:>10,.0f}" + ("" if name == "pods answered" else " us"))


if __name__ == "__main__":
    main()
