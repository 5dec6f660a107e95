"""The write path's one hook point, for fault-injection tests; it does nothing in production.

``after_step(point, batches)`` runs right after each step of a cluster run (kv_preflight/index/cluster/writes.py):
``"pod_step"`` once the pod steps of ``batches`` batches are in their outboxes, ``"effects"`` once their changes
ran and before their entries are deleted: the two places a kill -9 leaves a batch half applied. A test replaces
it through a plugin module a process imports at start (``load_plugin``: the module named by ``KVPF_TEST_HOOKS``),
so no test's switch is read on the write path (tests/integration/crash_hooks.py ends the process there, as kill -9
would)."""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping


def _nothing(point: str, batches: int) -> None:
    return None


after_step: Callable[[str, int], None] = _nothing


def load_plugin(env: Mapping[str, str] = os.environ) -> None:
    """Import the module ``KVPF_TEST_HOOKS`` names, if any: it sets the hooks it wants."""
    name = env.get("KVPF_TEST_HOOKS", "")
    if name:
        importlib.import_module(name)


__all__ = ["after_step", "load_plugin"]
