"""Run every benchmark row against real processes and print figures, targets and baseline ratios.

    python -m kv_preflight.cli.bench [--quick] [--only keys,ingest,memory,floor,outage,http,scaling,cluster,fleet,route,lora,dp,warnings,gateway,gateways] [--json] [--json-file out.json] [--html out.html]

It starts its own valkey-server on a free loopback port (no persistence), loads
the index, starts ``kv-preflight serve --workers 2`` and the baseline server
(cli/bench/baseline.py) one after the other, and drives them with the load
generator (cli/bench/loadgen.py) in a separate process. Everything it starts it
stops, by pid. docs/benchmarks.md explains each row.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import redis

from kv_preflight.cli.bench import loadgen
from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.bench.workload import event_stream, tokens
from kv_preflight.cli.bench.floor import live_entries
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.predictor.scoring.score import engine_cached_tokens
from kv_preflight.index.index import Index, StoreBlock
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.layout import is_presence_key, pod_meta_key
from kv_preflight.keys.chain import HAS_C_EXTENSION, request_keys, request_keys_reference

MODEL = "bench-model"
C = 16  # canonical block
E = 32  # engine block (vLLM on CPU)


# ---------------------------------------------------------------- helpers


def machine() -> dict[str, Any]:
    cpu = ""
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    mem = subprocess.run(["free", "-m"], capture_output=True, text=True).stdout
    vk = subprocess.run(["valkey-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu, "nproc": os.cpu_count(), "avx2": " avx2" in flags, "free_m": mem.strip(),
        "python": platform.python_version(), "valkey": vk, "kernel": platform.release(),
        "c_extension": HAS_C_EXTENSION, "loadavg_start": os.getloadavg(),
    }


def cpu_probe() -> float:
    """Milliseconds for a fixed pure-Python loop (median of 5): a VM's speed can move every figure from one
    minute to the next, so each run records it at its start and end, to compare runs."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append(time.perf_counter() - t)
    return sorted(times)[2] * 1000


def timeit(fn, *, min_time: float = 0.3, repeat: int = 5) -> float:
    """Median seconds per call over ``repeat`` rounds of at least ``min_time`` each."""
    fn()
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t >= min_time / 4:
            break
        n *= 2
    rounds = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n)
    return statistics.median(rounds)


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} us"


class Results:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.failed_checks: list[str] = []

    def add(self, row: str, figure: str, target: str, baseline: str, ratio: float | None, met: bool | None,
            **data: Any) -> None:
        self.rows.append({"row": row, "figure": figure, "target": target, "baseline": baseline, "ratio": ratio,
                          "met": met, **data})
        verdict = "" if met is None else ("  [meets target]" if met else "  [MISSES target]")
        r = f"  x{ratio:.1f}" if ratio else ""
        print(f"  {row}: {figure} (target {target}; baseline {baseline}{r}){verdict}", flush=True)

    def table(self) -> str:
        head = "| row | figure | target | baseline | speed-up | target met |\n|---|---|---|---|---|---|\n"
        lines = []
        for r in self.rows:
            met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
            ratio = f"x{r['ratio']:.1f}" if r["ratio"] else ""
            lines.append(f"| {r['row']} | {r['figure']} | {r['target']} | {r['baseline']} | {ratio} | {met} |")
        return head + "\n".join(lines)


# ---------------------------------------------------------------- row: request keys


def bench_keys(res: Results, quick: bool) -> None:
    print("request keys (C routine vs cbor2 + pure-Python FNV)", flush=True)
    toks = tokens(32768, 1)
    for n, target_ms in ((4096, 0.15), (32768, 1.0)):
        t = toks[:n]
        ours = timeit(lambda: request_keys(t, model=MODEL), min_time=0.2 if quick else 0.5)
        base = timeit(lambda: request_keys_reference(t, model=MODEL), min_time=0.2, repeat=3)
        assert request_keys(t, model=MODEL) == request_keys_reference(t, model=MODEL)
        res.add(f"request keys, {n // 1024}K tokens ({n // C} blocks)",
                f"{ours * 1e3:.3f} ms ({n / ours / 1e6:.0f}M tokens/s)", f"<= {target_ms} ms",
                f"{base * 1e3:.1f} ms", base / ours, ours * 1e3 <= target_ms,
                ours_s=ours, baseline_s=base, tokens=n)


# ---------------------------------------------------------------- rows: ingestion and memory


async def _ingest(url: str, frames: list, chunk: int = 512) -> tuple[float, dict]:
    """Ours, in process: the ingester's message handler fed ``chunk`` queued messages at a time,
    as its receive loop is when the socket has a backlog (a replay, a burst)."""
    from kv_preflight.config import Config
    from kv_preflight.ingester.collector import tuned_collector
    from kv_preflight.ingester.ingester import Ingester
    from kv_preflight.ingester.sources import Source

    index = Index.from_url(url, timeout_s=10.0)
    ing = Ingester(Config(valkey_url=url), index, [])
    src = Source("tcp://bench", bind=False, replay=None)
    try:
        with tuned_collector():  # as the ingester process runs
            t = time.perf_counter()
            for i in range(0, len(frames), chunk):
                await ing.handle_messages([(src, fr) for _, fr in frames[i:i + chunk]])
            elapsed = time.perf_counter() - t
    finally:
        await index.close()
    return elapsed, dict(ing.counters.counts)


def _digest(r: redis.Redis) -> tuple[int, int]:
    """Order-independent digest of llm-d's keys (request-key hashes and engine: zsets) and of pod seqs."""
    import hashlib

    acc, n = 0, 0
    keys = [k for k in r.scan_iter(count=5000) if not k.startswith(b"kvpf:")]
    with r.pipeline(transaction=False) as p:
        for k in keys:
            if k.startswith(b"engine:"):
                p.zrange(k, 0, -1, withscores=True)
            else:
                p.hkeys(k)
        vals = p.execute()
    for k, v in zip(keys, vals):
        h = hashlib.blake2b(k + repr(sorted(v)).encode(), digest_size=8).digest()
        acc ^= int.from_bytes(h, "little")
        n += 1
    # Pod seqs, named by pod: ours are kvpf:{<pod>}:meta (layout 2), the seed's kvpf:seed-pod:<pod>.
    for pattern, head, tail in (("kvpf:{*}:meta", b"kvpf:{", b"}:meta"), ("kvpf:seed-pod:*", b"kvpf:seed-pod:", b"")):
        for k in r.scan_iter(match=pattern):
            pod = k[len(head):len(k) - len(tail)]
            seqs = sorted((f, v) for f, v in r.hgetall(k).items() if f.startswith(b"seq:"))
            acc ^= int.from_bytes(hashlib.blake2b(pod + repr(seqs).encode(), digest_size=8).digest(), "little")
    return acc, n


def _blocks_in(frames) -> int:
    from kv_preflight.engines import engine
    from kv_preflight.events import BlockRemoved, BlockStored

    vllm = engine("vllm")  # the simulator publishes vLLM's frames
    n = 0
    for _, fr in frames:
        d = vllm.decode_frames(fr)
        for ev in d.batch.events if d.batch else ():
            if isinstance(ev, (BlockStored, BlockRemoved)):
                n += len(ev.block_hashes)
    return n


def _valkey_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _used(r: redis.Redis) -> int:
    """used_memory once no lazy free is pending (the bench's Valkey frees synchronously anyway)."""
    for _ in range(500):
        info = r.info("memory")
        if not int(info.get("lazyfree_pending_objects", 0)):
            return int(info["used_memory"])
        time.sleep(0.01)
    return int(r.info("memory")["used_memory"])


def _cluster_cpu(cluster) -> dict[int, float]:
    """Valkey CPU seconds used so far, per master port."""
    return {m.port: _valkey_cpu(redis.Redis(port=m.port)) for m in cluster.masters_now()}


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
    cpu0 = _valkey_cpu(r)
    single_t, _ = asyncio.run(_ingest(vk.url, stream.frames))
    single_cpu = _valkey_cpu(r) - cpu0
    cluster = ValkeyCluster(tmp / "cluster", appendonly=False).start()
    try:
        c0 = _cluster_cpu(cluster)
        cluster_t, _ = asyncio.run(_ingest(cluster.url, stream.frames))
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
                    cluster_run=_strip(c[k]), single_run=_strip(o[k]))
    finally:
        cluster.stop()


def _evalsha_usec(ports: list[int]) -> tuple[float, int]:
    """EVALSHA time (µs) and calls so far, summed over these Valkey ports (INFO commandstats)."""
    usec, calls = 0.0, 0
    for port in ports:
        st = redis.Redis(port=port).info("commandstats").get("cmdstat_evalsha", {})
        usec += float(st.get("usec", 0))
        calls += int(st.get("calls", 0))
    return usec, calls


def _clients(ports: list[int]) -> int:
    return sum(int(redis.Redis(port=p).info("clients")["connected_clients"]) - 1 for p in ports)


def bench_fleet(res: Results, vk: ValkeyServer, quick: bool, tmp: Path) -> None:
    """A prefix the whole fleet holds (a common system prompt): one 4K-token prompt held by 250 and by
    1,000 pods, each at its own length, on the single node and on a local cluster. Predict p50/p99 at
    concurrency 1, Valkey CPU per prediction (summed over shards; EVALSHA time from INFO commandstats too) and
    the connections one `serve --workers 2` holds open (at concurrency 1 and 32)."""
    from kv_preflight.cli.valkey_cluster import ValkeyCluster

    print("fleet-wide prefix: 4K tokens held by 250 and 1,000 pods at different lengths", flush=True)
    counts = (250, 1000)
    cluster = ValkeyCluster(tmp / "fleet-cluster", appendonly=False).start()
    try:
        targets = {"single": (vk.url, [vk.port]), "cluster": (cluster.url, [m.port for m in cluster.masters_now()])}
        for which, (url, ports) in targets.items():
            for port in ports:
                redis.Redis(port=port).flushall()

            async def load(url=url) -> dict[int, PromptSet]:
                index = Index.from_url(url, timeout_s=30.0)
                try:
                    return {n: await load_set(index, f"fleet{n}", n_prompts=2, length=4096, n_pods=n, seed=90 + n)
                            for n in counts}
                finally:
                    await index.close()

            t = time.perf_counter()
            sets = asyncio.run(load())
            print(f"  {which}: loaded {'+'.join(map(str, counts))} pods ({time.perf_counter() - t:.0f}s)", flush=True)
            for n in counts:
                before = _clients(ports)
                port = free_port()
                srv = Server([python(), "-m", "kv_preflight", "serve", "--valkey-url", url, "--port", str(port),
                              "--workers", "2"], port, tmp / f"serve-fleet-{which}-{n}.log").ready()
                try:
                    u0, c0 = _evalsha_usec(ports)
                    cpu0 = sum(_valkey_cpu(redis.Redis(port=p)) for p in ports)
                    lat = run_load(port, sets[n], tmp, requests=40 if quick else 200, warmup=10)
                    cpu1 = sum(_valkey_cpu(redis.Redis(port=p)) for p in ports)
                    u1, c1 = _evalsha_usec(ports)
                    conns_c1 = _clients(ports) - before
                    try:
                        thr = run_load(port, sets[n], tmp, concurrency=32, duration_s=2.0 if quick else 4.0, warmup=32)
                        thr_note = f"{thr['rps']:,.0f} predictions/s"
                    except RuntimeError as exc:  # answers past the Valkey deadline (503): say so, go on
                        thr = {"error": str(exc)[:300]}
                        thr_note = "some answers 503 at concurrency 32: " + str(exc).split(";")[0][-40:]
                    conns_c32 = _clients(ports) - before
                finally:
                    srv.stop()
                # warm-up requests included. CPU, not EVALSHA's wall time: three masters on two cores
                # contend, which inflates the time a script takes but not the CPU it uses.
                per_lookup_ms = (u1 - u0) / max(1, lat["requests"] + 10) / 1000
                cpu_ms = (cpu1 - cpu0) / max(1, lat["requests"] + 10) * 1000
                res.add(f"fleet-wide prefix, {which}, 4K tokens, {n:,} pods at different lengths",
                        f"p50 {fmt_us(lat['p50_us'])}, p99 {fmt_us(lat['p99_us'])}; Valkey CPU {cpu_ms:.1f} ms per "
                        f"prediction (EVALSHA {per_lookup_ms:.1f} ms); {conns_c1} connections at concurrency 1, "
                        f"{conns_c32} at 32 "
                        f"({thr_note})",
                        "p50 <= 5 ms, p99 <= 15 ms", "", None,
                        lat["p50_us"] <= 5000 and lat["p99_us"] <= 15000,
                        pods=n, topology=which, valkey_ms_per_lookup=per_lookup_ms,
                        valkey_cpu_ms_per_prediction=cpu_ms, evalsha_calls=c1 - c0,
                        connections_c1=conns_c1, connections_c32=conns_c32, run=_strip(lat), thr_run=_strip(thr))
    finally:
        cluster.stop()


def bench_ingest_memory(res: Results, vk: ValkeyServer, quick: bool, tmp: Path) -> None:
    from kv_preflight.cli.bench.baseline import seed_ingest

    print("ingestion (vLLM 0.32 batches, 4 pods, engine block 32) and memory", flush=True)
    target = 30_000 if quick else 120_000
    t = time.perf_counter()
    stream = event_stream(pods=4, target_blocks=target)
    blocks = stream.stored_blocks + stream.removed_blocks
    print(f"  generated {stream.batches} batches: {stream.stored_blocks} blocks stored, "
          f"{stream.removed_blocks} removed ({time.perf_counter() - t:.1f}s)", flush=True)
    r = redis.Redis.from_url(vk.url)
    # The seed path on a prefix of the stream (it is slow), then ours on the same prefix: same index.
    sub = stream.frames[: max(200, len(stream.frames) // (8 if not quick else 4))]
    sub_blocks = _blocks_in(sub)
    r.flushall()
    base_t, base_stats = asyncio.run(seed_ingest(vk.url, sub))
    base_digest = _digest(r)
    r.flushall()
    asyncio.run(_ingest(vk.url, sub))
    same = base_digest == _digest(r)
    print(f"  llm-d keys and seqs equal after {len(sub)} batches through the seed path and ours: {same}", flush=True)
    if not same:
        res.failed_checks.append("the seed ingestion path and ours left different llm-d keys")
    # Ours, in process, the whole stream, into an empty Valkey.
    r.flushall()
    mem0 = _used(r)
    vk_cpu0 = _valkey_cpu(r)
    ours_t, ours_stats = asyncio.run(_ingest(vk.url, stream.frames))
    vk_cpu = _valkey_cpu(r) - vk_cpu0
    rate, base_rate = blocks / ours_t, sub_blocks / base_t
    res.add("ingestion, in process (Ingester.handle_messages, 512 queued)",
            f"{rate:,.0f} engine blocks/s ({stream.stored_blocks / ours_t:,.0f} stored/s; "
            f"{2 * rate:,.0f} request-key blocks/s)",
            ">= 50,000 blocks/s", f"{base_rate:,.0f} blocks/s", rate / base_rate, rate >= 50_000,
            batches=stream.batches, stored=stream.stored_blocks, removed=stream.removed_blocks, seconds=ours_t,
            valkey_cpu_us_per_block=vk_cpu / blocks * 1e6, python_wall_us_per_block=ours_t / blocks * 1e6,
            equal_content=same, stats=ours_stats, baseline_stats=base_stats, baseline_batches=len(sub))
    _agreement(res, vk, stream.prompts)
    _memory(res, r, mem0)
    # The listpack threshold: a server setting (layout unchanged) that decides how small hashes are kept.
    r.config_set("hash-max-listpack-value", 128)
    try:
        r.flushall()
        mem0 = _used(r)
        t128, _ = asyncio.run(_ingest(vk.url, stream.frames))
        entries = live_entries(r)
        res.extra["memory_listpack_128"] = {"bytes_per_entry": (_used(r) - mem0) / entries, "entries": entries,
                                            "ingest_blocks_per_s": blocks / t128}
        print(f"  with hash-max-listpack-value 128: {(_used(r) - mem0) / entries:.0f} B per (block, pod) entry; "
              f"ingestion {blocks / t128:,.0f} blocks/s", flush=True)
    finally:
        r.config_set("hash-max-listpack-value", 64)
    _ingest_zmq(res, vk, stream, tmp, base_rate)


def _agreement(res: Results, vk: ValkeyServer, prompts: list[list[int]]) -> None:
    """The default lookup (pod bitmaps) against the exact walk, on the index the event stream left (evictions and all)."""
    async def run() -> tuple[int, int, int]:
        ix = Index.from_url(vk.url, timeout_s=10.0)
        same = hits = 0
        for toks in prompts:
            keys = request_keys(toks, model=MODEL)
            a = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(keys, mode="script"))
            b = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(keys, mode="linear"))
            same += a == b
            hits += bool(b)
        await ix.close()
        return same, hits, len(prompts)

    same, hits, n = asyncio.run(run())
    res.extra["lookup_agreement"] = {"prompts": n, "with_hits": hits, "bitmaps_equal_linear": same}
    if same != n:
        res.failed_checks.append(f"the bitmap lookup differed from the exact walk on {n - same} prompts")
    print(f"  bitmap lookup == exact walk on {same}/{n} served prompts ({hits} with cached blocks)", flush=True)


def _memory(res: Results, r: redis.Redis, mem0: int) -> None:
    """Bytes per (request key, pod) entry: total from used_memory; ours by deleting our per-block keys;
    the seed layout's by writing its reverse index (the whole PodEntry per block) beside ours."""
    total = _used(r) - mem0
    entries = live_entries(r)
    # Ours: the request keys' presence hashes and each pod's state log (layout 4, kv_preflight/index/layout.py).
    ours_keys = [k for k in r.scan_iter(match="kvpf:{*", count=5000) if is_presence_key(k) or k.endswith(b"}:state")]
    before = _used(r)
    for k in ours_keys:
        r.delete(k)
    ours = before - _used(r)
    llmd = total - ours
    res.add("Valkey memory per (block, pod) entry",
            f"{total / entries:.0f} B: llm-d keys {llmd / entries:.0f} B + ours {ours / entries:.0f} B",
            "ours <= half of llm-d's", f"llm-d's {llmd / entries:.0f} B", (ours / llmd) if llmd else None, None,
            entries=entries, used_memory=total, llmd_bytes=llmd, ours_bytes=ours)


def _ingest_zmq(res: Results, vk: ValkeyServer, stream, tmp: Path, base_rate: float) -> None:
    """The real path: `kv-preflight ingest --bind` in its own process, batches published over ZMQ."""
    import zmq

    r = redis.Redis.from_url(vk.url)
    r.flushall()
    port = free_port()
    log = tmp / "ingest.log"
    srv = Server([python(), "-m", "kv_preflight", "ingest", "--valkey-url", vk.url, "--bind", f"tcp://127.0.0.1:{port}"],
                 0, log)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        deadline = time.monotonic() + 20
        while b"subscribed" not in log.read_bytes():
            if time.monotonic() > deadline or srv.proc.poll() is not None:
                raise RuntimeError(f"ingester did not start: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        pub.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(1.0)  # ZMQ slow joiner: let the subscription arrive before publishing
        cpu0, vcpu0 = srv.cpu(), _valkey_cpu(r)
        t0 = time.perf_counter()
        for _, fr in stream.frames:
            pub.send_multipart(fr)
        sent = time.perf_counter() - t0
        want = {pod: str(seq).encode() for pod, seq in stream.last_seq.items()}
        deadline = time.monotonic() + 120
        while True:
            got = {pod: r.hget(pod_meta_key(pod), "seq:0") for pod in want}
            if got == want:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"ingester stuck at {got}, want {want}")
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        cpu, vcpu = srv.cpu() - cpu0, _valkey_cpu(r) - vcpu0
        incomplete = [p for p in want if r.hget(pod_meta_key(p), "incomplete") == b"1"]
    finally:
        pub.close()
        ctx.term()
        srv.stop()
    blocks = stream.stored_blocks + stream.removed_blocks
    rate = blocks / elapsed
    if incomplete:
        res.failed_checks.append(f"pods marked incomplete after the ZMQ run: {incomplete}")
    res.add("ingestion over ZMQ, `kv-preflight ingest` process",
            f"{rate:,.0f} blocks/s (publish took {sent:.2f} s of {elapsed:.2f} s)", ">= 50,000 blocks/s",
            f"{base_rate:,.0f} blocks/s (seed path, in process)", rate / base_rate, rate >= 50_000 and not incomplete,
            seconds=elapsed, ingester_cpu_us_per_block=cpu / blocks * 1e6, valkey_cpu_us_per_block=vcpu / blocks * 1e6,
            pods_incomplete=incomplete)


# ---------------------------------------------------------------- HTTP rows


class PromptSet:
    def __init__(self, name: str, bodies: list[bytes], expected: list[tuple[int, str | None]]):
        self.name, self.bodies, self.expected = name, bodies, expected


async def load_set(index: Index, name: str, *, n_prompts: int, length: int, n_pods: int, seed: int,
                   fractions=None) -> PromptSet:
    """Prompts whose chains ``n_pods`` pods hold in part: pod i holds about fractions[i] of the prefix."""
    import random

    rng = random.Random(seed)
    fractions = fractions or [(i + 1) / n_pods for i in range(n_pods)]
    bodies, expected = [], []
    pods = [f"{name}-pod-{i}" for i in range(n_pods)]
    for p in range(n_prompts):
        toks = tokens(length, seed * 1000 + p)
        keys = request_keys(toks, model=MODEL)
        n_engine = len(keys) // (E // C)
        held = {}
        for i, pod in enumerate(pods):
            f = min(1.0, max(0.02, fractions[i] + rng.uniform(-0.04, 0.04) if fractions[i] < 1 else 1.0))
            nb = max(1, int(round(n_engine * f)))
            held[pod] = nb * (E // C)
            fld = index.entry_field(pod, "GPU", 0)
            stores = [StoreBlock(keys[2 * j + 1] ^ 0x5EED, "gpu", fld, (keys[2 * j], keys[2 * j + 1]),
                                 parent=keys[2 * j - 1] if j else CHAIN_ROOT) for j in range(nb)]
            for s in range(0, len(stores), 512):
                await index.apply_batch(pod_id=pod, rank=0, seq=0, ts=0.0, model=MODEL, engine_block_size=E,
                                        mutations=stores[s:s + 512], mode="import")
        best = sorted(((engine_cached_tokens(b, C, E, length), pod) for pod, b in held.items()),
                      key=lambda x: (-x[0], x[1]))[0]
        bodies.append(json.dumps({"model": MODEL, "token_ids": toks}, separators=(",", ":")).encode())
        expected.append(best)
    return PromptSet(name, bodies, expected)


def run_load(port: int, ps: PromptSet, tmp: Path, *, concurrency: int = 1, requests: int | None = None,
             duration_s: float | None = None, warmup: int = 20) -> dict:
    bodies_path = tmp / f"{ps.name}.bodies"
    if not bodies_path.exists():
        loadgen.write_bodies(str(bodies_path), ps.bodies)
    spec = {"host": "127.0.0.1", "port": port, "bodies": str(bodies_path), "concurrency": concurrency,
            "requests": requests, "duration_s": duration_s, "warmup_requests": warmup}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = subprocess.run([python(), "-m", "kv_preflight.cli.bench.loadgen", str(spec_path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    bad = [s for s in result["statuses"] if s != "200"]
    if bad:
        raise RuntimeError(f"non-200 answers from port {port}: {result['statuses']}; first: {list(result['first'].values())[:1]}")
    for k, body in result["first"].items():
        doc = json.loads(body)
        tokens_exp, pod_exp = ps.expected[int(k)]
        if (doc["predicted_cached_tokens"], doc["best_pod"]) != (tokens_exp, pod_exp):
            raise RuntimeError(f"{ps.name}[{k}]: predicted {doc['predicted_cached_tokens']} on {doc['best_pod']}, "
                               f"expected {tokens_exp} on {pod_exp}")
    return result


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
            cpu0, vcpu0 = srv.cpu(), _valkey_cpu(r)
            f["thr"] = run_load(port, sets["len4k"], tmp, concurrency=32, duration_s=thr_s, warmup=200 // scale)
            f["thr"]["server_cpu_s"] = srv.cpu() - cpu0
            f["thr"]["valkey_cpu_s"] = _valkey_cpu(r) - vcpu0
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
            o["lat4k"]["p50_us"] <= 2000 and o["lat4k"]["p99_us"] <= 6000, ours_run=_strip(o["lat4k"]), baseline_run=_strip(b["lat4k"]))
    res.add("POST /v1/cache/predict, 32K tokens, 4 pods, concurrency 1",
            f"p50 {fmt_us(o['lat32k']['p50_us'])}, p99 {fmt_us(o['lat32k']['p99_us'])}", "p50 <= 5 ms",
            f"p50 {fmt_us(b['lat32k']['p50_us'])}", b["lat32k"]["p50_us"] / o["lat32k"]["p50_us"],
            o["lat32k"]["p50_us"] <= 5000, ours_run=_strip(o["lat32k"]), baseline_run=_strip(b["lat32k"]))
    ot, bt = o["thr"], b["thr"]
    per = 1e6 / ot["rps"] if ot["rps"] else 0
    res.add("predictor throughput, 4K tokens, concurrency 32, --workers 2",
            f"{ot['rps']:,.0f} predictions/s (p50 {fmt_us(ot['p50_us'])}, p99 {fmt_us(ot['p99_us'])})",
            ">= 2,000 predictions/s", f"{bt['rps']:,.0f} predictions/s", ot["rps"] / bt["rps"], ot["rps"] >= 2000,
            ours_run=_strip(ot), baseline_run=_strip(bt),
            cpu_us_per_prediction={
                "predictor": ot["server_cpu_s"] / ot["requests"] * 1e6,
                "valkey": ot["valkey_cpu_s"] / ot["requests"] * 1e6,
                "client": ot["client_cpu_s"] / ot["requests"] * 1e6,
                "wall_per_prediction_us_on_2_cores": per * 2,
            })
    if do_scaling:
        res.extra["scaling_length"] = [
            {"tokens": n, "ours": _strip(o[f"len{n // 1024}k"] if n not in (4096, 32768) else o["lat4k" if n == 4096 else "lat32k"]),
             "baseline": _strip(b[f"len{n // 1024}k"] if n not in (4096, 32768) else b["lat4k" if n == 4096 else "lat32k"])}
            for n in (1024, 2048, 4096, 8192, 16384, 32768)
        ]
        res.extra["scaling_pods"] = [
            {"pods": p, "ours": _strip(o["lat4k"] if p == 4 else o[f"pods{p}"]),
             "baseline": _strip(b["lat4k"] if p == 4 else b[f"pods{p}"])}
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


def _strip(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "first"}


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    """``python -m kv_preflight.cli.bench``: the same command as ``kv-preflight bench`` (cli/bench/command.py)."""
    from kv_preflight.cli.bench.command import bench
    from kv_preflight.cli.env import apply_env

    group = click.Group(commands=[bench])
    apply_env(group)  # KVPF_<NAME>, as under kv-preflight
    bench.main(args=argv, prog_name="kv-preflight bench")


def source_commit() -> str | None:
    """The checkout's commit (``-dirty`` with local changes), so a kept run names the code it measured; None
    outside a git checkout (an installed wheel)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def run(*, quick: bool, only: set[str], as_json: bool = False, json_file: Path | None = None,
        html_file: Path | None = None) -> None:
    t0 = time.perf_counter()
    m = machine()
    m["commit"] = source_commit()
    m["cpu_probe_ms_start"] = cpu_probe()
    print(f"kv-preflight bench on {m['cpu']}, {m['nproc']} cores, load average {m['loadavg_start'][0]:.2f}, "
          f"CPU probe {m['cpu_probe_ms_start']:.1f} ms (a fixed Python loop: lower is a faster moment)", flush=True)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="kvpf-bench-") as d:
        tmp = Path(d)
        vk = ValkeyServer(tmp / "valkey", appendonly=False).start()
        # Valkey 8 frees DEL/FLUSHALL in the background by default: measure memory synchronously.
        rc = redis.Redis.from_url(vk.url)
        for name in ("lazyfree-lazy-user-del", "lazyfree-lazy-user-flush", "lazyfree-lazy-server-del"):
            rc.config_set(name, "no")
        # The memory row is measured at Valkey's default listpack threshold, then at 128 (what
        # ValkeyServer and the compose stack configure) for the side-by-side.
        rc.config_set("hash-max-listpack-value", 64)
        rc.close()
        try:
            if "keys" in only:
                bench_keys(res, quick)
            if "ingest" in only or "memory" in only:
                bench_ingest_memory(res, vk, quick, tmp)
            if "floor" in only:
                from kv_preflight.cli.bench.floor import bench_floor
                bench_floor(res, tmp, quick)
            if "outage" in only:
                from kv_preflight.cli.bench.outage import bench_outage
                bench_outage(res, tmp, quick)
            if "http" in only or "scaling" in only:
                bench_http(res, vk, quick, tmp, "scaling" in only)
            if "cluster" in only:
                bench_cluster(res, vk, quick, tmp)
            if "warnings" in only:
                from kv_preflight.cli.bench.warnings import bench_warnings
                bench_warnings(res, quick, timeit)
            if "fleet" in only:
                from kv_preflight.cli.bench.hybrid import bench_hybrid_fleet

                bench_fleet(res, vk, quick, tmp)
                bench_hybrid_fleet(res, vk, quick, tmp)
            if "route" in only or "lora" in only or "dp" in only:
                from kv_preflight.cli.bench.route import ADAPTERS, bench_route

                if "route" in only:
                    bench_route(res, vk, quick, tmp)
                if "lora" in only:
                    bench_route(res, vk, quick, tmp, ADAPTERS)
                if "dp" in only:
                    bench_route(res, vk, quick, tmp, dp_size=2)
            if "gateway" in only:
                from kv_preflight.cli.bench.gateway import bench_gateway

                bench_gateway(res, vk, quick, tmp)
            if "gateways" in only:
                from kv_preflight.cli.bench.gateway import bench_gateways

                bench_gateways(res, vk, quick, tmp)
        finally:
            vk.stop()
    m["loadavg_end"] = os.getloadavg()
    m["cpu_probe_ms_end"] = cpu_probe()
    m["seconds"] = time.perf_counter() - t0
    print()
    print(res.table())
    print(f"\n{m['seconds']:.0f}s; load average at start {m['loadavg_start'][0]:.2f}, at end {m['loadavg_end'][0]:.2f}; "
          f"CPU probe {m['cpu_probe_ms_start']:.1f} -> {m['cpu_probe_ms_end']:.1f} ms "
          "(other work on this machine, and its speed of the moment, skew every figure)")
    doc = {"machine": m, "rows": res.rows, **res.extra, "failed_checks": res.failed_checks}
    if json_file is not None:
        json_file.write_text(json.dumps(doc, indent=1, default=str))
    if html_file is not None:
        from kv_preflight.cli.bench.report import render_html

        html_file.write_text(render_html(json.loads(json.dumps(doc, default=str))))
        print(f"wrote {html_file}")
    if as_json:
        print(json.dumps(doc, default=str))
    if res.failed_checks:
        print("\nFAILED CHECKS:\n  " + "\n  ".join(res.failed_checks))
        sys.exit(1)


if __name__ == "__main__":
    main()
