"""Whether each event stream is alive: which sources have been silent for longer than their usual gap.

A connection can go dead without a word: a middlebox drops the engine's half and leaves ours open and silent
(a NAT or conntrack timeout, an engine host that came back on the same address), or a path partitions. ZMTP
heartbeats notice that (ingester/sources.py ``Liveness``); this is the second check, for a stream that delivers
nothing while its socket looks connected: a source silent for ``silence_s`` and ``SILENCE_FACTOR`` times its usual
gap is probed, its replay socket asked for the seq after the last one received (ingester/resume.py
``probe_silent``): batches there that never came prove the stream dead. An engine that simply has nothing to
publish answers with no batch, and is probed again only after as long a silence again.

Pure state and rules; the probe's I/O is the resume's, the reconnect the subscriber's.
"""
from __future__ import annotations

from dataclasses import dataclass

SILENCE_FACTOR = 4.0  # silent this many times its usual gap (and ``silence_s``): probed
GAP_WEIGHT = 0.2  # the usual gap is a moving average: each new gap weighs this much


@dataclass
class _Stream:
    last_frame: float
    gap_s: float | None = None  # the moving average of the gaps between its frames
    probed_at: float = 0.0


class StreamWatch:
    """Per source endpoint, when its last frame came and its usual gap; per (pod, rank), the last seq received."""

    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s  # 0: no probing
        self.streams: dict[str, _Stream] = {}
        self.received: dict[tuple[str, int], int] = {}  # (pod, rank) -> the highest seq its stream delivered

    def frame(self, endpoint: str, now: float) -> None:
        """A frame arrived on this source (any frame: the stream delivers)."""
        stream = self.streams.get(endpoint)
        if stream is None:
            self.streams[endpoint] = _Stream(last_frame=now)
            return
        gap = now - stream.last_frame
        stream.gap_s = gap if stream.gap_s is None else (1 - GAP_WEIGHT) * stream.gap_s + GAP_WEIGHT * gap
        stream.last_frame = now

    def batch(self, pod: str, rank: int, seq: int) -> None:
        """A batch of this pod's rank arrived on its stream (seqs may come out of order after an engine restart)."""
        key = (pod, rank)
        if seq > self.received.get(key, -1) or seq == 0:
            self.received[key] = seq

    def threshold_s(self, endpoint: str) -> float | None:
        """How long this source may stay silent before it is probed; None: never (off, or no frame yet)."""
        stream = self.streams.get(endpoint)
        if not self.silence_s or stream is None:
            return None
        return max(self.silence_s, SILENCE_FACTOR * (stream.gap_s or 0.0))

    def due(self, endpoint: str, now: float) -> bool:
        """Silent past its threshold, and not probed within as long: probe it now (and note that it was)."""
        limit = self.threshold_s(endpoint)
        if limit is None:
            return False
        stream = self.streams[endpoint]
        if now - stream.last_frame < limit or now - stream.probed_at < limit:
            return False
        stream.probed_at = now
        return True

    def forget(self, endpoints: set[str]) -> None:
        for endpoint in endpoints:
            self.streams.pop(endpoint, None)
