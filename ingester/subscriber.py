"""ZMQ edges: SUB sockets in both directions, engine discovery, and the replay client.

vLLM (0.32) *binds* its PUB socket when the endpoint contains ``*`` and *connects*
otherwise, so an ingester connects to the former (``--source``) and binds for the
latter (``--bind``). The replay socket is always a ROUTER bound by the engine.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import zmq
import zmq.asyncio

from shared.events import SEQ_END, DecodedFrame, decode_frames

log = logging.getLogger("kvpf.ingester")

# ZMQ drops past the high-water mark; keep it large so a Valkey hiccup is absorbed
# in memory, and let seq gaps + replay recover anything beyond.
RCVHWM = 200_000


@dataclass(frozen=True)
class Source:
    endpoint: str
    bind: bool = False
    replay: str | None = None
    topic: str | None = None  # known when discovered from the engine
    rank: int | None = None  # data-parallel rank, known when discovered (each rank has its own sockets)


def parse_source(spec: str, *, bind: bool = False) -> Source:
    """``tcp://HOST:PORT[,replay=tcp://HOST:PORT]``."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or not parts[0].startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"source {spec!r} must start with tcp://, ipc:// or inproc://")
    replay = None
    for opt in parts[1:]:
        key, sep, value = opt.partition("=")
        if key != "replay" or not sep or not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"source option {opt!r} is not replay=tcp://HOST:PORT")
        replay = value
    return Source(endpoint=parts[0], bind=bind, replay=replay)


def _reachable(endpoint: str, host: str) -> str:
    """An engine's ``tcp://*:5557`` seen from here is ``tcp://<engine host>:5557``."""
    return endpoint.replace("*", host, 1).replace("0.0.0.0", host, 1)


def sources_from_kv_event_sources(engine_url: str, body: dict) -> list[Source]:
    """Sources from vLLM's ``GET /kv_event_sources`` (one entry per data-parallel rank)."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    out = []
    for rank, conf in sorted(body.items()):
        if not isinstance(conf, dict) or not conf.get("enable_kv_cache_events", True):
            continue
        endpoint = conf.get("endpoint")
        if not isinstance(endpoint, str):
            continue
        replay = conf.get("replay_endpoint")
        engine_binds = "*" in endpoint or "0.0.0.0" in endpoint
        out.append(Source(
            endpoint=_reachable(endpoint, host) if engine_binds else endpoint.replace(urlsplit(endpoint).hostname or "", "*", 1),
            bind=not engine_binds,
            replay=_reachable(replay, host) if isinstance(replay, str) and replay else None,
            topic=conf.get("topic") if isinstance(conf.get("topic"), str) else None,
            rank=int(rank) if str(rank).isdigit() else None,
        ))
    return out


async def discover(engine_url: str, timeout_s: float = 5.0) -> list[Source]:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        resp = await client.get(engine_url.rstrip("/") + "/kv_event_sources")
        resp.raise_for_status()
        return sources_from_kv_event_sources(engine_url, resp.json())


class Subscriber:
    """All SUB sockets of one ingester, read as one stream of (source, frames)."""

    def __init__(self, sources: list[Source], ctx: zmq.asyncio.Context | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sources = sources
        self.sockets: list[zmq.asyncio.Socket] = []
        self.poller = zmq.asyncio.Poller()
        self.monitors: dict[zmq.asyncio.Socket, Source] = {}
        for src in sources:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if src.bind:
                sock.bind(src.endpoint)
            else:
                sock.connect(src.endpoint)
            self.sockets.append(sock)
            self.poller.register(sock, zmq.POLLIN)
            if not src.bind:
                # Every (re)connection is reported, so an engine that restarted behind the same
                # endpoint can be probed before it publishes anything.
                mon = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
                self.monitors[mon] = src
                self.poller.register(mon, zmq.POLLIN)
            log.info("subscribed", extra={"endpoint": src.endpoint, "mode": "bind" if src.bind else "connect"})

    async def receive(self, max_messages: int = 512) -> list[tuple[Source, list[bytes] | None]]:
        """At least one message; more if they are already queued (batched application).
        ``None`` instead of frames means the source has just (re)connected."""
        ready = await self.poller.poll()
        out: list[tuple[Source, list[bytes] | None]] = []
        data = []
        for sock, _ in ready:
            if sock in self.monitors:
                await sock.recv_multipart()
                out.append((self.monitors[sock], None))
            else:
                data.append(sock)
        # Round-robin over the ready sockets, so one busy engine cannot starve the others.
        while data and len(out) < max_messages:
            for sock in list(data):
                try:
                    out.append((self.sources[self.sockets.index(sock)], await sock.recv_multipart(flags=zmq.NOBLOCK)))
                except zmq.Again:
                    data.remove(sock)
                if len(out) >= max_messages:
                    break
        return out

    def close(self) -> None:
        for mon in self.monitors:
            mon.close(linger=0)
        for sock in self.sockets:
            sock.close(linger=0)


async def fetch_replay(
    endpoint: str, start_seq: int, *, timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None,
) -> tuple[list[DecodedFrame], bool]:
    """Every batch the engine still buffers from ``start_seq`` on, and whether the end marker came.

    A DEALER sends ``["", start_seq as 8 bytes big-endian]``; the ROUTER answers one
    message per buffered batch and ends with seq -1.
    """
    ctx = ctx or zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    frames: list[DecodedFrame] = []
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", max(start_seq, 0).to_bytes(8, "big")])
        while True:
            if not await sock.poll(timeout=int(timeout_s * 1000)):
                return frames, False
            decoded = decode_frames(await sock.recv_multipart())
            if decoded.seq == SEQ_END:
                return frames, True
            frames.append(decoded)
    finally:
        sock.close(linger=0)


async def sleep_backoff(attempt: int, cap_s: float = 5.0) -> None:
    await asyncio.sleep(min(cap_s, 0.05 * (2 ** min(attempt, 10))))
