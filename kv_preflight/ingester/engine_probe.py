"""What the primary owner of an engine asks it over HTTP each round, in the background: ``/health``, then from a
healthy engine its load (``/metrics``, the engine and each data-parallel rank) and, now and then, its models
(``/v1/models``: the base model, then its LoRA adapters)."""
from __future__ import annotations

import httpx

from kv_preflight.engines import engine
from kv_preflight.engines.load_metrics import parse_load, parse_rank_loads

Load = tuple[tuple[float, float, float], dict[int, tuple[float, float, float]]]  # (the engine's, each rank's)


async def probe(http: httpx.AsyncClient, url: str, family: str,
                with_models: bool) -> tuple[bool, str, Load | None, list[str] | None]:
    """(healthy, why not, load from /metrics, models from /v1/models): ``/health`` answering 200 is
    healthy; load and models are read only from a healthy engine."""
    try:
        resp = await http.get(url + "/health")
        if resp.status_code != 200:
            return False, f"/health answered {resp.status_code}", None, None
    except (httpx.HTTPError, OSError) as exc:
        return False, f"{type(exc).__name__}: {exc}"[:200], None, None
    try:
        names = engine(family).load_metrics  # None: the engine exports no Prometheus load series
        resp = await http.get(url + "/metrics") if names else None
        total = parse_load(resp.text, names) if resp is not None and resp.status_code == 200 else None
        load = None if total is None else (total, parse_rank_loads(resp.text, names))
    except (httpx.HTTPError, OSError):
        load = None
    return True, "", load, (await models(http, url) if with_models else None)


async def models(http: httpx.AsyncClient, url: str) -> list[str] | None:
    """Base model first, then the LoRA adapters (vLLM lists an adapter with its base as ``parent``)."""
    try:
        resp = await http.get(url + "/v1/models")
        data = resp.json().get("data", []) if resp.status_code == 200 else []
    except (httpx.HTTPError, OSError, ValueError, AttributeError):
        return None
    cards = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] if isinstance(data, list) else []
    bases = [m["id"] for m in cards if not m.get("parent")]
    return bases + [m["id"] for m in cards if m["id"] not in bases] or None


__all__ = ["Load", "models", "probe"]
