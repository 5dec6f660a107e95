"""Rows ``http`` and ``scaling``: POST /v1/cache/predict on ``kv-preflight serve --workers 2`` beside the
baseline server (cli/bench/baseline.py), latency at 4K and 32K tokens, throughput at concurrency 32, and (scaling)
latency against prompt length and pod count."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from kv_preflight.cli.bench.measure import valkey_cpu
from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.bench.prompts import PromptSet, load_set, run_load
from kv_preflight.cli.bench.results import Results, fmt_us, without_answers
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.index.index import Index


def bench_http(res: Results, vk: ValkeyServer, quick: bool, tmp: Path, do_scaling: bool) -> None:
    print("predictor over HTTP (kv-preflight serve --workers 2 vs the baseline server)", flush=True)
    index = Index.from_url(vk.url, timeout_s=30.0)

    async def load_all() -> dict[str, PromptSet]:
        sets = {
            "len4k": await load_set(index, "len4k", n_prompts=64, length=4096, n_pods=4, seed=11),
            "len32k": await load_set(index, "len32k", n_prompts=16, length=32768, n_pods=4, seed=12),
        }
        if do_scaling:
            for n in (1024, 2048, 8192, 16384):
                sets[f"len{n // 1024}k"] = await load_set(index, f"len{n // 1024}k", n_prompts=16, length=n, n_pods=4,
                                                          seed=20 + n // 1024)
            for p in (1, 2, 8, 16, 32, 64):
                sets[f"pods{p}"] = await load_set(index, f"pods{p}", n_prompts=16, length=4096, n_pods=p, seed=40 + p)
        await index.close()
        return sets

    t = time.perf_counter()
    sets = asyncio.run(load_all())
    print(f"  loaded {len(sets)} prompt sets ({time.perf_counter() - t:.1f}s); "
          f"{redis.Redis.from_url(vk.url).dbsize()} keys in Valkey", flush=True)
    r = redis.Redis.from_url(vk.url)
    figures: dict[str, dict[str, dict]] = {"ours": {}, "baseline": {}}
    n_lat4 = 600 if quick else 3000
    n_lat32 = 150 if quick else 600
    thr_s = 3.0 if quick else 6.0
    for which in ("ours", "baseline"):
        port = free_port()
        if which == "ours":
            args = [python(), "-m", "kv_preflight", "serve", "--valkey-url", vk.url, "--port", str(port), "--workers", "2"]
        else:
            args = [python(), "-m", "kv_preflight.cli.bench.baseline", "--valkey-url", vk.url, "--port", str(port), "--workers", "2"]
        srv = Server(args, port, tmp / f"{which}.log").ready()
        try:
            f = figures[which]
            scale = 1 if which == "ours" else 12
            f["lat4k"] = run_load(port, sets["len4k"], tmp, requests=n_lat4 // scale, warmup=50 // scale + 5)
            f["lat32k"] = run_load(port, sets["len32k"], tmp, requests=max(30, n_lat32 // (scale * 2)), warmup=5)
            cpu0, vcpu0 = srv.cpu(), valkey_cpu(r)
            f["thr"] = run_load(port, sets["len4k"], tmp, concurrency=32, duration_s=thr_s, warmup=200 // scale)
            f["thr"]["server_cpu_s"] = srv.cpu() - cpu0
            f["thr"]["valkey_cpu_s"] = valkey_cpu(r) - vcpu0
            if do_scaling:
                for name, ps in sets.items():
                    if name in ("len4k", "len32k"):
                        continue
                    n = 300 if which == "ours" else 25
                    f[name] = run_load(port, ps, tmp, requests=n if not quick else n // 3 + 5, warmup=5)
        finally:
            srv.stop()
        print(f"  {which}: done", flush=True)
    o, b = figures["ours"], figures["baseline"]
    res.add("POST /v1/cache/predict, 4K tokens, 4 pods, concurrency 1",
            f"p50 {fmt_us(o['lat4k']['p50_us'])}, p99 {fmt_us(o['lat4k']['p99_us'])}", "p50 <= 2 ms, p99 <= 6 ms",
            f"p50 {fmt_us(b['lat4k']['p50_us'])}, p99 {fmt_us(b['lat4k']['p99_us'])}",
            b["lat4k"]["p50_us"] / o["lat4k"]["p50_us"],
            o["lat4k"]["p50_us"] <= 2000 and o["lat4k"]["p99_us"] <= 6000, ours_run=without_answers(o["lat4k"]), baseline_run=without_answers(b["lat4k"]))
    res.add("POST /v1/cache/predict, 32K tokens, 4 pods, concurrency 1",
            f"p50 {fmt_us(o['lat32k']['p50_us'])}, p99 {fmt_us(o['lat32k']['p99_us'])}", "p50 <= 5 ms",
            f"p50 {fmt_us(b['lat32k']['p50_us'])}", b["lat32k"]["p50_us"] / o["lat32k"]["p50_us"],
            o["lat32k"]["p50_us"] <= 5000, ours_run=without_answers(o["lat32k"]), baseline_run=without_answers(b["lat32k"]))
    ot, bt = o["thr"], b["thr"]
    per = 1e6 / ot["rps"] if ot["rps"] else 0
    res.add("predictor throughput, 4K tokens, concurrency 32, --workers 2",
            f"{ot['rps']:,.0f} predictions/s (p50 {fmt_us(ot['p50_us'])}, p99 {fmt_us(ot['p99_us'])})",
            ">= 2,000 predictions/s", f"{bt['rps']:,.0f} predictions/s", ot["rps"] / bt["rps"], ot["rps"] >= 2000,
            ours_run=without_answers(ot), baseline_run=without_answers(bt),
            cpu_us_per_prediction={
                "predictor": ot["server_cpu_s"] / ot["requests"] * 1e6,
                "valkey": ot["valkey_cpu_s"] / ot["requests"] * 1e6,
                "client": ot["client_cpu_s"] / ot["requests"] * 1e6,
                "wall_per_prediction_us_on_2_cores": per * 2,
            })
    if do_scaling:
        res.extra["scaling_length"] = [
            {"tokens": n, "ours": without_answers(o[f"len{n // 1024}k"] if n not in (4096, 32768) else o["lat4k" if n == 4096 else "lat32k"]),
             "baseline": without_answers(b[f"len{n // 1024}k"] if n not in (4096, 32768) else b["lat4k" if n == 4096 else "lat32k"])}
            for n in (1024, 2048, 4096, 8192, 16384, 32768)
        ]
        res.extra["scaling_pods"] = [
            {"pods": p, "ours": without_answers(o["lat4k"] if p == 4 else o[f"pods{p}"]),
             "baseline": without_answers(b["lat4k"] if p == 4 else b[f"pods{p}"])}
            for p in (1, 2, 4, 8, 16, 32, 64)
        ]
        print("  latency vs prompt length (4 pods), p50 / p99:")
        for e in res.extra["scaling_length"]:
            print(f"    {e['tokens']:6d} tokens: ours {fmt_us(e['ours']['p50_us'])} / {fmt_us(e['ours']['p99_us'])}; "
                  f"baseline {fmt_us(e['baseline']['p50_us'])}")
        print("  latency vs pods (4K tokens), p50 / p99:")
        for e in res.extra["scaling_pods"]:
            print(f"    {e['pods']:3d} pods: ours {fmt_us(e['ours']['p50_us'])} / {fmt_us(e['ours']['p99_us'])}; "
                  f"baseline {fmt_us(e['baseline']['p50_us'])}")

