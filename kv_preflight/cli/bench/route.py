"""Row ``route``: does ``/v1/cache/route`` from a predictor given only ``--valkey-url`` keep caches warm
across a fleet, and spread the load? (docs/benchmarks.md, "Routing across a fleet").

Four simulated engines (``kv-preflight simulate``, small KV pools so a pod cannot hold every tenant),
one ingester following all four (``ingest --engine URL`` each), and ``serve --valkey-url URL`` with no
other flag. A multi-tenant workload (each request: its tenant's system prompt, then a unique question)
is sent at concurrency 8 three times, the engines' caches reset in between, choosing the pod by:

* round robin (no cache knowledge),
* a sticky oracle: tenant ``t`` always to pod ``t mod 4`` (knows the tenants, perfectly balanced), and
* ``POST /v1/cache/route`` (the prompt as text: the predictor tokenizes through an engine it found in
  the fleet records).

The fleet hit rate is the engines' own ``cached_tokens`` over all prompt tokens. Targets: route's hit
rate at least 0.9x the oracle's; every pod given at least one request and none more than 3x another.

The fleet records (``kvpf:fleet``: engine URL and models; ``kvpf:load``: running/waiting/KV usage with
Valkey's time) are the ingester's to write. If it has not written them for all four pods a few seconds
after start (an ingester from before fleet membership), the bench writes them itself as a stand-in,
through the same ``Index.put_pod_records`` / ``put_load`` calls, scraping each engine's /metrics every
0.5 s; the row says which was used.
"""
from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kv_preflight.cli.bench.procs import Server, python
from kv_preflight.cli.valkey_server import ValkeyServer, free_port
from kv_preflight.engines import engine
from kv_preflight.engines.load_metrics import parse_load
from kv_preflight.fleet.records import PodLoad, PodRecord
from kv_preflight.index.index import Index

MODEL = "bench-route"
VLLM_LOAD = engine("vllm").load_metrics  # the bench's engines are the simulator, which exports vLLM's series
PODS = 4
CONCURRENCY = 8
ENGINE_BLOCKS = 64  # 63 usable 16-token blocks: about 4 tenants' system prompts, not 12
TENANTS = 12
PREFIX_CHARS = 191  # + BOS = 192 tokens: 12 blocks per tenant system prompt (the simulator: 1 token per byte)
STEP_MS = 10.0  # the engines, not the predictor, are the bottleneck: their queues are what load shows
MAX_TOKENS = 8


@dataclass
class Engine:
    pod: str
    port: int
    server: Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    per_pod: Counter = field(default_factory=Counter)
    errors: int = 0
    route_reasons: Counter = field(default_factory=Counter)
    load_known: int = 0  # route answers in which every candidate had fresh load
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"hit_rate": round(self.hit_rate, 4), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "per_pod": dict(sorted(self.per_pod.items())),
                "errors": self.errors, "route_reasons": dict(self.route_reasons),
                "route_load_known": self.load_known, "seconds": round(self.seconds, 2)}


def workload(n: int, seed: int = 7, tenants: int = TENANTS) -> list[tuple[int, str]]:
    """(tenant, prompt): tenants chosen uniformly at random, each prompt its tenant's system prompt + a question."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    prefixes = [(f"tenant-{t:02d} system prompt: " + "".join(rng.choice(letters) for _ in range(PREFIX_CHARS)))
                [:PREFIX_CHARS] for t in range(tenants)]
    out = []
    for i in range(n):
        t = rng.randrange(tenants)
        out.append((t, prefixes[t] + f" question {i}: " + "".join(rng.choice(letters) for _ in range(40))))
    return out


async def _send(client: httpx.AsyncClient, engine: Engine, prompt: str) -> tuple[int, int]:
    r = await client.post(engine.url + "/v1/completions",
                          json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def run_strategy(name: str, engines: list[Engine], reqs: list[tuple[int, str]], predictor_url: str) -> Outcome:
    out = Outcome()
    by_pod = {e.pod: e for e in engines}
    queue: asyncio.Queue = asyncio.Queue()
    for i, req in enumerate(reqs):
        queue.put_nowait((i, *req))

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, tenant, prompt = queue.get_nowait()
            try:
                if name == "round robin":
                    engine = engines[i % len(engines)]
                elif name == "sticky oracle":
                    engine = engines[tenant % len(engines)]
                else:
                    r = await client.post(predictor_url + "/v1/cache/route", json={"model": MODEL, "prompt": prompt})
                    r.raise_for_status()
                    d = r.json()
                    out.route_reasons[d["reason"]] += 1
                    out.load_known += all(c.get("load") is not None for c in d["candidates"])
                    engine = by_pod[d["pod_id"]]
                n, cached = await _send(client, engine, prompt)
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                out.errors += 1
                continue
            out.prompt_tokens += n
            out.cached_tokens += cached
            out.per_pod[engine.pod] += 1

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    out.seconds = time.perf_counter() - t
    return out


class StandInFleetWriter:
    """Writes kvpf:fleet and kvpf:load for the engines when the ingester does not (see the module docstring)."""

    def __init__(self, valkey_url: str, engines: list[Engine]):
        self.valkey_url, self.engines = valkey_url, engines
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        index = Index.from_url(self.valkey_url, timeout_s=5.0)
        try:
            await index.fleet.put_pod_records({e.pod: PodRecord(state="live", engine_url=e.url, models=[MODEL],
                                                          block_size=16, owner="bench-stand-in")
                                         for e in self.engines})
            async with httpx.AsyncClient(timeout=2) as client:
                while not self.stop.is_set():
                    loads = {}
                    for e in self.engines:
                        try:
                            parsed = parse_load((await client.get(e.url + "/metrics")).text, VLLM_LOAD)
                        except httpx.HTTPError:
                            continue
                        if parsed is not None:
                            loads[e.pod] = PodLoad(*parsed, at_ms=await index.fleet.now_ms())
                    await index.fleet.put_load(loads)
                    await asyncio.sleep(0.5)
        finally:
            await index.close()


async def _fleet_pods(valkey_url: str) -> set[str]:
    index = Index.from_url(valkey_url, timeout_s=5.0)
    try:
        view = await index.fleet.fleet_view()
        return {p for p, r in view.pods.items() if r.state == "live" and r.engine_url and MODEL in r.models}
    finally:
        await index.close()


def _predicted(predictor_url: str, prompt: str) -> int:
    r = httpx.post(predictor_url + "/v1/cache/predict", json={"model": MODEL, "prompt": prompt}, timeout=10)
    return r.json().get("predicted_cached_tokens", -1) if r.status_code == 200 else -1


def _wait(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"route bench: {what} within {timeout_s:.0f}s")
        time.sleep(0.2)


def bench_route(res, vk: ValkeyServer, quick: bool, tmp: Path) -> None:
    print("routing across a fleet (4 simulated engines, serve --valkey-url only, concurrency 8)", flush=True)
    import redis

    r = redis.Redis.from_url(vk.url)
    r.flushall()
    r.close()
    n = 120 if quick else 360
    reqs = workload(n)
    engines = [Engine(f"sim-{i}", free_port()) for i in range(PODS)]
    servers: list[Server] = []
    writer: StandInFleetWriter | None = None
    try:
        for e in engines:
            zmq, replay = free_port(), free_port()
            e.server = Server([python(), "-m", "kv_preflight", "simulate", "--pod", e.pod, "--model", MODEL,
                               "--port", str(e.port), "--zmq", f"tcp://*:{zmq}", "--replay", f"tcp://*:{replay}",
                               "--block-size", "16", "--blocks", str(ENGINE_BLOCKS), "--step-ms", str(STEP_MS)],
                              e.port, tmp / f"{e.pod}.log")
            servers.append(e.server)
        for s in servers:
            s.ready()
        ing_args = [python(), "-m", "kv_preflight", "ingest", "--valkey-url", vk.url]
        for e in engines:
            ing_args += ["--engine", e.url]
        ingester = Server(ing_args, 0, tmp / "route-ingester.log")
        servers.append(ingester)
        port = free_port()
        predictor = Server([python(), "-m", "kv_preflight", "serve", "--valkey-url", vk.url, "--port", str(port)], port,
                           tmp / "route-predictor.log").ready()
        servers.append(predictor)
        purl = f"http://127.0.0.1:{port}"
        # the ingester's own fleet records, else the stand-in's
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and len(asyncio.run(_fleet_pods(vk.url))) < PODS:
            time.sleep(0.5)
        records_by = "ingester" if len(asyncio.run(_fleet_pods(vk.url))) >= PODS else "bench stand-in"
        if records_by != "ingester":
            writer = StandInFleetWriter(vk.url, engines)
            writer.thread.start()
        print(f"  fleet records written by: {records_by}", flush=True)
        # the ingester follows every engine before anything is measured
        probe = reqs[0][1]
        for e in engines:
            httpx.post(e.url + "/v1/completions", json={"model": MODEL, "prompt": probe, "max_tokens": 1}, timeout=30)
        _wait(lambda: _predicted(purl, probe) > 0, "the ingester did not index the probe")
        outcomes: dict[str, Outcome] = {}
        for name in ("round robin", "sticky oracle", "route"):
            for e in engines:
                httpx.post(e.url + "/reset_prefix_cache", timeout=10)
                # the simulator publishes AllBlocksCleared with its next step's batch (as vLLM): take one step
                httpx.post(e.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}, timeout=30)
            _wait(lambda: _predicted(purl, probe) == 0, "the index did not see the cache resets")
            outcomes[name] = asyncio.run(run_strategy(name, engines, reqs, purl))
            o = outcomes[name]
            print(f"  {name}: hit rate {o.hit_rate:.3f}, per pod {dict(sorted(o.per_pod.items()))}, "
                  f"{o.errors} errors, {o.seconds:.1f}s", flush=True)
    finally:
        if writer is not None:
            writer.stop.set()
            writer.thread.join(5)
        for s in reversed(servers):
            s.stop()
    rr, oracle, route = outcomes["round robin"], outcomes["sticky oracle"], outcomes["route"]
    ratio = route.hit_rate / oracle.hit_rate if oracle.hit_rate else 0.0
    res.add("route: fleet hit rate", f"route {route.hit_rate:.2f}, oracle {oracle.hit_rate:.2f} "
            f"({ratio:.2f}x), round robin {rr.hit_rate:.2f}", ">= 0.9x the sticky oracle", "round robin",
            route.hit_rate / rr.hit_rate if rr.hit_rate else None, ratio >= 0.9 and route.errors == 0)
    counts = [route.per_pod.get(e.pod, 0) for e in engines]
    spread_ok = min(counts) >= 1 and max(counts) <= 3 * min(counts)
    res.add("route: requests per pod", " / ".join(str(c) for c in counts) + f" ({n} requests)",
            "every pod >= 1, none > 3x another", "oracle " + " / ".join(str(oracle.per_pod.get(e.pod, 0))
                                                                          for e in engines), None, spread_ok)
    res.extra["route"] = {"fleet_records_by": records_by, "requests": n, "tenants": TENANTS,
                          "concurrency": CONCURRENCY, "engine_blocks": ENGINE_BLOCKS,
                          **{k: o.as_dict() for k, o in outcomes.items()}}
