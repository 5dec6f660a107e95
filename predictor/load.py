"""Engine load, scraped in the background from each engine's Prometheus ``/metrics``.

Routing needs to know when the pod with the best cache overlap is too busy to be
worth it. vLLM exports exactly the signals that say so (0.32): requests running,
requests waiting, and the fraction of KV blocks held by running requests
(``vllm:kv_cache_usage_perc``; cached-but-free blocks do not count). One GET per
engine per interval (~1 s) keeps them fresh without touching the request path:
a route reads the last snapshot from memory.

Every few scrapes the engine's ``/v1/models`` is read too, so routing knows which
models (base and LoRA adapters, by adapter name as the engine serves them) each pod
serves. Targets are ``--pod-metrics POD=URL`` and the engines of ``--engine-url``,
whose pod id comes from their ``/kv_event_sources`` topic (``kv@POD@MODEL``).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

log = logging.getLogger("kvpf.predictor")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # vLLM before the v1 engine
MODELS_EVERY = 10  # read /v1/models on every 10th scrape


@dataclass(frozen=True)
class PodLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    at: float  # monotonic time of the scrape


def parse_vllm_metrics(text: str) -> tuple[float, float, float] | None:
    """(running, waiting, kv usage) summed over the engine's DP ranks (kv usage: their mean); None if absent."""
    sums = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0, KV_USAGE_OLD: 0.0}
    counts = dict.fromkeys(sums, 0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        if name_end < 0:
            name_end = line.find(" ")
        name = line[:name_end]
        if name not in sums:
            continue
        try:
            value = float(line.rsplit("}", 1)[-1].split()[0])
        except (ValueError, IndexError):
            continue
        if math.isfinite(value):
            sums[name] += value
            counts[name] += 1
    if not counts[RUNNING] and not counts[WAITING]:
        return None
    usage_name = KV_USAGE if counts[KV_USAGE] else KV_USAGE_OLD
    usage = sums[usage_name] / counts[usage_name] if counts[usage_name] else 0.0
    return sums[RUNNING], sums[WAITING], min(max(usage, 0.0), 1.0)


class _Models(msgspec.Struct):
    data: list[dict]


_models_decoder = msgspec.json.Decoder(_Models)


@dataclass
class Target:
    pod_id: str | None  # None until discovered
    base_url: str
    metrics_url: str


def make_target(pod_id: str | None, url: str) -> Target:
    """``http://h:p`` or ``http://h:p/metrics``: the engine's base URL serves /v1/models too."""
    url = url.rstrip("/")
    base = url[: -len("/metrics")] if url.endswith("/metrics") else url
    return Target(pod_id, base, base + "/metrics")


@dataclass
class LoadMonitor:
    """The last load and served models of each pod; ``run`` keeps them fresh until cancelled."""

    targets: list[Target]
    interval_s: float = 1.0
    timeout_s: float = 0.8
    clock: Callable[[], float] = time.monotonic
    loads: dict[str, PodLoad] = field(default_factory=dict)
    served: dict[str, frozenset[str]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)  # pod -> last scrape error, while failing
    scrapes: int = 0
    scrape_errors: int = 0

    @classmethod
    def from_config(cls, pod_metrics: Mapping[str, str], engine_urls: Mapping[str, str | Sequence[str]],
                    interval_s: float) -> "LoadMonitor":
        targets = [make_target(pod, url) for pod, url in pod_metrics.items()]
        known = {t.base_url for t in targets}
        # every engine of every model (``--engine-url m=A --engine-url m=B``: both are scraped)
        urls = [u for us in engine_urls.values() for u in ((us,) if isinstance(us, str) else us)]
        for url in dict.fromkeys(urls):
            if url.rstrip("/") not in known:
                targets.append(make_target(None, url))
        return cls(targets, interval_s=interval_s, timeout_s=min(0.8 * interval_s, 2.0))

    def snapshot(self, pod_id: str, stale_s: float) -> PodLoad | None:
        load = self.loads.get(pod_id)
        if load is None or self.clock() - load.at > stale_s:
            return None
        return load

    def unreachable(self) -> frozenset[str]:
        return frozenset(self.failures)

    def serving(self, model: str) -> frozenset[str] | None:
        """Pods whose engine lists ``model``; None when no engine's model list is known."""
        if not self.served:
            return None
        return frozenset(p for p, models in self.served.items() if model in models)

    async def run(self, client: httpx.AsyncClient | None = None) -> None:
        own = client is None
        client = client or httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s))
        try:
            while True:
                started = self.clock()
                await self.scrape_once(client)
                await asyncio.sleep(max(0.0, self.interval_s - (self.clock() - started)))
        finally:
            if own:
                await client.aclose()

    async def scrape_once(self, client: httpx.AsyncClient) -> None:
        with_models = self.scrapes % MODELS_EVERY == 0
        self.scrapes += 1
        await asyncio.gather(*(self._scrape(client, t, with_models) for t in self.targets))

    async def _scrape(self, client: httpx.AsyncClient, t: Target, with_models: bool) -> None:
        try:
            if t.pod_id is None:
                t.pod_id = await _discover_pod(client, t.base_url)
                if t.pod_id is None:
                    return
                log.info("load: engine %s is pod %s", t.base_url, t.pod_id)
                with_models = True
            resp = await client.get(t.metrics_url)
            resp.raise_for_status()
            parsed = parse_vllm_metrics(resp.text)
            if parsed is None:
                raise ValueError(f"{t.metrics_url} has no {RUNNING} / {WAITING}")
            self.loads[t.pod_id] = PodLoad(*parsed, at=self.clock())
            if with_models:
                r = await client.get(t.base_url + "/v1/models")
                if r.status_code == 200:
                    names = {str(m.get("id")) for m in _models_decoder.decode(r.content).data if m.get("id")}
                    self.served[t.pod_id] = frozenset(names)
            if self.failures.pop(t.pod_id, None) is not None:
                log.info("load: %s answers again", t.pod_id)
        except (httpx.HTTPError, ValueError, msgspec.DecodeError) as exc:
            self.scrape_errors += 1
            if t.pod_id is not None:
                if t.pod_id not in self.failures:
                    log.warning("load: cannot scrape %s (%s): %s", t.pod_id, t.metrics_url, exc)
                self.failures[t.pod_id] = f"{type(exc).__name__}: {exc}"
                self.loads.pop(t.pod_id, None)


async def _discover_pod(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The pod id in the engine's KV-event topic ``kv@POD@MODEL``; None while the engine does not answer."""
    try:
        resp = await client.get(base_url + "/kv_event_sources")
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    for _rank, conf in sorted(body.items()):
        topic = conf.get("topic") if isinstance(conf, dict) else None
        if isinstance(topic, str) and topic.count("@") >= 2:
            return topic.split("@", 2)[1]
    return None
