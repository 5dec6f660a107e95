"""A Valkey Cluster replica's outage: what the write path costs while its outbox entries wait for a replica.

Every replica of a replicated 3-master cluster is held (SIGSTOP, its link cut), so no run's changes are confirmed
and every batch's outbox entry stays, one per batch for as long as the outage lasts. The row compares Valkey's CPU
(summed over the masters) per batch, and per round of the ingester's chores (every pod's outbox drained), with
few entries kept per pod and with many: a write path whose cost follows the outbox's length gets slower the
longer a replica is down (each pod step used to scan every entry, and the chores ran every entry again each
second: 700 µs per batch and 92 ms per round at 1,024 per pod, against 110 µs and 15 ms with 64). Only the ratio
within one run means anything: most of what is left is Valkey's own timer work over the runs' 200 ms WAITs.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import redis

from kv_preflight.cli.bench.measure import valkey_cpu
from kv_preflight.index.entries import StoreBlock, encode_entry, make_entry
from kv_preflight.index.layout import pod_outbox_key

PODS, BLOCKS_PER_BATCH, RUN = 4, 4, 64  # RUN: batches per pod per send (the ingester's pipelined run)
FEW, MANY, QUICK_MANY = 64, 1024, 256  # entries kept per pod when measured
MEASURED_RUNS, ROUNDS = 4, 3
GROWTH_MAX = 1.5  # many entries kept / few: the cost must not follow the outbox's length


def _cpu(masters: list[redis.Redis]) -> float:
    return sum(valkey_cpu(m) for m in masters)


class _Pods:
    """PODS pods, each sent RUN batches of BLOCKS_PER_BATCH new blocks per call, in order."""

    def __init__(self) -> None:
        self.seq = [0] * PODS

    def run(self) -> list[dict[str, Any]]:
        out = []
        for p in range(PODS):
            entry = encode_entry(make_entry(f"outage-{p}", "gpu", None))
            for _ in range(RUN):
                base = 10_000_000 * (p + 1) + self.seq[p] * BLOCKS_PER_BATCH
                out.append(dict(pod_id=f"outage-{p}", rank=0, seq=self.seq[p], ts=1.0, model="m",
                                engine_block_size=16, mutations=[StoreBlock(base + j, "gpu", entry, (base + j,))
                                                                 for j in range(BLOCKS_PER_BATCH)]))
                self.seq[p] += 1
        return out


async def _measure(ix: Any, pods: _Pods, masters: list[redis.Redis]) -> tuple[float, float]:
    """Valkey CPU (µs) per batch over MEASURED_RUNS runs, and (ms) per chores round (every pod drained, as the
    ingester's chores do each second)."""
    c0 = _cpu(masters)
    for _ in range(MEASURED_RUNS):
        await ix.apply_batches(pods.run())
    c1 = _cpu(masters)
    for _ in range(ROUNDS):
        await asyncio.gather(*(ix.drain_outbox(f"outage-{p}", stale_only=True) for p in range(PODS)))
    c2 = _cpu(masters)
    return 1e6 * (c1 - c0) / (MEASURED_RUNS * RUN * PODS), 1e3 * (c2 - c1) / ROUNDS


async def _run(tmp: Path, quick: bool) -> dict[str, Any]:
    from kv_preflight.cli.valkey_cluster import ValkeyCluster
    from kv_preflight.index.index import Index

    vc = ValkeyCluster(tmp / "outage-cluster", appendonly=False).start()
    held: list = []
    ix = Index.from_url(vc.url)
    try:
        vc.wait_ok()
        masters = vc.masters_now()
        clients = [redis.Redis(port=m.port) for m in masters]
        pods = _Pods()
        await ix.apply_batches(pods.run())  # the replicas have offsets: from here WAIT is waited for
        held = vc.hold_replicas()
        sync = redis.RedisCluster.from_url(vc.url)
        try:
            def kept() -> int:
                return min(sync.hlen(pod_outbox_key(f"outage-{p}")) for p in range(PODS))

            while kept() < FEW:
                await ix.apply_batches(pods.run())
            few = (kept(), *await _measure(ix, pods, clients))
            many_target = QUICK_MANY if quick else MANY
            while kept() < many_target:
                await ix.apply_batches(pods.run())
            many = (kept(), *await _measure(ix, pods, clients))
        finally:
            sync.close()
        return {"few": few, "many": many}
    finally:
        vc.release_replicas(held)
        await ix.close()
        vc.stop()


def bench_outage(res: Any, tmp: Path, quick: bool) -> dict[str, Any]:
    """The row of the module docstring; the figures also in ``res.extra["outage"]``."""
    print(f"a replica outage: every replica of a 3-master cluster held, {PODS} pods, runs of {RUN} batches of "
          f"{BLOCKS_PER_BATCH} blocks", flush=True)
    t = time.perf_counter()
    got = asyncio.run(_run(tmp, quick))
    (n_few, batch_few, round_few), (n_many, batch_many, round_many) = got["few"], got["many"]
    res.extra["outage"] = {"kept_few": n_few, "kept_many": n_many, "batch_us": [batch_few, batch_many],
                           "round_ms": [round_few, round_many], "seconds": time.perf_counter() - t}
    growth = max(batch_many / batch_few, round_many / round_few)
    res.add("Valkey CPU during a replica outage", f"{batch_many:.0f} µs per batch and {round_many:.0f} ms per chores "
            f"round with {n_many:,} entries kept per pod, against {batch_few:.0f} µs and {round_few:.0f} ms with "
            f"{n_few:,}", f"<= {GROWTH_MAX}x (flat)", f"{n_few} entries kept per pod, same run", growth,
            growth <= GROWTH_MAX)
    if n_many < (QUICK_MANY if quick else MANY) or n_few < FEW:
        res.failed_checks.append(f"the outbox kept {n_few} and {n_many} entries per pod, fewer than asked")
    return res.extra["outage"]


__all__ = ["bench_outage"]
