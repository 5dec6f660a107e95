"""An engine's KV-event publishers, asked over HTTP (``ingest --engine URL``, ``index rebuild --engine``).

Which path to ask and how its answer reads is the engine adapter's (``Engine.discovery_path``,
``Engine.read_publishers`` in kv_preflight/engines/). A URL does not say which engine serves it, so the
adapters that have a discovery path are asked in the order of ``ENGINES`` (vLLM's ``/kv_event_sources``
first): a 404 passes to the next one, whose answer counts only if that adapter reads it as its own;
when none does, the first answer's error is raised.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from kv_preflight.engines import ENGINES, Engine
from kv_preflight.engines.endpoints import check_zmq_endpoint
from kv_preflight.ingester.sources import Source

log = logging.getLogger("kvpf.ingester")

DISCOVERABLE = [e for e in ENGINES.values() if e.discovery_path and e.read_publishers]


def sources_from(adapter: Engine, engine_url: str, body: Any, target_ports: tuple[int, ...] = ()) -> list[Source] | None:
    """The sources of an engine's discovery answer, read by its adapter; None if the answer is not its own."""
    assert adapter.read_publishers is not None
    found = adapter.read_publishers(engine_url, body, target_ports)
    if found is None:
        return None
    for p in found:  # an endpoint no socket could use fails this engine's discovery, never the ingester
        check_zmq_endpoint(p.endpoint, bind=p.bind)
        if p.replay:
            check_zmq_endpoint(p.replay, bind=False)
    return [Source(endpoint=p.endpoint, bind=p.bind, replay=p.replay, topic=p.topic, rank=p.rank, serving=p.serving,
                   engine=adapter.name, pod=p.pod, model=p.model) for p in found]


async def discover(engine_url: str, timeout_s: float = 5.0, target_ports: tuple[int, ...] = ()) -> list[Source]:
    base = engine_url.rstrip("/")
    first, *others = DISCOVERABLE
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(base + first.discovery_path)
        if resp.status_code == 404:  # not that engine: the next one may list its publishers elsewhere
            for adapter in others:
                answer = await client.get(base + adapter.discovery_path)
                found = await asyncio.to_thread(sources_from, adapter, engine_url,
                                                answer.json() if answer.status_code == 200 else None, target_ports)
                if found is not None:
                    return found
        resp.raise_for_status()
        # in a thread: an adapter may resolve the engine's host name (the serving address), a blocking call
        found = await asyncio.to_thread(sources_from, first, engine_url, resp.json(), target_ports)
        if found is None:
            raise ValueError(f"{base}{first.discovery_path}: not a list of {first.name}'s publishers")
        return found


async def discover_logged(url: str, attempts: int = 0, target_ports: tuple[int, ...] = ()) -> list[Source] | None:
    """An engine's sources, or None (logged with the URL and the cause)."""
    try:
        found = await discover(url, target_ports=target_ports)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        if attempts < 3 or attempts % 20 == 0:
            log.warning("engine %s: %s not reachable (%s: %s); retrying in the background",
                        url, DISCOVERABLE[0].discovery_path, type(exc).__name__, exc)
        return None
    if not found:
        if attempts < 3 or attempts % 20 == 0:
            log.warning("engine %s lists no KV-event publisher in %s; asking again later", url,
                        DISCOVERABLE[0].discovery_path)
        return None
    log.info("discovered %d event source(s) from %s", len(found), url)
    return found
