"""What every engine family must say about itself, in one shape: the seam a new engine plugs into.

An engine family (vLLM, SGLang, TensorRT-LLM) differs from the others in a handful of places only:
how its KV events lie on the wire (``WireLayout``), whether its replay replies carry the topic frame,
the block size it uses by default, where it advertises its publishers, which Prometheus series say how
busy it is, and where it tokenizes. Everything else (frames, seqs, replay, the bridge to request keys,
the index) is common, so adding an engine is one module here that fills an ``Engine``, plus fixtures.

The topic ``kv@<pod>@<model>`` (llm-d's convention, which all three accept but none sets by default)
is parsed in one place, kv_preflight/events.py ``parse_topic``; a publisher with an empty or foreign topic
is named on the ingester's command line instead (``--source ENDPOINT,pod=P,model=M,engine=E``).
"""
from __future__ import annotations

from dataclasses import dataclass

from kv_preflight.events import DecodedFrame, Topic, WireLayout, decode_frames


@dataclass(frozen=True)
class LoadMetrics:
    """Prometheus series that say how busy an engine is (see predictor/load.py, which reads vLLM's)."""

    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # first found wins: newer name first
    prefix: str  # every series of the engine starts with it (a cheap filter before parsing a line)


@dataclass(frozen=True)
class Engine:
    name: str
    layout: WireLayout
    replay_topic: bool  # replay replies carry the topic frame (``["", topic, seq, payload]``)
    default_block_size: int  # tokens per engine block unless configured (the events carry the real one)
    discovery_path: str | None  # HTTP path that lists its KV-event publishers, if the engine has one
    load_metrics: LoadMetrics | None
    tokenize_path: str | None  # HTTP path of its tokenizer, if it serves one
    since: str  # first version whose events this adapter reads

    def decode_frames(self, frames: list[bytes], topic: Topic | None = None) -> DecodedFrame:
        """One message in this engine's layout; never raises (see kv_preflight/events.py decode_frames)."""
        return decode_frames(frames, self.layout, topic=topic)
