"""Engine load, scraped in the background from each engine's Prometheus ``/metrics``.

Routing needs to know when the pod with the best cache overlap is too busy to be
worth it: requests running, requests waiting, and the fraction of KV blocks held by
running requests, as the engine adapter names them (``Engine.load_metrics``; the
predictor's engines are of the default family, kv_preflight/engines/). One GET per
engine per interval (~1 s) keeps them fresh without touching the request path:
a route reads the last snapshot from memory.

Every few scrapes the engine's ``/v1/models`` is read too, so routing knows which
models (base and LoRA adapters, by adapter name as the engine serves them) each pod
serves. Targets are ``--pod-metrics POD=URL`` and the engines of ``--engine-url``,
whose pod id comes from the topic (``kv@POD@MODEL``) in their discovery answer.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec

from kv_preflight.engines import DEFAULT, engine
from kv_preflight.engines.load_metrics import parse_load

log = logging.getLogger("kvpf.predictor")

ENGINE = engine(DEFAULT)  # the family of the engines the predictor scrapes

MODELS_EVERY = 10  # read /v1/models on every 10th scrape


@dataclass(frozen=True)
class PodLoad:
    running: float
    waiting: float
    kv_usage: float  # 0..1
    at: float  # monotonic time of the scrape


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
    scrape_errors: int = 0  # kvpf_engine_scrape_errors_total
    up: dict[str, bool] = field(default_factory=dict)  # engine URL -> answered its last scrape (for the log)

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
                    self.scrape_errors += 1
                    self._log_state(t, False, f"unreachable (its {ENGINE.discovery_path} does not answer); asked "
                                              "again every scrape")
                    return
                with_models = True
            resp = await client.get(t.metrics_url)
            resp.raise_for_status()
            parsed = parse_load(resp.text, ENGINE.load_metrics)
            if parsed is None:
                raise ValueError(f"{t.metrics_url} has no {ENGINE.load_metrics.running} / {ENGINE.load_metrics.waiting}")
            self.loads[t.pod_id] = PodLoad(*parsed, at=self.clock())
            if with_models:
                r = await client.get(t.base_url + "/v1/models")
                if r.status_code == 200:
                    names = {str(m.get("id")) for m in _models_decoder.decode(r.content).data if m.get("id")}
                    self.served[t.pod_id] = frozenset(names)
            self.failures.pop(t.pod_id, None)
            self._log_state(t, True, f"up, pod {t.pod_id}; running {parsed[0]:g}, waiting {parsed[1]:g}, "
                                     f"kv usage {parsed[2]:.0%}")
        except (httpx.HTTPError, ValueError, msgspec.DecodeError) as exc:
            self.scrape_errors += 1
            if t.pod_id is not None:
                self._log_state(t, False, f"pod {t.pod_id}: cannot scrape {t.metrics_url}: "
                                          f"{exc or type(exc).__name__}")
                self.failures[t.pod_id] = f"{type(exc).__name__}: {exc}"
                self.loads.pop(t.pod_id, None)

    def _log_state(self, t: Target, up: bool, detail: str) -> None:
        """One line per engine at start-up (its first scrape, also when it is down), then one per change:
        a scrape every second must not write a line every second."""
        was = self.up.get(t.base_url)
        self.up[t.base_url] = up
        if was is None:
            (log.info if up else log.warning)("start-up: engine %s: %s", t.base_url, detail)
        elif was != up:
            (log.info if up else log.warning)("engine %s: %s", t.base_url, "answers again, " + detail if up else detail)


async def _discover_pod(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The pod id in the engine's KV-event topic ``kv@POD@MODEL``; None while the engine does not answer."""
    try:
        resp = await client.get(base_url + ENGINE.discovery_path)
        body = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return ENGINE.read_pod_id(body)
