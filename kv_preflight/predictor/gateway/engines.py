"""Where each pod's engine answers, for the gateway: the fleet records' engine URLs, and the ``--engine`` URLs.

``--valkey-url`` alone routes to the pods the ingesters report (their records carry the engine URL). An
engine given with ``--engine URL`` is named as the index would name it: by the pod a fleet record gives for
that URL, else by the pod its KV-event topic names (``kv@POD@MODEL`` at the engine family's discovery path),
else, for an engine that publishes no events, by its address ``HOST:PORT`` (as ``ingest --engines-from``
names engines). Each such engine is scraped for load and models by the predictor's LoadMonitor, which makes
it a route candidate for the models it serves; one that does not answer yet is asked again every few seconds.

A pod whose engine refused a connection is reported to the fleet: its live record becomes ``unreachable``
(compare and set, so a record changed meanwhile is left alone); the ingester that owns the pod makes it live
again at its next good health check, and routes everywhere leave it out until then.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import msgspec

from kv_preflight.engines import DEFAULT, engine
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.predictor.fleet_view import FleetWatcher
from kv_preflight.predictor.load import LoadMonitor, make_target

log = logging.getLogger("kvpf.gateway")

ENGINE = engine(DEFAULT)
RESOLVE_EVERY_S = 2.0  # an --engine that did not answer yet is asked again this often


def address_of(url: str) -> str:
    """``http://10.0.0.5:8000/`` -> ``10.0.0.5:8000``: the name of an engine that publishes no events."""
    parts = urlsplit(url)
    return parts.netloc.rsplit("@", 1)[-1] or url


@dataclass
class GatewayEngines:
    urls: tuple[str, ...]  # --engine
    fleet: FleetWatcher | None
    load: LoadMonitor | None
    timeout_s: float = 2.0
    named: dict[str, str] = field(default_factory=dict)  # --engine URL -> its pod, once known
    events: dict[str, bool] = field(default_factory=dict)  # --engine URL -> it advertises KV-event publishers

    def __post_init__(self) -> None:
        self.urls = tuple(dict.fromkeys(u.rstrip("/") for u in self.urls))

    def url_of(self, pod: str) -> str | None:
        """The engine base URL to send ``pod``'s requests to: its fleet record's, else its --engine URL."""
        base = pod.split("@dp", 1)[0]  # a data-parallel rank's index name: its engine is the pod's
        view = self.fleet.view if self.fleet is not None else None
        if view is not None:
            record = view.pods.get(base)
            if record is not None and record.engine_url and record.state != "retired":
                return record.engine_url.rstrip("/")
        for url, named in self.named.items():
            if named == base:
                return url
        return None

    def pods(self) -> dict[str, str]:
        """pod -> URL of every --engine named so far."""
        return {pod: url for url, pod in self.named.items()}

    def urls_serving(self, model: str) -> list[str]:
        """--engine URLs whose engine lists ``model`` (tokenization targets beside the fleet's)."""
        if self.load is None:
            return []
        return [url for url, pod in self.named.items() if model in self.load.served.get(pod, ())]

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.resolve_once(client)
            await asyncio.sleep(RESOLVE_EVERY_S)

    async def resolve_once(self, client: httpx.AsyncClient) -> None:
        """Name every --engine not named yet (or named by address while a fleet record now names its URL)."""
        await asyncio.gather(*(self._resolve(client, url) for url in self.urls))

    def _recorded_pod(self, url: str) -> str | None:
        view = self.fleet.view if self.fleet is not None else None
        if view is None:
            return None
        found = sorted(p for p, r in view.pods.items() if r.engine_url.rstrip("/") == url and r.state != "retired")
        return found[0] if found else None

    async def _resolve(self, client: httpx.AsyncClient, url: str) -> None:
        recorded = self._recorded_pod(url)
        if recorded is not None and self.named.get(url) != recorded:
            self._name(url, recorded, events=True)
        elif url not in self.named:
            pod, events = await self._ask(client, url)
            if pod is None:
                return
            self._name(url, pod, events)
        else:
            return
        await self._read_models(client, url, self.named[url])

    async def _read_models(self, client: httpx.AsyncClient, url: str, pod: str) -> None:
        """The models a newly named engine serves, at once (the LoadMonitor reads them every tenth scrape): a
        request for them is routed from the first second."""
        if self.load is None:
            return
        try:
            resp = await client.get(url + "/v1/models", timeout=self.timeout_s)
            names = {str(m.get("id")) for m in resp.json().get("data", []) if isinstance(m, dict) and m.get("id")}
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if names:
            self.load.served[pod] = frozenset(names)

    async def _ask(self, client: httpx.AsyncClient, url: str) -> tuple[str | None, bool]:
        """(pod, publishes events): the topic's pod at the discovery path, else the address of an engine that
        answers ``/v1/models``; (None, False) while it answers neither."""
        if ENGINE.discovery_path is not None and ENGINE.read_pod_id is not None:
            try:
                resp = await client.get(url + ENGINE.discovery_path, timeout=self.timeout_s)
                if resp.status_code == 200:
                    pod = ENGINE.read_pod_id(resp.json())
                    if pod:
                        return pod, True
            except (httpx.HTTPError, ValueError):
                pass
        try:
            resp = await client.get(url + "/v1/models", timeout=self.timeout_s)
        except httpx.HTTPError:
            return None, False
        return (address_of(url), False) if resp.status_code == 200 else (None, False)

    def _name(self, url: str, pod: str, events: bool) -> None:
        old = self.named.get(url)
        self.named[url] = pod
        self.events[url] = events
        log.info("engine %s: pod %s (%s)", url, pod, "publishes KV events" if events else
                 "publishes no KV events: routed by what was sent to it")
        if self.load is None:
            return
        self.load.targets = [t for t in self.load.targets if t.base_url != url]
        if old is not None:
            self.load.loads.pop(old, None)
            self.load.served.pop(old, None)
        self.load.targets.append(make_target(pod, url))


async def tell_unreachable(index: Index, fleet: FleetWatcher | None, pod: str, why: str) -> bool:
    """Make the pod's live fleet record ``unreachable`` (compare and set); False when there is none to change
    (no record: an --engine no ingester owns) or it changed meanwhile, or Valkey did not answer."""
    view = fleet.view if fleet is not None else None
    record = view.pods.get(pod.split("@dp", 1)[0]) if view is not None else None
    if record is None or record.state != "live":
        return False
    try:
        async with asyncio.timeout(2.0):
            now_ms = await index.fleet.now_ms()
            marked = msgspec.structs.replace(record, state="unreachable", since_ms=now_ms, reason=why[:300],
                                             unreachable_since_ms=record.unreachable_since_ms or now_ms)
            done = await index.fleet.replace_pod_record(pod.split("@dp", 1)[0], record, marked)
    except (TimeoutError, *VALKEY_ERRORS) as exc:
        log.warning("pod %s: could not tell the fleet it is unreachable: %s: %s", pod, type(exc).__name__, exc)
        return False
    if done:
        log.warning("pod %s marked unreachable in the fleet records: %s", pod, why)
    return bool(done)


