"""What every engine family must say about itself, in one shape: the seam a new engine plugs into.

An engine family (vLLM, SGLang, TensorRT-LLM) differs from the others in a handful of places only:
how its KV events lie on the wire (``WireLayout``), whether its replay replies carry the topic frame,
the block size it uses by default, where it advertises its publishers and how that answer reads
(``Publisher``), which Prometheus series say how busy it is, and where it tokenizes. Everything else
(frames, seqs, replay, the bridge to request keys, the index) is common, so adding an engine is one
module here that fills an ``Engine``, plus fixtures.

The topic ``kv@<pod>@<model>`` (llm-d's convention, which all three accept but none sets by default)
is parsed in one place, kv_preflight/events.py ``parse_topic``; a publisher with an empty or foreign topic
is named on the ingester's command line instead (``--source ENDPOINT,pod=P,model=M,engine=E``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_preflight.events import DecodedFrame, Topic, WireLayout, decode_frames


@dataclass(frozen=True)
class LoadMetrics:
    """Prometheus series that say how busy an engine is (see predictor/load.py, which reads vLLM's)."""

    running: str
    waiting: str
    kv_usage: tuple[str, ...]  # first found wins: newer name first
    prefix: str  # every series of the engine starts with it (a cheap filter before parsing a line)


@dataclass(frozen=True)
class PrefixCacheMetrics:
    """Prometheus counters of the engine's own prefix-cache lookups, in tokens (``diagnose fleet``)."""

    queries: str  # tokens looked up
    hits: str  # of which found cached
    prefix: str  # both start with it


@dataclass(frozen=True)
class BlockExtras:
    """What one engine block's extra keys say beside its tokens and its LoRA adapter (which names the model)."""

    # what keys the block beside its tokens, in the engine's order: multimodal identifiers (their offsets
    # dropped, as llm-d keys them), prompt-embeds digests (hex); each becomes llm-d's ``{"Hash": id}``
    ids: tuple[str, ...] = ()
    salt: str | None = None  # the cache salt (on a prompt's first block only)


@dataclass(frozen=True)
class ExtraKeys:
    """How the ``extra_keys`` of an engine's BlockStored events read, per engine block."""

    # (one block's extra keys, the event's lora_name) -> what they say; None when they say nothing beyond the
    # adapter (None or empty extra keys, an adapter's name alone): the bridge asks only for events whose blocks
    # carry extra keys
    read: Callable[[Any, "str | None"], "BlockExtras | None"]


@dataclass(frozen=True)
class Publisher:
    """One KV-event publisher (one data-parallel rank) as the engine's discovery answer lists it, made
    reachable from another host (kv_preflight/engines/endpoints.py): where to subscribe, and its names."""

    endpoint: str  # where to connect; with ``bind``, what to bind (the engine connects to it)
    bind: bool = False
    replay: str | None = None
    topic: str | None = None
    rank: int | None = None  # data-parallel rank (each rank has its own sockets)
    serving: str | None = None  # the rank's serving address "<ip>:<port>", llm-d-router's pod id
    pod: str | None = None  # pod and model, when the engine's topic does not name them
    model: str | None = None


# (engine URL, the JSON body of its discovery answer, ``ingest --target-ports``) -> its publishers, or None
# when the answer is not this engine's (the next engine's discovery path is asked then).
ReadPublishers = Callable[[str, Any, tuple[int, ...]], "list[Publisher] | None"]
# The JSON body of its discovery answer -> the pod id its topic names, if any (no I/O: the predictor's
# load monitor calls it on its loop).
ReadPodId = Callable[[Any], "str | None"]
# (model, prompt or chat messages) -> the JSON body of its tokenize request.
TokenizeBody = Callable[..., dict[str, Any]]


@dataclass(frozen=True)
class Engine:
    name: str
    layout: WireLayout
    replay_topic: bool  # replay replies carry the topic frame (``["", topic, seq, payload]``)
    default_block_size: int  # tokens per engine block unless configured (the events carry the real one)
    extra_keys: ExtraKeys | None  # how its events' extra_keys read (None: it sends none)
    discovery_path: str | None  # HTTP path that lists its KV-event publishers, if the engine has one
    read_publishers: ReadPublishers | None  # reads the answer at ``discovery_path``
    read_pod_id: ReadPodId | None  # reads the pod id in the answer at ``discovery_path``
    load_metrics: LoadMetrics | None
    prefix_cache_metrics: PrefixCacheMetrics | None
    tokenize_path: str | None  # HTTP path of its tokenizer, if it serves one
    tokenize_body: TokenizeBody | None  # the request ``tokenize_path`` takes
    since: str  # first version whose events this adapter reads
    # its /metrics text -> (KV cache capacity in tokens, its block size), if it says: what a gateway bounds an
    # engine's approximate index by when the engine publishes no events (docs/gateway.md)
    read_kv_capacity: Callable[[str], "tuple[int, int] | None"] | None = None

    def decode_frames(self, frames: list[bytes], topic: Topic | None = None) -> DecodedFrame:
        """One message in this engine's layout; never raises (see kv_preflight/events.py decode_frames)."""
        return decode_frames(frames, self.layout, topic=topic)
