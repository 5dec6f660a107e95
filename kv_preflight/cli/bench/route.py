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

Row ``dp`` is the route row with two engines of two data-parallel ranks each (``simulate --dp-size 2``: four
caches behind two ports): the oracle and round robin pin a request to a rank with vLLM's X-data-parallel-rank
header, the route sends it with the headers its decision names; a merged index (the ranks as one cache) would
leave the rank to the engine's balancer.

Row ``lora`` is the route row with every engine serving three LoRA adapters (``simulate --lora``) and each
tenant's requests naming one of them (tenant ``t``: adapter ``t mod 3``): an adapter's blocks are keyed under
its name, so the route must find them under it, learnt with no flag from the events and /v1/models.

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
from kv_preflight.cli.valkey_server import ValkeyServer, free_port, free_ports
from kv_preflight.engines import engine
from kv_preflight.engines.load_metrics import parse_load
from kv_preflight.fleet.records import PodLoad, PodRecord
from kv_preflight.index.index import Index
from kv_preflight.index.rank_pods import rank_pod

DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM 0.32: pins a request to a data-parallel rank

MODEL = "bench-route"
VLLM_LOAD = engine("vllm").load_metrics  # the bench's engines are the simulator, which exports vLLM's series
PODS = 4
CONCURRENCY = 8
ENGINE_BLOCKS = 64  # 63 usable 16-token blocks: about 4 tenants' system prompts, not 12
TENANTS = 12
PREFIX_CHARS = 191  # + BOS = 192 tokens: 12 blocks per tenant system prompt (the simulator: 1 token per byte)
STEP_MS = 10.0  # the engines, not the predictor, are the bottleneck: their queues are what load shows
MAX_TOKENS = 8
ADAPTERS = ("sql", "chat", "code")  # row lora: every engine serves them; tenant t names ADAPTERS[t % 3]


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


def workload(n: int, seed: int = 7, adapters: tuple[str, ...] = (), tenants: int = TENANTS) -> list[tuple[int, str, str]]:
    """(tenant, model, prompt): tenants chosen uniformly at random, each prompt its tenant's system prompt + a
    question; the model is the engines' own, or with ``adapters`` the tenant's adapter."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    prefixes = [(f"tenant-{t:02d} system prompt: " + "".join(rng.choice(letters) for _ in range(PREFIX_CHARS)))
                [:PREFIX_CHARS] for t in range(tenants)]
    out = []
    for i in range(n):
        t = rng.randrange(tenants)
        model = adapters[t % len(adapters)] if adapters else MODEL
        out.append((t, model, prefixes[t] + f" question {i}: " + "".join(rng.choice(letters) for _ in range(40))))
    return out


async def _send(client: httpx.AsyncClient, engine: Engine, model: str, prompt: str,
                headers: dict[str, str] | None = None) -> tuple[int, int]:
    r = await client.post(engine.url + "/v1/completions", headers=headers,
                          json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def run_strategy(name: str, engines: list[Engine], reqs: list[tuple[int, str, str]], predictor_url: str,
                       dp_size: int = 1) -> Outcome:
    """``dp_size`` > 1: each engine has that many data-parallel ranks, each a target of its own (pinned by
    vLLM's header); requests are counted per target (``<pod>@dp<r>`` for r >= 1, as the index names them)."""
    out = Outcome()
    by_pod = {e.pod: e for e in engines}
    targets = [(e, r) for e in engines for r in range(dp_size)]
    queue: asyncio.Queue = asyncio.Queue()
    for i, req in enumerate(reqs):
        queue.put_nowait((i, *req))

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i, tenant, model, prompt = queue.get_nowait()
            try:
                if name == "round robin":
                    engine, rank = targets[i % len(targets)]
                elif name == "sticky oracle":
                    engine, rank = targets[tenant % len(targets)]
                else:
                    r = await client.post(predictor_url + "/v1/cache/route", json={"model": model, "prompt": prompt})
                    r.raise_for_status()
                    d = r.json()
                    out.route_reasons[d["reason"]] += 1
                    out.load_known += all(c.get("load") is not None for c in d["candidates"])
                    engine, rank = by_pod[d["pod_id"]], d.get("dp_rank") or 0
                headers = {DP_RANK_HEADER: str(rank)} if dp_size > 1 else None
                n, cached = await _send(client, engine, model, prompt, headers)
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                out.errors += 1
                continue
            out.prompt_tokens += n
            out.cached_tokens += cached
            out.per_pod[rank_pod(engine.pod, rank) if dp_size > 1 else engine.pod] += 1

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
        async with Index.from_url(self.valkey_url, timeout_s=5.0) as index:
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


async def _fleet_pods(valkey_url: str) -> set[str]:
    async with Index.from_url(valkey_url, timeout_s=5.0) as index:
        view = await index.fleet.fleet_view()
        return {p for p, r in view.pods.items() if r.state == "live" and r.engine_url and MODEL in r.models}


def _predicted(predictor_url: str, model: str, prompt: str) -> int:
    r = httpx.post(predictor_url + "/v1/cache/predict", json={"model": model, "prompt": prompt}, timeout=10)
    return r.json().get("predicted_cached_tokens", -1) if r.status_code == 200 else -1


def _wait(check, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"route bench: {what} within {timeout_s:.0f}s")
        time.sleep(0.2)


def bench_route(res, vk: ValkeyServer, quick: bool, tmp: Path, adapters: tuple[str, ...] = (),
                dp_size: int = 1) -> None:
    """Row ``route`` (``adapters`` empty), ``lora`` (every tenant names one of ``adapters``) or ``dp`` (``dp_size``
    ranks per engine, as many caches in all as the route row's engines)."""
    row = "route (LoRA)" if adapters else "route (DP ranks)" if dp_size > 1 else "route"
    pods = PODS // dp_size
    shape = (f", each serving {len(adapters)} LoRA adapters" if adapters else
             f" of {dp_size} data-parallel ranks each" if dp_size > 1 else "")
    print(f"routing across a fleet ({pods} simulated engines{shape}, serve --valkey-url only, concurrency 8)",
          flush=True)
    import redis

    r = redis.Redis.from_url(vk.url)
    r.flushall()
    r.close()
    n = 120 if quick else 360
    reqs = workload(n, adapters=adapters)
    engines = [Engine(f"sim-{i}", free_port()) for i in range(pods)]
    servers: list[Server] = []
    writer: StandInFleetWriter | None = None
    try:
        for e in engines:
            zmq, replay = free_ports(dp_size), free_ports(dp_size)  # rank r publishes on the ports + r
            e.server = Server([python(), "-m", "kv_preflight", "simulate", "--pod", e.pod, "--model", MODEL,
                               "--port", str(e.port), "--zmq", f"tcp://*:{zmq}", "--replay", f"tcp://*:{replay}",
                               "--block-size", "16", "--blocks", str(ENGINE_BLOCKS), "--step-ms", str(STEP_MS),
                               "--dp-size", str(dp_size), *[a for name in adapters for a in ("--lora", name)]],
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
        if dp_size > 1 and records_by != "ingester":
            raise RuntimeError("route bench (DP ranks): the ingester wrote no fleet record of the ranks")
        if records_by != "ingester":
            writer = StandInFleetWriter(vk.url, engines)
            writer.thread.start()
        print(f"  fleet records written by: {records_by}", flush=True)
        # the ingester follows every engine before anything is measured
        _, probe_model, probe = reqs[0]
        for e in engines:
            for rank in range(dp_size):
                httpx.post(e.url + "/v1/completions", json={"model": probe_model, "prompt": probe, "max_tokens": 1},
                           headers={DP_RANK_HEADER: str(rank)}, timeout=30)
        _wait(lambda: _predicted(purl, probe_model, probe) > 0, "the ingester did not index the probe")
        outcomes: dict[str, Outcome] = {}
        for name in ("round robin", "sticky oracle", "route"):
            for e in engines:
                httpx.post(e.url + "/reset_prefix_cache", timeout=10)
                # the simulator publishes AllBlocksCleared with its next step's batch (as vLLM): take one step
                for rank in range(dp_size):
                    httpx.post(e.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                               headers={DP_RANK_HEADER: str(rank)}, timeout=30)
            _wait(lambda: _predicted(purl, probe_model, probe) == 0, "the index did not see the cache resets")
            outcomes[name] = asyncio.run(run_strategy(name, engines, reqs, purl, dp_size))
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
    res.add(f"{row}: fleet hit rate", f"route {route.hit_rate:.2f}, oracle {oracle.hit_rate:.2f} "
            f"({ratio:.2f}x), round robin {rr.hit_rate:.2f}", ">= 0.9x the sticky oracle", "round robin",
            route.hit_rate / rr.hit_rate if rr.hit_rate else None, ratio >= 0.9 and route.errors == 0)
    names = [rank_pod(e.pod, r) if dp_size > 1 else e.pod for e in engines for r in range(dp_size)]
    counts = [route.per_pod.get(p, 0) for p in names]
    spread_ok = min(counts) >= 1 and max(counts) <= 3 * min(counts)
    res.add(f"{row}: requests per {'rank' if dp_size > 1 else 'pod'}", " / ".join(str(c) for c in counts)
            + f" ({n} requests)", "every pod >= 1, none > 3x another",
            "oracle " + " / ".join(str(oracle.per_pod.get(p, 0)) for p in names), None, spread_ok)
    res.extra["route_lora" if adapters else "route_dp" if dp_size > 1 else "route"] = {"dp_size": dp_size,"fleet_records_by": records_by, "requests": n, "tenants": TENANTS,
                          "adapters": list(adapters),
                          "concurrency": CONCURRENCY, "engine_blocks": ENGINE_BLOCKS,
                          **{k: o.as_dict() for k, o in outcomes.items()}}
