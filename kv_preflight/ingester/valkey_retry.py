"""Valkey calls on the write path, retried until Valkey answers.

ZMQ keeps buffering meanwhile, and replay covers what overflows it. An error reply that retrying cannot
change (see ``transient``) is raised to the caller, which gives up on that one batch, so a poisoned
batch never stalls the other pods.
"""
from __future__ import annotations

import asyncio
import time
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.exceptions import (AskError, ClusterDownError, NoScriptError, OutOfMemoryError, ReadOnlyError, ResponseError,
                              TryAgainError)

from kv_preflight.index.index import VALKEY_ERRORS

log = logging.getLogger("kvpf.ingester")

T = TypeVar("T")

# Error replies that a later retry can succeed past: the server is loading, busy with a script,
# out of memory for now, failing over, or the key moved to another shard.
_TRANSIENT_REPLIES = ("LOADING", "BUSY", "OOM", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY", "NOREPLICAS",
                      "MOVED", "ASK", "NOSCRIPT")


def transient(exc: BaseException) -> bool:
    """Worth retrying: connection trouble and timeouts, and the error replies above."""
    if isinstance(exc, (OutOfMemoryError, ReadOnlyError, ClusterDownError, AskError, TryAgainError, NoScriptError)):
        return True  # redis-py strips the code from these messages
    if isinstance(exc, ResponseError):
        return str(exc).split(" ", 1)[0].upper() in _TRANSIENT_REPLIES
    return True


async def sleep_backoff(attempt: int, cap_s: float = 5.0) -> None:
    await asyncio.sleep(min(cap_s, 0.05 * (2 ** min(attempt, 10))))


class ValkeyRetry:
    """``call`` retries a Valkey call with backoff until it answers, or until the ingester stops."""

    def __init__(self, stopping: asyncio.Event, on_error: Callable[[], None]):
        self.stopping = stopping
        self.on_error = on_error  # each failed attempt (counted as valkey_errors)
        self.failing_since: float | None = None  # monotonic time of the first failure of the call retrying now

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        attempt = 0
        while True:
            try:
                result = await fn(*args, **kwargs)
            except VALKEY_ERRORS as exc:
                if not transient(exc):
                    raise
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                self.on_error()
                if attempt == 0 or attempt % 20 == 0:
                    log.error("valkey unavailable (%s); retrying with backoff", exc)
                attempt += 1
                if self.stopping.is_set():
                    raise
                await sleep_backoff(attempt)
            else:
                self.failing_since = None
                return result
