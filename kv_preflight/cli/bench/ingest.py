"""Rows ``ingest`` and ``memory``: a vLLM event stream ingested in process (against the seed path, the content
compared), over ZMQ by a ``kv-preflight ingest`` process, and the Valkey memory per (block, pod) entry it leaves."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from kv_preflight.cli.bench.floor import live_entries
from kv_preflight.cli.bench.measure import valkey_cpu
from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.bench.prompts import MODEL
from kv_preflight.cli.bench.results import Results
from kv_preflight.cli.bench.workload import event_stream
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.index.index import Index
from kv_preflight.index.layout import is_presence_key, pod_meta_key
from kv_preflight.keys.chain import request_keys


async def ingest_in_process(url: str, frames: list, chunk: int = 512) -> tuple[float, dict]:
    """Ours, in process: the ingester's message handler fed ``chunk`` queued messages at a time,
    as its receive loop is when the socket has a backlog (a replay, a burst)."""
    from kv_preflight.config import Config
    from kv_preflight.collector import tuned_collector
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


def _used(r: redis.Redis) -> int:
    """used_memory once no lazy free is pending (the bench's Valkey frees synchronously anyway)."""
    for _ in range(500):
        info = r.info("memory")
        if not int(info.get("lazyfree_pending_objects", 0)):
            return int(info["used_memory"])
        time.sleep(0.01)
    return int(r.info("memory")["used_memory"])


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
    asyncio.run(ingest_in_process(vk.url, sub))
    same = base_digest == _digest(r)
    print(f"  llm-d keys and seqs equal after {len(sub)} batches through the seed path and ours: {same}", flush=True)
    if not same:
        res.failed_checks.append("the seed ingestion path and ours left different llm-d keys")
    # Ours, in process, the whole stream, into an empty Valkey.
    r.flushall()
    mem0 = _used(r)
    vk_cpu0 = valkey_cpu(r)
    ours_t, ours_stats = asyncio.run(ingest_in_process(vk.url, stream.frames))
    vk_cpu = valkey_cpu(r) - vk_cpu0
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
        t128, _ = asyncio.run(ingest_in_process(vk.url, stream.frames))
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
        cpu0, vcpu0 = srv.cpu(), valkey_cpu(r)
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
        cpu, vcpu = srv.cpu() - cpu0, valkey_cpu(r) - vcpu0
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

