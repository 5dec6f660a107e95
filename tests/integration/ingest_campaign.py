"""A fault-injection campaign against the ingester, with real processes: a valkey-server, a simulated engine
(``kv-preflight simulate``), and ``kv-preflight ingest``, killed with SIGKILL at random points while the engine
churns (evictions from a small pool, concurrent requests, cache resets, engine restarts).

After every episode, within 30 s of the engine going quiet, the index must equal the engine: the pod's seq is the
engine's last, its held (engine key, tier, group) triples are the engine's (its replay buffer read back from seq 0,
a copy counted each), and each block's request keys are those the bridge computes over the engine's whole stream
alone (one-by-one, no fault) — or the pod is flagged incomplete. An unflagged difference is a violation (a wrong
``exact``); a flagged one is counted (``flagged_and_differs``).

    .venv/bin/python -m tests.integration.ingest_campaign --runs 16 --episodes 10 --seed 1 --port-base 45100
    (add --cluster for a local Valkey Cluster; --vllm --canonical 48 for the real vLLM, KVPF_VLLM_UP, with request
    blocks of 48 tokens beside its engine blocks of 32, so every block leaves a carry)

Engine block sizes go round ``--block-sizes`` (16,32,24,8: the last two leave carries beside canonical blocks of
16), a third of the runs a hybrid engine (a sliding-window group). Prints one line per episode and a summary; exits
1 on a violation. Ports come from [--port-base, --port-base + --port-span) (900: cluster nodes from --port-base + 800
on; a single node needs only 4 a run, so a span of 100 keeps a campaign inside a range of 100 ports).
Not a test: the lead's or a reviewer's campaign, minutes long (a run of 10 episodes ~20-60 s on the simulator).
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import signal
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from kv_preflight.cli import valkey_cluster
from kv_preflight.cli.valkey_cluster import ValkeyCluster
from kv_preflight.cli.valkey_server import ValkeyServer
from kv_preflight.events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_preflight.index.entries import StoreBlock, tier_of
from kv_preflight.index.index import Index
from kv_preflight.index.transfer import export_blocks
from kv_preflight.ingester.bridge import ChainState, plan_batch
from kv_preflight.engines.vllm import ENGINE as VLLM
from tests.e2e.harness import spawn, stop
from tests.integration.sim import SimEngine

C = 16  # the canonical request-key block size (--canonical sets it; the ingester is given the same)
MODEL = "sim"
VOCAB = 30000
FAULTS = ["ingester_kill", "ingester_kill", "ingester_kill", "engine_kill", "clear", "none"]  # (drawn from, each episode)


class VllmEngine(SimEngine):
    """The real vLLM (CPU, block 32) through the launcher KVPF_VLLM_UP names, in the SimEngine's shape: started
    on the given ports, killed with its process group, its replay buffer read back from seq 0 the same way."""

    def start(self) -> "VllmEngine":
        from tests.e2e.conftest import start_vllm
        port = int(self.url.rsplit(":", 1)[1])
        self.vllm = start_vllm(pod=self.pod, port=port, zmq_port=self.zmq_port, replay_port=self.replay_port,
                               blocks=self.blocks)
        return self

    def stop(self, kill: bool = False) -> None:
        if getattr(self, "vllm", None) is not None:
            self.vllm.stop()
            time.sleep(2)  # (its ports let go)
            self.vllm = None


def engine_truth(batches) -> set[tuple[int, str, int]]:
    """(engine key, tier, KV cache group) the engine holds after these batches. Counted per copy: vLLM stores a
    hash twice when two requests computed it at once, and each copy is evicted in turn."""
    held: Counter[tuple[int, str, int]] = Counter()
    for b in batches:
        for ev in b.events:
            if isinstance(ev, BlockStored):
                held.update((ek, tier_of(ev.medium), ev.group_idx or 0) for ek in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                for ek in ev.block_hashes:
                    k = (ek, tier_of(ev.medium), ev.group_idx or 0)
                    if held[k] > 0:
                        held[k] -= 1
            elif isinstance(ev, AllBlocksCleared):
                held.clear()
    return {k for k, n in held.items() if n > 0}


def reference_keys(batches, model: str) -> dict[int, tuple[int, ...]]:
    """Engine key -> request keys, as the bridge keys the engine's whole stream from seq 0, alone."""
    state = ChainState(capacity=10**7)
    out: dict[int, tuple[int, ...]] = {}
    for b in batches:
        plan = plan_batch(b, pod_id="ref", topic_model=model, state=state, hash_seed="", block_size=C,
                          entry_field=lambda p, m, g: "f", extra_keys=VLLM.extra_keys)
        for m in plan.mutations:
            if isinstance(m, StoreBlock):
                out[m.engine_key] = tuple(m.request_keys)
    return out


class Run:
    def __init__(self, tmp: Path, seed: int, port: int, block_size: int, blocks: int, window: int | None,
                 cluster: bool = False, vllm: bool = False):
        self.tmp, self.rng, self.seed = tmp, random.Random(seed), seed
        tmp.mkdir(parents=True, exist_ok=True)
        if cluster:  # 3 masters and a replica each, nodes on ports from --port-base + 800 on
            self.valkey = ValkeyCluster(tmp / "cluster").start()
        else:
            self.valkey = ValkeyServer(tmp / "valkey", port=port, appendonly=False).start()
        engine = VllmEngine if vllm else SimEngine
        self.engine = engine(f"{MODEL}-{seed}", f"http://127.0.0.1:{port + 1}", port + 2, port + 3,
                             log=str(tmp / "engine.log"), blocks=blocks, block_size=block_size, sliding_window=window)
        try:
            self.engine.start()
        except BaseException:
            self.engine.stop(kill=True)
            self.valkey.stop()
            raise
        self.n_ing = 0
        self.ing = self.start_ingester()
        self.prefixes = [[self.rng.randrange(10, VOCAB) for _ in range(self.rng.randrange(5, 120))] for _ in range(6)]
        self.pool = ThreadPoolExecutor(4)
        self.faults = FAULTS
        self.ix = None

    def start_ingester(self):
        self.n_ing += 1
        # --private: this ingester ingests its engine whatever the fleet's leases say (a killed one's lease lives
        # on until its TTL, and would hold the engine meanwhile: the fleet's business, not the ingest path's)
        return spawn(["ingest", "--valkey-url", self.valkey.url, "--engine", self.engine.url, "--private",
                      "--block-size", str(C)],
                     str(self.tmp / f"ing-{self.n_ing}.log"), env={"KVPF_DISCOVERY_INTERVAL_S": "0.5"})

    def prompt(self) -> list[int]:
        head = self.rng.choice(self.prefixes)[: self.rng.randrange(1, 121)]
        return head + [self.rng.randrange(10, VOCAB) for _ in range(self.rng.randrange(1, 90))]

    def burst(self, n: int) -> None:
        """``n`` requests, four at a time (several in one engine step, several events a batch)."""
        def one(p):
            try:
                httpx.post(self.engine.url + "/v1/completions",
                           json={"model": MODEL, "prompt": p, "max_tokens": self.rng.randrange(1, 20)},
                           timeout=30).raise_for_status()
            except httpx.HTTPError:
                pass
        list(self.pool.map(one, [self.prompt() for _ in range(n)]))

    async def compare(self, published) -> tuple[str, bool, bool, str]:
        """The index against the engine now: (what differs, whether it differs, whether flagged, the reason)."""
        pod = self.engine.pod
        info = await self.ix.meta.pod_info(pod)
        seq = int(info.seqs.get("0", info.seqs.get(0, -1))) if info.seqs else -1
        truth = engine_truth(published)
        ref = reference_keys(published, MODEL)
        self.ix.writer.forget(pod)
        held: dict[tuple[int, str, int], tuple[int, ...]] = {}
        async for s in export_blocks(self.ix.writer, pod):
            held[(s.engine_key, s.tier, s.group)] = tuple(s.request_keys)
        missing, extra = truth - set(held), set(held) - truth
        wrong = [k for k, rks in held.items() if k in truth and ref.get(k[0]) != rks]
        caught_up = seq == len(published) - 1
        bad = bool(missing or extra or wrong) or not caught_up
        line = (f"engine seq {len(published) - 1} index seq {seq} blocks {len(truth)} missing {len(missing)} extra "
                f"{len(extra)} wrong_keys {len(wrong)} flagged={info.incomplete}")
        return line, bad, caught_up, info.incomplete, str(info.incomplete_reason)

    async def check(self, what: str, stats: dict, timeout_s: float = 30.0) -> str:
        """The engine quiet: the index must come to equal it, or be flagged, within ``timeout_s``."""
        published = self.engine.published()
        deadline = time.monotonic() + timeout_s
        while True:
            line, bad, caught_up, flagged, reason = await self.compare(published)
            if not bad or (caught_up and flagged) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        stats["checks"] += 1
        if not caught_up:
            stats["not_caught_up"] += 1
        if flagged:
            stats["flagged"] += 1
            stats["flag_reasons"].add(reason[:90])
        if bad and not flagged:
            stats["violations"].append(f"seed {self.seed} {what}: {line}")
            return f"VIOLATION {what}: {line}"
        if bad:
            stats["flagged_and_differs"] += 1
        return f"{what}: {line}"

    async def episode(self, i: int, stats: dict) -> str:
        fault = self.rng.choice(self.faults)
        stats["faults"][fault] = stats["faults"].get(fault, 0) + 1
        if fault == "ingester_kill":
            fut = self.pool.submit(self.burst, self.rng.randrange(4, 24))
            time.sleep(self.rng.uniform(0.0, 1.5))  # somewhere mid-burst (or after it)
            os.kill(self.ing.pid, signal.SIGKILL)
            self.ing.wait()
            fut.result()
            if self.rng.random() < 0.5:
                self.burst(self.rng.randrange(1, 8))  # blind
            self.ing = self.start_ingester()
        elif fault == "engine_kill":
            self.burst(self.rng.randrange(2, 10))
            self.engine.stop(kill=True)
            self.engine.start()
        elif fault == "clear":
            self.burst(self.rng.randrange(2, 10))
            r = httpx.post(self.engine.url + "/reset_prefix_cache", timeout=10)
            if r.status_code == 404:  # vLLM serves it in VLLM_SERVER_DEV_MODE only
                stats["faults"]["clear_unavailable"] = stats["faults"].get("clear_unavailable", 0) + 1
            else:
                r.raise_for_status()
        self.burst(self.rng.randrange(2, 16))
        return await self.check(f"ep {i} {fault}", stats)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        stop(self.ing, kill=True)
        self.engine.stop(kill=True)
        self.valkey.stop()


def free_block(base: int, rng: random.Random, span: int = 900) -> int:
    """Four consecutive free ports from ``base`` on (within ``span`` of it): Valkey, the engine's HTTP, events, replay."""
    import socket
    for _ in range(100):
        port = base + 4 * rng.randrange(0, span // 4)
        try:
            for p in range(port, port + 4):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no four free ports")


async def main() -> int:
    global C, MODEL, VOCAB, FAULTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--port-base", type=int, default=45100)
    ap.add_argument("--port-span", type=int, default=900, help="ports from --port-base to --port-base + this")
    ap.add_argument("--dir", default="/tmp/ingest-campaign")
    ap.add_argument("--block-sizes", default="16,32,24,8")
    ap.add_argument("--cluster", action="store_true", help="a local Valkey Cluster (3 masters, 3 replicas)")
    ap.add_argument("--faults", default="", help="the faults to draw from, comma-separated (default: " + ",".join(FAULTS) + ")")
    ap.add_argument("--canonical", type=int, default=16, help="the request-key block size (ingest --block-size)")
    ap.add_argument("--vllm", action="store_true", help="the real vLLM (KVPF_VLLM_UP) instead of the simulator; "
                                                         "--block-sizes is then vLLM's own (32)")
    args = ap.parse_args()
    C = args.canonical
    if args.faults:
        FAULTS = args.faults.split(",")
    if args.vllm:
        MODEL, VOCAB = "tiny", 8000
    lo = args.port_base + 800
    valkey_cluster.cluster_port = functools.partial(valkey_cluster.cluster_port, lo, lo + 100)  # (as tests/conftest.py)
    stats = {"checks": 0, "flagged": 0, "flagged_and_differs": 0, "not_caught_up": 0, "violations": [],
             "faults": {}, "flag_reasons": set()}
    sizes = [int(x) for x in args.block_sizes.split(",")]
    t0 = time.monotonic()
    for r in range(args.runs):
        seed = args.seed + r
        rng = random.Random(seed * 7919)
        bs = sizes[r % len(sizes)]
        window = rng.choice([None, None, 3 * bs]) if not args.vllm else None
        blocks = rng.choice([24, 40, 64])
        port = free_block(args.port_base, rng, args.port_span)
        print(f"run {r} seed {seed} block {bs} blocks {blocks} window {window}", flush=True)
        run = Run(Path(args.dir) / f"run-{seed}", seed, port, bs, blocks, window, cluster=args.cluster,
                  vllm=args.vllm)
        try:
            assert args.vllm or run.engine.proc.poll() is None, "the engine did not start"
            run.ix = Index.from_url(run.valkey.url)
            time.sleep(1.0)
            run.burst(4)
            for i in range(args.episodes):
                print("  " + await run.episode(i, stats), flush=True)
        finally:
            if run.ix is not None:
                await run.ix.close()
            run.close()
    stats["flag_reasons"] = sorted(stats["flag_reasons"])
    print(f"done in {time.monotonic() - t0:.0f}s: {stats}", flush=True)
    return 1 if stats["violations"] else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
