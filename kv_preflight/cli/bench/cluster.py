"""Row ``cluster``: the same ingestion stream and predictions on a local Valkey Cluster beside the single node."""
from __future__ import annotations

import asyncio
from pathlib import Path

import redis

from kv_preflight.cli.bench.ingest import ingest_in_process
from kv_preflight.cli.bench.measure import valkey_cpu
from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.bench.prompts import PromptSet, load_set, run_load
from kv_preflight.cli.bench.results import Results, fmt_us, without_answers
from kv_preflight.cli.bench.workload import event_stream
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.index.index import Index


def _cluster_cpu(cluster) -> dict[int, float]:
    """Valkey CPU seconds used so far, per master port."""
    return {m.port: valkey_cpu(redis.Redis(port=m.port)) for m in cluster.masters_now()}


def bench_cluster(res: Results, vk: ValkeyServer, quick: bool, tmp: Path) -> None:
    """The same ingestion stream and predictions on a local Valkey Cluster (3 masters + 3 replicas) and on
    the single node, in one run: blocks/s, Valkey CPU per block on each shard and their balance, and
    predict p50/p99 at 4K and 32K tokens. (This 2-core machine cannot show a scaling curve: per-shard
    cost and balance are what predict one.)"""
    from kv_preflight.cli.valkey_cluster import ValkeyCluster

    print("Valkey Cluster (3 masters + 3 replicas on this machine) beside the single node", flush=True)
    stream = event_stream(pods=4, target_blocks=20_000 if quick else 60_000)
    blocks = stream.stored_blocks + stream.removed_blocks
    r = redis.Redis.from_url(vk.url)
    r.flushall()
    cpu0 = valkey_cpu(r)
    single_t, _ = asyncio.run(ingest_in_process(vk.url, stream.frames))
    single_cpu = valkey_cpu(r) - cpu0
    cluster = ValkeyCluster(tmp / "cluster", appendonly=False).start()
    try:
        c0 = _cluster_cpu(cluster)
        cluster_t, _ = asyncio.run(ingest_in_process(cluster.url, stream.frames))
        c1 = _cluster_cpu(cluster)
        per_shard = {p: (c1[p] - c0.get(p, 0.0)) / blocks * 1e6 for p in c1}
        keys = {m.port: redis.Redis(port=m.port).dbsize() for m in cluster.masters_now()}
        balance = max(keys.values()) / max(1, min(keys.values()))
        res.add("ingestion on a cluster, in process (same stream, same run)",
                f"{blocks / cluster_t:,.0f} blocks/s; Valkey CPU per block by shard: "
                + ", ".join(f"{v:.1f} us" for v in per_shard.values()),
                "measured (the single node beside it)", f"{blocks / single_t:,.0f} blocks/s single node, "
                f"{single_cpu / blocks * 1e6:.1f} us Valkey CPU per block",
                (blocks / cluster_t) / (blocks / single_t), None,
                valkey_cpu_us_per_block_by_shard=per_shard, keys_by_shard=keys, key_balance_max_over_min=balance)
        print(f"  keys per shard {list(keys.values())} (max/min {balance:.2f})", flush=True)
        index = Index.from_url(cluster.url, timeout_s=30.0)

        async def load() -> dict[str, PromptSet]:
            out = {"len4k": await load_set(index, "c4k", n_prompts=32, length=4096, n_pods=4, seed=71),
                   "len32k": await load_set(index, "c32k", n_prompts=8, length=32768, n_pods=4, seed=72)}
            await index.close()
            return out

        sets = asyncio.run(load())
        single_index = Index.from_url(vk.url, timeout_s=30.0)

        async def load_single() -> None:
            await load_set(single_index, "c4k", n_prompts=32, length=4096, n_pods=4, seed=71)
            await load_set(single_index, "c32k", n_prompts=8, length=32768, n_pods=4, seed=72)
            await single_index.close()

        asyncio.run(load_single())
        figures = {}
        for which, url in (("single", vk.url), ("cluster", cluster.url)):
            port = free_port()
            srv = Server([python(), "-m", "kv_preflight", "serve", "--valkey-url", url, "--port", str(port), "--workers", "2"],
                         port, tmp / f"serve-{which}.log").ready()
            try:
                figures[which] = {
                    "lat4k": run_load(port, sets["len4k"], tmp, requests=300 if quick else 1500, warmup=30),
                    "lat32k": run_load(port, sets["len32k"], tmp, requests=60 if quick else 300, warmup=5),
                }
            finally:
                srv.stop()
        c, o = figures["cluster"], figures["single"]
        for k, label in (("lat4k", "4K"), ("lat32k", "32K")):
            res.add(f"POST /v1/cache/predict on a cluster, {label} tokens, 4 pods",
                    f"p50 {fmt_us(c[k]['p50_us'])}, p99 {fmt_us(c[k]['p99_us'])}", "p50 <= 2x single node",
                    f"single node p50 {fmt_us(o[k]['p50_us'])}, p99 {fmt_us(o[k]['p99_us'])}",
                    o[k]["p50_us"] / c[k]["p50_us"], c[k]["p50_us"] <= 2 * o[k]["p50_us"],
                    cluster_run=without_answers(c[k]), single_run=without_answers(o[k]))
    finally:
        cluster.stop()

