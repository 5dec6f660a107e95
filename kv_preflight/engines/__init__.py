"""Engine adapters: one module per engine family, each an ``Engine`` (kv_preflight/engines/base.py).

``engine(name)`` is how the rest of the tree finds one; ``ENGINES`` lists them for flags and docs.
"""
from __future__ import annotations

from kv_preflight.engines import sglang, trtllm, vllm
from kv_preflight.engines.base import Engine, LoadMetrics

ENGINES: dict[str, Engine] = {e.name: e for e in (vllm.ENGINE, sglang.ENGINE, trtllm.ENGINE)}
DEFAULT = vllm.ENGINE.name


def engine(name: str | None) -> Engine:
    """The adapter for ``name`` (vLLM when None); ValueError naming the known ones otherwise."""
    try:
        return ENGINES[name or DEFAULT]
    except KeyError:
        raise ValueError(f"engine {name!r} is not one of {', '.join(sorted(ENGINES))}") from None


__all__ = ["ENGINES", "Engine", "LoadMetrics", "engine"]
