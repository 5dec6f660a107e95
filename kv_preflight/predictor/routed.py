"""What routing knows from the requests it sent, beside what the engines' events say: the predictor's side.

The index says what the engines cached, as their events report it. A component in the request path (the
gateway, kv_preflight/predictor/gateway/) also knows what it just sent where, before any event or scrape says so:

* a pod that failed a request (connection refused, a 5xx before the first byte) is *avoided* for a while by
  the process that saw it fail: routes leave it out while another candidate is left (soft state, per process);
* the requests every gateway has in flight, *booked* per pod in Valkey (kv_preflight/index/routed.py): a route
  reads the candidates' bookings and counts them as load (predictor/scoring/route.py), so N gateways deciding
  between two metric scrapes see each other's requests.

The bookings are read beside the lookup: a route starts the read of the pods its model's last route had as
candidates before the lookup, in one pipelined round trip of its own that runs while the lookup does, and
reads any candidate it did not foresee after (a new pod, a model's first route). This process's own bookings
that are not written yet count too, so two of its requests a moment apart see each other.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.routed import Booked, RoutedStore

log = logging.getLogger("kvpf.predictor")

READ_ERROR_LOG_S = 10.0  # a failing read of bookings: one log line a while, a counter for each


@dataclass
class RoutedState:
    clock: Callable[[], float] = time.monotonic
    store: RoutedStore | None = None  # None: bookings are neither written nor read (serve)
    deadline_s: float = 2.0
    read_errors: int = 0
    _avoided: dict[str, float] = field(default_factory=dict)  # pod -> until (monotonic)
    _hint: dict[str, frozenset[str]] = field(default_factory=dict)  # model -> its last route's candidates
    _unwritten: dict[str, list[int]] = field(default_factory=dict)  # pod -> [requests, tokens] booked here, unwritten
    _error_logged_at: float = float("-inf")

    # ---- pods that failed here

    def avoid(self, pod: str, seconds: float) -> None:
        """Leave ``pod`` out of routes for ``seconds`` (it failed a request here)."""
        if seconds > 0:
            self._avoided[pod] = max(self._avoided.get(pod, 0.0), self.clock() + seconds)

    def avoided(self) -> frozenset[str]:
        if not self._avoided:
            return frozenset()
        now = self.clock()
        for pod in [p for p, until in self._avoided.items() if until <= now]:
            del self._avoided[pod]
        return frozenset(self._avoided)

    def usable(self, candidates: Collection[str]) -> set[str]:
        """The candidates not avoided, or all of them when every one is (a pod that failed beats no pod)."""
        out = set(candidates)
        left = out - self.avoided()
        return left or out

    # ---- bookings

    def start(self, model: str) -> "RoutedRead | None":
        """The read of a route's bookings, started now (beside the lookup) for the pods foreseen."""
        if self.store is None:
            return None
        return RoutedRead(self, model, self._hint.get(model, frozenset()))

    def unwritten(self, pod: str, requests: int, tokens: int) -> None:
        """A booking of this process on its way to Valkey (+1) or written or failed (-1): counted meanwhile."""
        counts = self._unwritten.setdefault(pod, [0, 0])
        counts[0] += requests
        counts[1] += tokens
        if counts[0] <= 0:
            del self._unwritten[pod]

    async def read(self, pods: Iterable[str]) -> dict[str, Booked] | None:
        """The pods' bookings, or None when Valkey did not answer (the route is decided without them)."""
        assert self.store is not None
        pods = list(pods)
        if not pods:
            return {}
        try:
            async with asyncio.timeout(self.deadline_s):
                return await self.store.booked(pods)
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self.read_errors += 1
            now = self.clock()
            if now - self._error_logged_at >= READ_ERROR_LOG_S:
                self._error_logged_at = now
                log.warning("bookings not readable, routes decided without them (%d so far): %s: %s",
                            self.read_errors, type(exc).__name__, exc)
            return None

    def with_unwritten(self, booked: dict[str, Booked]) -> dict[str, Booked]:
        for pod, (requests, tokens) in self._unwritten.items():
            if pod in booked:
                b = booked[pod]
                booked[pod] = Booked(b.requests + requests, b.tokens + tokens)
        return booked


class RoutedRead:
    """One route's read of bookings: started for the pods foreseen, completed for its actual candidates."""

    def __init__(self, state: RoutedState, model: str, pods: frozenset[str]):
        self.state, self.model, self.pods = state, model, pods
        self.task = asyncio.ensure_future(state.read(pods)) if pods else None

    async def complete(self, candidates: Collection[str]) -> dict[str, Booked] | None:
        got = await self.task if self.task is not None else {}
        missing = set(candidates) - self.pods
        if missing and got is not None:
            more = await self.state.read(missing)
            got = None if more is None else {**got, **more}
        self.state._hint[self.model] = frozenset(candidates)
        if got is None:
            return None
        return self.state.with_unwritten({p: got.get(p, Booked()) for p in candidates})
