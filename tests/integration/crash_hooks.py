"""A hooks plugin (kv_preflight/index/hooks.py) for the crash tests (tests/integration/test_cluster.py): a process
started with ``KVPF_TEST_HOOKS=tests.integration.crash_hooks`` and ``KVPF_TEST_CRASH_AT=pod_step:N`` (or
``effects:N``) ends (exit 137, as kill -9 would) right after the step that holds its N-th batch. Counts batches,
not calls: under load the ingester sends several batches in one call, and a count of calls would then never
reach N."""
from __future__ import annotations

import logging
import os

from kv_preflight.index import hooks

log = logging.getLogger("kvpf.index")

point, _, n = os.environ.get("KVPF_TEST_CRASH_AT", "").partition(":")
left = int(n or 1)


def crash_after(at: str, batches: int) -> None:
    global left
    if at == point and batches:
        left -= batches
        if left <= 0:
            log.error("KVPF_TEST_CRASH_AT: exiting after %s", at)
            os._exit(137)


if point in ("pod_step", "effects"):
    hooks.after_step = crash_after
