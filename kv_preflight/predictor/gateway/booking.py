"""The gateway's bookings: each forwarded request's cost booked on its pod in Valkey until it completes.

A request's cost is the work it brings the engine: its prompt's tokens not cached there (the decision's
prediction) plus the tokens it will decode (its ``max_tokens``, else ``--gateway-decode-tokens``). The booking
is written as the request goes out, without holding it up (the write runs beside the upstream request; until
it lands this process counts it itself: predictor/routed.py), renewed every third of its TTL while the request
runs, and released when it ends, however it ends. Releases wait up to ``RELEASE_AFTER_S`` for company (the next
booking's write, or each other): one write and one script call per pod where each was one, a finished request's
cost counted a few ms longer. A gateway that dies stops renewing: its bookings expire
after ``--gateway-booking-ttl`` seconds (kv_preflight/index/lua/booked.lua drops them on the pod's next
operation). A failed write is counted and logged, never the request's failure.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.routed import RoutedStore
from kv_preflight.predictor.routed import RoutedState

log = logging.getLogger("kvpf.gateway")

ERROR_LOG_S = 10.0
RELEASE_AFTER_S = 0.005  # a release waits at most this long to go with others (see the module's docstring)


@dataclass
class Booking:
    pod: str
    id: str
    tokens: int
    written: asyncio.Future | None = None


class Bookings:
    def __init__(self, store: RoutedStore, state: RoutedState, ttl_s: float, timeout_s: float = 2.0):
        self.store, self.state, self.ttl_ms, self.timeout_s = store, state, int(ttl_s * 1000), timeout_s
        self.prefix = os.urandom(6).hex()  # this process's bookings: ids no other gateway draws
        self.count = 0
        self.live: dict[str, dict[str, int]] = {}  # pod -> booking id -> tokens, written or on its way
        self.errors = 0
        self._logged_at = float("-inf")
        self.tasks: set[asyncio.Future] = set()
        self._releases: dict[str, list[str]] = {}  # pod -> booking ids released, not sent yet
        self._release_timer: asyncio.TimerHandle | None = None

    def book(self, pod: str, tokens: int) -> Booking:
        """Book ``tokens`` on ``pod``, written in the background (in this turn of the loop: with the request's
        speculative entries, written as its bytes go out, one send)."""
        self.count += 1
        booking = Booking(pod, f"{self.prefix}:{self.count}", max(0, int(tokens)))
        self.live.setdefault(pod, {})[booking.id] = booking.tokens
        self.state.unwritten(pod, 1, booking.tokens)
        self._send_releases()  # written in the same turn of the loop as the booking: one send
        sent = self.store.book_now(pod, booking.id, booking.tokens, self.ttl_ms)
        if sent is None:  # (no lean connection open: a task writes it)
            booking.written = self._spawn(self._write(booking))
            return booking
        booking.written = self._track(sent, lambda: self.state.unwritten(pod, -1, -booking.tokens))
        return booking

    def _track(self, sent: asyncio.Future, then=None) -> asyncio.Future:
        """A write sent already (no task): ``then`` once it is answered or failed, a failure counted as ``_call``'s
        are. No deadline of its own: a Valkey gone quiet fails it when the lean connection is dropped."""
        def done(f: asyncio.Future) -> None:
            self.tasks.discard(f)
            if then is not None:
                then()
            if not f.cancelled() and (exc := f.exception()) is not None:
                self._failed(exc)

        self.tasks.add(sent)
        sent.add_done_callback(done)
        return sent

    async def _write(self, booking: Booking) -> None:
        try:
            await self._call(self.store.book(booking.pod, booking.id, booking.tokens, self.ttl_ms))
        finally:
            self.state.unwritten(booking.pod, -1, -booking.tokens)

    def release(self, booking: Booking) -> None:
        """The request ended: its booking goes once written, with the next booking's write or within
        ``RELEASE_AFTER_S`` (no wait for the caller)."""
        pod = self.live.get(booking.pod)
        if pod is not None:
            pod.pop(booking.id, None)
            if not pod:
                del self.live[booking.pod]
        if booking.written is None or booking.written.done():
            self._queue_release(booking)
        else:
            booking.written.add_done_callback(lambda _: self._queue_release(booking))

    def _queue_release(self, booking: Booking) -> None:
        self._releases.setdefault(booking.pod, []).append(booking.id)
        if self._release_timer is None:
            self._release_timer = asyncio.get_running_loop().call_later(RELEASE_AFTER_S, self._send_releases)

    def _send_releases(self) -> None:
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._release_timer = None
        if self._releases:
            releases, self._releases = self._releases, {}
            sent = self.store.release_now(releases)
            if sent is not None:
                self._track(sent)
            else:
                self._spawn(self._call(self.store.release_many(releases)))

    async def run(self) -> None:
        """Renew every live booking each third of the TTL, in one round trip (per shard)."""
        while True:
            await asyncio.sleep(self.ttl_ms / 3000)
            live = {pod: list(ids) for pod, ids in self.live.items() if ids}
            if live:
                await self._call(self.store.renew(live, self.ttl_ms))

    async def _call(self, work) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await work
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_S:
            self._logged_at = now
            log.warning("bookings: a write to Valkey failed (%d so far; the requests go on, their bookings "
                        "expire by TTL): %s: %s", self.errors, type(exc).__name__, exc)

    def _spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def aclose(self) -> None:
        """Release what is still booked (a clean stop leaves no booking to expire) and wait for the writes."""
        for pod, ids in list(self.live.items()):
            for booking_id, tokens in list(ids.items()):
                self.release(Booking(pod, booking_id, tokens))
        if self.tasks:  # bookings still being written: their releases queue once they are
            await asyncio.wait(list(self.tasks), timeout=self.timeout_s)
        self._send_releases()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.timeout_s)
