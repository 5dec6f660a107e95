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


# Valkey takes our writes again once calls have been answering for this long, none failing and none retrying:
# one call that gets through does not say so. At maxmemory under noeviction the used memory moves around the
# limit (client buffers), so one write in a few passes: a batch applied, or a read answered, between failures
# had set the state "current" for the lease written at that moment, and answers said "exact" for its whole TTL
# while every batch after it failed. (A retry's attempts are seconds apart by then: "no failure for a while" alone
# would end the failing at the first one that gets through.)
RECOVERED_S = 2.0


class ValkeyRetry:
    """``call`` retries a Valkey call with backoff until it answers, or until the ingester stops; and says whether
    Valkey is failing our calls (``failing``) and since when (``failing_since``), for the lease's account of
    this ingester's ingestion (ingester/ingester.py ``ingest_state``)."""

    def __init__(self, stopping: asyncio.Event, on_error: Callable[[], None]):
        self.stopping = stopping
        self.on_error = on_error  # each failed attempt (counted as valkey_errors)
        # monotonic time the failing period began: the first failure after RECOVERED_S without one
        self.failing_since: float | None = None
        self.last_failure: float | None = None
        self.answering_since: float | None = None  # the first call answered after the last failure
        self._retrying = 0  # calls retrying now (each from its first failure until it answers or gives up)

    def failing(self, now: float | None = None) -> bool:
        """A call is retrying, or one failed less than RECOVERED_S ago, or calls have been answering again for less
        than that."""
        if self._retrying:
            return True
        if self.last_failure is None:
            return False
        now = time.monotonic() if now is None else now
        since = self.answering_since if self.answering_since is not None else self.last_failure
        return now - since < RECOVERED_S

    def failing_for(self, now: float | None = None) -> float | None:
        """How long Valkey has been failing our calls (through any success between failures), None if it is not."""
        now = time.monotonic() if now is None else now
        if not self.failing(now) or self.failing_since is None:
            return None
        return now - self.failing_since

    def note_failure(self, now: float | None = None) -> None:
        """A call failed (a transient error): a failing period begins, or goes on."""
        now = time.monotonic() if now is None else now
        if not self.failing(now):
            self.failing_since = now
        self.last_failure = now
        self.answering_since = None

    def note_answer(self) -> None:
        """A call answered: after a failure, the first such answer starts the RECOVERED_S that end the failing."""
        if self.answering_since is None and self.last_failure is not None:
            self.answering_since = time.monotonic()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        attempt = 0
        try:
            while True:
                try:
                    result = await fn(*args, **kwargs)
                except VALKEY_ERRORS as exc:
                    if not transient(exc):
                        raise
                    self.note_failure()
                    if attempt == 0:
                        self._retrying += 1
                    self.on_error()
                    if attempt == 0 or attempt % 20 == 0:
                        log.error("valkey unavailable (%s); retrying with backoff", exc)
                    attempt += 1
                    if self.stopping.is_set():
                        raise
                    await sleep_backoff(attempt)
                else:
                    self.note_answer()
                    return result
        finally:
            if attempt:
                self._retrying -= 1
