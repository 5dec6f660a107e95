"""What routing knows from the requests it sent, beside what the engines' events say: the predictor's side.

The index says what the engines cached, as their events report it. A component in the request path (the
gateway, kv_preflight/predictor/gateway/) also knows what it just sent where, before any event or scrape says so:

* a pod that failed a request (connection refused, a 5xx before the first byte) is *avoided* for a while by
  the process that saw it fail: routes leave it out while another candidate is left (soft state, per process);
* the requests every gateway has in flight, *booked* per pod in Valkey (kv_preflight/index/routed.py): a route
  reads the candidates' bookings and counts them as load (predictor/scoring/route.py), so N gateways deciding
  between two metric scrapes see each other's requests;
* the prompts every gateway sent where, as *speculative* entries (their blocks count on the pod for a short
  TTL, until its events confirm them) and, for engines that publish no events, as an *approximate* index
  (predictor/scoring/routed.py merges both into the lookup's matches); an approximate pod's freshness says so;
* the prefixes every gateway homed where within the placement window (``--route-placement-window``), each pod's
  *footprint*: a new prefix goes where the fewest blocks of others live (predictor/scoring/placement.py's rule,
  over the fleet's placements rather than one process's share of them); and a prefix homed on a pod within
  ``--route-pending`` that no pod shows yet is *pending* there for every gateway, not only the one that placed it;
  before its home lands, the new prefix's *claim* (``claim``) gives it one pod fleet-wide, and gives gateways
  placing distinct new prefixes at the same moment distinct pods.

All of it is read beside the lookup, in one pipelined round trip that runs while the lookup does: the pods
the predictor foresees as candidates (those its caches say serve the model), and after, any pod the lookup or
the candidates bring that was not foreseen. This process's own bookings that are not written yet count too,
so two of its requests a moment apart see each other.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.index.routed import Booked, PodRouted, RoutedStore, keys_blob, read_replies
from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.freshness import APPROXIMATE_POD, PodFreshness

log = logging.getLogger("kvpf.predictor")

READ_ERROR_LOG_S = 10.0  # a failing read of bookings: one log line a while, a counter for each
HOME_EVERY_S = 5.0  # a prefix's home is written again at most this often, unless its length changed
MAX_HOMED = 100_000  # homes this process remembers writing (the least recently written forgotten first)
CLAIM_MOMENT_MS = 1000  # a placement counts on its pod beside the footprints read for this long (its home's way there)
BOOKED_SEEN_S = 10.0  # how long each pod's booked requests, as this process read them, are remembered
SCRAPE_MATCH_S = 1.0  # bookings read at most this long before a scrape stand for what was booked when it was taken
BOOKED_STEP_S = 0.05  # one remembered value per pod per this long at most (the last read in it): a scrape's time
                      # is known to a tick, and a busy pod's bookings change every few ms


@dataclass
class RoutedState:
    clock: Callable[[], float] = time.monotonic
    store: RoutedStore | None = None  # None: bookings are neither written nor read (serve)
    deadline_s: float = 2.0
    read_errors: int = 0
    _avoided: dict[str, float] = field(default_factory=dict)  # pod -> until (monotonic)
    _unwritten: dict[str, list[int]] = field(default_factory=dict)  # pod -> [requests, tokens] booked here, unwritten
    # pods no ingester feeds, indexed approximately by what the gateways sent there, and their engine block size
    # when known (kv_preflight/predictor/gateway/approximate.py keeps both)
    approximate: frozenset[str] = frozenset()
    approximate_block_size: dict[str, int] = field(default_factory=dict)
    # the placement window (ms; 0: no footprints): prefixes homed on a pod within it make its footprint, read and
    # written fleet-wide (kv_preflight/index/routed.py homes) in place of this process's own placement memory
    window_ms: int = 0
    # a prefix homed on a pod less than this long ago (ms; --route-pending) by any gateway, and found nowhere, is
    # pending there: sent there again rather than placed anew (``pending``)
    pending_ms: int = 0
    _writes: set = field(default_factory=set)
    _homed: OrderedDict = field(default_factory=OrderedDict)  # (prefix, pod) -> (when written, blocks)
    # pod -> {prefix: [blocks, when written or None]}: new homes of ours on their way to Valkey, or written since a
    # read still in flight may have started (``with_unwritten``)
    _homing: dict = field(default_factory=dict)
    # pod -> [first read, last read, booked requests] for each value read in turn, oldest first (``booked_at``)
    _booked_seen: dict = field(default_factory=dict)
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

    def mark_approximate(self, per_pod: dict[str, PodFreshness]) -> dict[str, PodFreshness]:
        """An approximate pod's freshness is ``approximate`` (no lease lists it: it would read ``unknown``)."""
        if not self.approximate:
            return per_pod
        return {p: APPROXIMATE_POD if p in self.approximate else f for p, f in per_pod.items()}

    # ---- bookings, speculative and approximate entries: read beside the lookup

    def start(self, pods: Collection[str], keys: Sequence[int]) -> "RoutedRead | None":
        """The read of what was routed to ``pods`` for this prompt, started now (beside the lookup)."""
        if self.store is None:
            return None
        return RoutedRead(self, frozenset(pods), keys_blob(keys) if keys else b"", keys[0] if keys else None)

    def unwritten(self, pod: str, requests: int, tokens: int) -> None:
        """A booking of this process on its way to Valkey (+1) or written or failed (-1): counted meanwhile."""
        counts = self._unwritten.setdefault(pod, [0, 0])
        counts[0] += requests
        counts[1] += tokens
        if counts[0] <= 0:
            del self._unwritten[pod]

    async def read(self, pods: Iterable[str], blob: bytes = b"") -> dict[str, PodRouted] | None:
        """What was routed to the pods, or None when Valkey did not answer (decided without it, counted)."""
        assert self.store is not None
        pods = list(pods)
        if not pods:
            return {}
        try:
            async with asyncio.timeout(self.deadline_s):
                return await self.store.read(pods, blob, self.window_ms)
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self._failed(exc)
            return None

    async def replies(self, pods: Sequence[str], sent: asyncio.Future) -> dict[str, PodRouted] | None:
        """``read``'s answer from a read written already (``RoutedStore.read_now``)."""
        try:
            async with asyncio.timeout(self.deadline_s):
                return read_replies(pods, await sent)
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self._failed(exc)
            return None

    def home(self, prefix: int, pod: str, blocks: int) -> None:
        """``prefix`` routed to (or found on) ``pod``, ``blocks`` long: its home for every gateway's placements,
        written in the background (a failure costs placements a little accuracy, nothing else). Written again only
        when its length changed or ``HOME_EVERY_S`` passed: the window is a minute, a prompt's every request
        need not say so."""
        if self.store is None or self.window_ms <= 0:
            return
        now = self.clock()
        last = self._homed.get((prefix, pod))
        if last is not None and last[1] == blocks and now - last[0] < HOME_EVERY_S:
            return
        if last is None:  # counted in the pod's footprint here until every read sees it (``with_unwritten``)
            self._homing.setdefault(pod, {})[prefix] = [blocks, None]
        self._homed[(prefix, pod)] = (now, blocks)
        self._homed.move_to_end((prefix, pod))
        while len(self._homed) > MAX_HOMED:
            self._homed.popitem(last=False)
        task = asyncio.ensure_future(self._home(prefix, pod, blocks))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _home(self, prefix: int, pod: str, blocks: int) -> None:
        assert self.store is not None
        try:
            async with asyncio.timeout(self.deadline_s):
                await self.store.home(pod, prefix, blocks, self.window_ms)
        except (TimeoutError, *VALKEY_ERRORS):
            self.read_errors += 1
        finally:
            now = self.clock()
            if (homing := self._homing.get(pod)) is not None and (entry := homing.get(prefix)) is not None:
                entry[1] = now
            for pod_, homing in list(self._homing.items()):  # a read started before the write lasts its deadline
                for p in [p for p, (_, done) in homing.items() if done is not None and done < now - self.deadline_s]:
                    del homing[p]
                if not homing:
                    del self._homing[pod_]

    def pending(self, routed: Mapping[str, PodRouted] | None) -> str | None:
        """The pod any gateway homed this prompt's prefix on most lately, if within ``pending_ms``: a burst of a new
        prefix over N gateways goes to one pod, as it does through one (placement.py's ``pending``, whose memory is
        one process's), in the ms before the first request's speculative entries and events land."""
        if not routed or self.pending_ms <= 0:
            return None
        homed = [(r.homed_ms_ago, p) for p, r in routed.items() if 0 <= r.homed_ms_ago < self.pending_ms]
        return min(homed)[1] if homed else None

    async def claim(self, prefix: int, blocks: int, order: Sequence[tuple[str, int]]) -> str | None:
        """The pod the new prefix ``prefix`` goes to, claimed fleet-wide (kv_preflight/index/routed.py ``claim``) from
        ``order`` (rule 5's, with each pod's footprint), or the one a gateway placed it on within ``pending_ms``; None
        when not shared (no store, no pending window) or Valkey did not answer (the caller keeps its own choice,
        counted)."""
        if self.store is None or self.pending_ms <= 0 or len(order) < 2:
            return None
        try:
            async with asyncio.timeout(self.deadline_s):
                return await self.store.claim(prefix, blocks, order, self.pending_ms, CLAIM_MOMENT_MS)
        except (TimeoutError, *VALKEY_ERRORS) as exc:
            self._failed(exc)
            return None

    def _failed(self, exc: BaseException) -> None:
        self.read_errors += 1
        now = self.clock()
        if now - self._error_logged_at >= READ_ERROR_LOG_S:
            self._error_logged_at = now
            log.warning("what was routed is not readable, routes decided without it (%d so far): %s: %s",
                        self.read_errors, type(exc).__name__, exc)

    def with_unwritten(self, routed: dict[str, PodRouted], prefix: int | None = None,
                       read_at: float | None = None) -> dict[str, PodRouted]:
        """``routed`` with this process's bookings not written yet, and its new homes that the read (started at
        ``read_at``; None: now) may have missed, written after it started or not yet: two of its requests a moment
        apart see each other (a new prefix placed here a moment ago counts in its pod's footprint for the next one;
        ``prefix``, the prompt's own, aside, as the read leaves it aside)."""
        for pod, (requests, tokens) in self._unwritten.items():
            if pod in routed:
                r = routed[pod]
                routed[pod] = msgspec.structs.replace(
                    r, booked=Booked(r.booked.requests + requests, r.booked.tokens + tokens))
        read_at = self.clock() if read_at is None else read_at
        for pod, homing in self._homing.items():
            if pod in routed and (blocks := sum(b for p, (b, done) in homing.items()
                                                if p != prefix and (done is None or done > read_at))):
                routed[pod] = msgspec.structs.replace(routed[pod], footprint=routed[pod].footprint + blocks)
        return routed

    # ---- the bookings when a pod was scraped: how much of the scrape has ended since

    def saw_booked(self, routed: Mapping[str, PodRouted]) -> None:
        now = self.clock()
        for pod, r in routed.items():
            seen = self._booked_seen.get(pod)
            if seen is None:
                seen = self._booked_seen[pod] = deque()
            if seen and (seen[-1][2] == r.booked.requests or now - seen[-1][0] < BOOKED_STEP_S):
                seen[-1][1:] = now, r.booked.requests  # the same value read again, or a newer one within the step
            else:
                seen.append([now, now, r.booked.requests])
            while len(seen) > 1 and seen[1][0] <= now - BOOKED_SEEN_S:
                seen.popleft()

    def booked_at(self, pod: str, when: float) -> int | None:
        """The requests booked on ``pod`` at ``when`` as this process read them: the value read last at or before
        it, if that read was less than ``SCRAPE_MATCH_S`` before it (None: not read about then)."""
        for first, last, n in reversed(self._booked_seen.get(pod, ())):  # the scrape is recent: from the newest
            if first <= when:
                return n if when - last <= SCRAPE_MATCH_S else None
        return None

    def booked_at_scrape(self, loads: Mapping[str, PodLoad | None]) -> dict[str, int]:
        """Each scraped pod's bookings when its load was scraped, where this process read them then (route.py
        takes the scrape less the gateways' requests that ended since: scoring/routed.py ``load_now``)."""
        out = {}
        for pod, ld in loads.items():
            if ld is not None and (n := self.booked_at(pod, ld.at)) is not None:
                out[pod] = n
        return out


class RoutedRead:
    """One request's read of what was routed: started for the pods foreseen, extended to any pod found after."""

    def __init__(self, state: RoutedState, pods: frozenset[str], blob: bytes, prefix: int | None = None):
        self.state, self.pods, self.blob, self.prefix = state, pods, blob, prefix
        self.started = state.clock()
        # written now, beside the lookup: on the lean connection without a task (one on the gateway's path is a turn
        # of the loop or two once the replies are in), else in one
        self.asked = list(pods)
        self.sent = state.store.read_now(self.asked, blob, state.window_ms) if pods and state.store else None
        self.task = asyncio.ensure_future(state.read(pods, blob)) if pods and self.sent is None else None
        self.got: dict[str, PodRouted] | None = None

    async def get(self, pods: Collection[str] = ()) -> dict[str, PodRouted] | None:
        """The foreseen pods' and ``pods``' (read now if not foreseen); None when Valkey did not answer."""
        if self.got is None:
            if self.sent is not None:
                self.got = await self.state.replies(self.asked, self.sent)
            else:
                self.got = (await self.task if self.task is not None else {})
            if self.got is None:
                return None
        missing = set(pods) - self.pods
        if missing:
            more = await self.state.read(missing, self.blob)
            if more is None:
                return None
            self.got.update(more)
            self.pods = self.pods | missing
        return self.got

    async def for_route(self, candidates: Collection[str]) -> dict[str, PodRouted] | None:
        """Every candidate's bookings (this process's unwritten ones added) and footprint; None: not readable."""
        got = await self.get(candidates)
        if got is None:
            return None
        routed = self.state.with_unwritten({p: got.get(p, PodRouted()) for p in candidates}, self.prefix, self.started)
        self.state.saw_booked(routed)  # what was booked where, now: for the scrapes taken about now (``booked_at``)
        return routed
