"""Where this predictor process sent each prefix lately: the hint the route rule places new prefixes by.

The index says which pods hold a prompt's blocks, not how crowded each pod's cache is: once warm,
every engine's pool is full (cached blocks stay until evicted), so its block count says nothing,
and KV usage counts only blocks of running requests. A prefix nobody holds is a lasting choice
(every later request of it follows the cache), and what it consumes is cache room; so the rule
(predictor/scoring/route.py) sends it where the fewest blocks of *other live prefixes* already live, which
is what SGLang's cache-aware router does with its per-worker trees (the smallest tree takes a
request with no good match). Placing by load alone, or by a hash of the prefix, leaves some pods
with more prefixes than fit and others with room (five tenants' prompts on a pod that holds four
evict each other while a neighbour has room to spare).

Each prefix (its first request key) has one *home*: the pod its last request found it on, or the
pod it was placed on. A pod's footprint is the sum of its homes' sizes in blocks (the cached
length when last seen on it; the prompt's length when just placed), over prefixes seen within
``window_s``; older ones are taken as gone (evicted or cold). A prefix placed less than
``pending_s`` ago that no pod shows yet is *pending*: its first blocks are still being computed or
ingested, and a second request of it goes to the same pod instead of being placed again
(concurrent first requests of a new tenant would otherwise all see "no overlap" and spread).

Soft state, per process: predictors are stateless processes behind a load balancer, so each one
sees its share of the traffic; the footprints are then a sample of the fleet's (proportional when
the balancer spreads evenly), a restart forgets them (the rule falls back to load, then the
prefix's rendezvous hash), and nothing depends on two processes agreeing.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

MAX_PREFIXES = 100_000  # bound on remembered prefixes (about 100 B each); the least recently seen go first


@dataclass
class _Home:
    pod: str
    blocks: int
    placed_at: float  # when it was last placed on a pod nobody else held it on
    seen_at: float


@dataclass(frozen=True)
class PlacementHint:
    """What the route rule needs: other prefixes' blocks homed per candidate, and this prefix's pending pod."""
    footprints: dict[str, int] = field(default_factory=dict)
    pending: str | None = None


class PrefixPlacements:
    def __init__(self, *, window_s: float, pending_s: float, max_prefixes: int = MAX_PREFIXES,
                 clock: Callable[[], float] = time.monotonic):
        self.window_s, self.pending_s, self.max_prefixes, self.clock = window_s, pending_s, max_prefixes, clock
        self._homes: OrderedDict[int, _Home] = OrderedDict()  # least recently seen first
        self._blocks: dict[str, int] = {}  # pod -> sum of its homes' blocks

    def hint(self, prefix: int, pods: Collection[str]) -> PlacementHint:
        now = self.clock()
        self._expire(now)
        home = self._homes.get(prefix)
        footprints = {p: self._blocks.get(p, 0) for p in pods}
        if home is not None and home.pod in footprints:
            footprints[home.pod] -= home.blocks  # the prefix's own blocks do not crowd it out of its home
        pending = home.pod if home is not None and now - home.placed_at < self.pending_s else None
        return PlacementHint(footprints, pending)

    def seen(self, prefix: int, pod: str, blocks: int) -> None:
        """A request found the prefix cached on ``pod`` (``blocks`` long): that is its home now."""
        home = self._homes.get(prefix)
        self._put(prefix, pod, blocks, home.placed_at if home is not None and home.pod == pod else float("-inf"))

    def placed(self, prefix: int, pod: str, blocks: int) -> None:
        """A request of a prefix nobody holds was sent to ``pod``: pending there for ``pending_s``,
        unless it already was (a later request of a pending prefix does not restart the wait)."""
        home = self._homes.get(prefix)
        now = self.clock()
        if home is not None and home.pod == pod and now - home.placed_at < self.pending_s:
            self._put(prefix, pod, max(blocks, home.blocks), home.placed_at)
        else:
            self._put(prefix, pod, blocks, now)

    def _put(self, prefix: int, pod: str, blocks: int, placed_at: float) -> None:
        self._drop(prefix)
        self._homes[prefix] = _Home(pod, blocks, placed_at, self.clock())
        self._blocks[pod] = self._blocks.get(pod, 0) + blocks
        while len(self._homes) > self.max_prefixes:
            self._drop(next(iter(self._homes)))

    def _drop(self, prefix: int) -> None:
        home = self._homes.pop(prefix, None)
        if home is None:
            return
        left = self._blocks[home.pod] - home.blocks
        if left:
            self._blocks[home.pod] = left
        else:
            del self._blocks[home.pod]

    def _expire(self, now: float) -> None:
        while self._homes:
            prefix, home = next(iter(self._homes.items()))
            if now - home.seen_at < self.window_s:
                return
            self._drop(prefix)
