"""Engine adapters: one module per engine family, each an ``Engine`` (kv_preflight/engines/base.py).

``engine(name)`` is how the rest of the tree finds one; ``ENGINES`` lists them for flags and docs.
``DEFAULT`` is the family assumed where nothing names one: a ``--source`` without ``engine=``, and the
engines the predictor and ``diagnose fleet`` read (``--engine-url``, ``--pod-metrics``).
"""
from __future__ import annotations

from kv_preflight.engines import sglang, trtllm, vllm
from kv_preflight.engines.base import BlockExtras, Engine, ExtraKeys, LoadMetrics, PrefixCacheMetrics, Publisher

ENGINES: dict[str, Engine] = {e.name: e for e in (vllm.ENGINE, sglang.ENGINE, trtllm.ENGINE)}
DEFAULT = vllm.ENGINE.name


def engine(name: str | None) -> Engine:
    """The adapter for ``name`` (vLLM when None); ValueError naming the known ones otherwise."""
    try:
        return ENGINES[name or DEFAULT]
    except KeyError:
        raise ValueError(f"engine {name!r} is not one of {', '.join(sorted(ENGINES))}") from None


__all__ = ["DEFAULT", "ENGINES", "BlockExtras", "Engine", "ExtraKeys", "LoadMetrics", "PrefixCacheMetrics", "Publisher", "engine"]
