"""What routing knows from the requests it sent, beside what the engines' events say: the predictor's side.

The index says what the engines cached, as their events report it. A component in the request path (the
gateway, kv_preflight/predictor/gateway/) also knows what it just sent where, before any event says so:

* a pod that failed a request (connection refused, a 5xx before the first byte) is *avoided* for a while by
  the process that saw it fail: routes leave it out while another candidate is left.

Soft state, per process; what every gateway must see alike lives in Valkey (docs/gateway.md).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field


@dataclass
class RoutedState:
    clock: Callable[[], float] = time.monotonic
    _avoided: dict[str, float] = field(default_factory=dict)  # pod -> until (monotonic)

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
