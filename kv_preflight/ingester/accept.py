"""From a message to a batch to apply: decoded with its source's engine adapter, refused when its socket
may not write for its pod, its route noted. What cannot be decoded is counted and logged, never raised.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from kv_preflight.engines import engine
from kv_preflight.events import EventBatch
from kv_preflight.ingester.counters import Counters
from kv_preflight.ingester.liveness import StreamWatch
from kv_preflight.ingester.routes import Routes
from kv_preflight.ingester.sources import Source

log = logging.getLogger("kvpf.ingester")


class Accepted(NamedTuple):
    pod: str
    model: str
    seq: int
    batch: EventBatch
    decode_errors: int


class FrameAcceptor:
    def __init__(self, routes: Routes, counters: Counters, crowded: Callable[[Source], bool],
                 watch: StreamWatch | None = None):
        self.routes = routes
        self.counters = counters
        self.crowded = crowded  # the subscriber's: a pod= socket with several publishers connected
        self.watch = watch  # each stream's last frame and seqs (ingester/liveness.py)
        self._conflicts: set[tuple[str, int, str]] = set()  # (pod, rank, endpoint) refused as a second publisher

    async def accept(self, src: Source, frames: list[bytes]) -> Accepted | None:
        """Decode one message and note its route; None when it is dropped (counted)."""
        if self.crowded(src):
            # logged by the subscriber when the second publisher came
            await self.counters.count("frames_refused", endpoint=src.endpoint)
            return None
        if self.watch is not None:
            self.watch.frame(src.endpoint, time.monotonic())
        decoded = engine(src.engine).decode_frames(frames, topic=src.named_topic)
        if decoded.skipped:  # placeholder events name no block (vLLM's offloading connector): never an error
            await self.counters.count("placeholder_events", decoded.skipped)
        errors, count = decoded.errors, decoded.error_count
        if not errors and (decoded.topic is None or decoded.batch is None):
            # Well-formed for a replay reply (no topic, or the end marker) but not for a SUB socket:
            # dropped like any other undecodable message, and counted like one.
            errors, count = [f"a {len(frames)}-frame message with no kv@<pod>@<model> topic or no batch (a publisher "
                             "with an empty topic is named on its source: ...,pod=POD,model=MODEL)"], 1
        for err in errors:  # at most MAX_LISTED_ERRORS lines per message; the rest only counted
            log.warning("dropped from %s: %s", src.endpoint, err)
        if count:
            if decoded.more_errors:
                log.warning("dropped from %s: %d more event(s) of the same message", src.endpoint, decoded.more_errors)
            await self.counters.count("decode_errors", count)
        if decoded.topic is None or decoded.seq is None or decoded.batch is None:
            return None
        pod = src.pod or decoded.topic.pod_id
        if src.pods is not None and pod not in src.pods:
            # Not a pod this socket may write for (its pods= allowlist): forged or misrouted. Refused before
            # any route, state or key is touched; counted by socket, never by the (attacker-chosen) pod name.
            await self.counters.count("frames_refused", endpoint=src.endpoint)
            refused = self.counters.counts["frames_refused"]
            if refused <= 10 or refused % 1000 == 0:
                log.warning("refused from %s: pod %r is not in its pods= allowlist (%d frame(s) refused so far)",
                            src.endpoint, pod[:80], refused)
            return None
        rank = decoded.batch.data_parallel_rank or 0
        pod = self.routes.pod_name(src, pod, rank)
        if pod in self.routes.forgotten:  # unregistered or cleared with --forget: its keys are going
            await self.counters.count("frames_refused", endpoint=src.endpoint)
            return None
        holder = self.routes.publisher_of(pod, rank)  # (the index pod: a data-parallel rank's is its own)
        if holder is not None and holder != src.endpoint:
            await self._conflict(src, pod, rank, holder)
            return None
        await self.routes.write_aliases()
        route = await self.routes.note(src, pod, decoded.topic.model, rank)
        if self.watch is not None:
            self.watch.batch(pod, rank, decoded.seq)
        return Accepted(pod, route.model, decoded.seq, decoded.batch, count)

    async def _conflict(self, src: Source, pod: str, rank: int, holder: str) -> None:
        """A frame of a pod's rank that another socket of this ingester publishes already (two replicas given one
        topic pod id, each with its own --source or --bind): whose batch is whose cannot be told once they are in
        one seq, so the socket that published it first keeps it and the other's frames are refused, as two
        --engine sources of one pod are (docs/fleet.md). Counted once per (pod, rank, socket) as a pod conflict,
        every frame as refused; logged the first time and every 1000th frame."""
        await self.counters.count("frames_refused", endpoint=src.endpoint)
        key = (pod, rank, src.endpoint)
        if key not in self._conflicts:
            self._conflicts.add(key)
            await self.counters.count("pod_conflicts")
            log.error("refused from %s: pod %r rank %d is already published by %s here; two publishers of one pod "
                      "would corrupt it (give each engine its own pod id: its topic kv@POD@MODEL, or pod= on its "
                      "source)", src.endpoint, pod[:80], rank, holder)
        elif self.counters.counts["frames_refused"] % 1000 == 0:
            log.warning("refused from %s: pod %r rank %d still published by %s too (%d frame(s) refused so far)",
                        src.endpoint, pod[:80], rank, holder, self.counters.counts["frames_refused"])
