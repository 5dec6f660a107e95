"""Publish KV-event batches over ZeroMQ exactly as vLLM 0.32's ``ZmqEventPublisher`` does.

* PUB frames ``[topic, seq (8 bytes BE), payload]``, seq counting from 0 at start.
* The PUB socket binds when the endpoint is a wildcard (``*``, ``::``) or
  ipc/inproc, and connects otherwise (then the subscriber binds). A wildcard binds on ``bind_host`` when
  one is given (``simulate --host``: a simulated engine listens where its HTTP server does), not on every
  interface; ``/kv_event_sources`` still names the endpoint as configured, as vLLM's answer does.
* A ROUTER on the replay endpoint answers a DEALER's ``["", start_seq]`` with
  ``["", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``,
  then ``["", "", -1, ""]``. The buffer keeps the last ``buffer_steps`` batches.
* Payload: msgpack ``[ts, [event maps], data_parallel_rank]``, encoded by
  ``kv_preflight.events`` (the one wire schema; unset optional fields left out as vLLM does).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from kv_preflight.engines.endpoints import host_part, is_bind_endpoint
from kv_preflight.events import Event, EventBatch
from kv_preflight.events import encode_payload as encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000


def encode_payload(ts: float, events: Sequence[Event], data_parallel_rank: int = 0) -> bytes:
    return encode_batch(EventBatch(ts=ts, events=list(events), data_parallel_rank=data_parallel_rank))


WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::", "[::]")


def bound_on(endpoint: str, host: str | None) -> str:
    """What to bind for ``endpoint``: a ``tcp://*:PORT`` wildcard on ``host`` alone when one is given and is
    not itself a wildcard (``tcp://127.0.0.1:PORT``; an IPv6 address in brackets), anything else as it is."""
    if host is None or host in WILDCARD_HOSTS or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{host_part(host)}:{endpoint[len('tcp://*:'):]}"


class EventPublisher:
    """PUB + replay ROUTER on the running asyncio loop; ``publish`` is called once per engine step."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        *,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        data_parallel_rank: int = 0,
        bind_host: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.bind_host = bind_host
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None

    def open(self) -> None:
        """Create and bind/connect the sockets; a busy port fails here, before serving starts."""
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
        try:
            if is_bind_endpoint(self.endpoint):
                self._pub.bind(bound_on(self.endpoint, self.bind_host))
            else:
                self._pub.connect(self.endpoint)
            if self._replay is not None:
                self._replay.bind(bound_on(self.replay_endpoint, self.bind_host))
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot open KV-event sockets ({self.endpoint}, replay {self.replay_endpoint}): {exc}") from None

    def start(self) -> None:
        """Open the sockets if needed and start answering replays; needs the running loop."""
        self.open()
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def publish(self, events: Sequence[Event], ts: float | None = None) -> int | None:
        """Send one batch and return its seq; an empty batch is not sent (vLLM skips them too)."""
        if self._pub is None:
            raise RuntimeError("publisher not started")
        if not events:
            return None
        payload = encode_payload(time.time() if ts is None else ts, events, self.data_parallel_rank)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = await self._replay.recv_multipart()
            except (asyncio.CancelledError, zmq.ContextTerminated, zmq.error.ZMQError):
                return
            if len(frames) != 3:
                log.warning("invalid replay request with %d frames", len(frames))
                continue
            client, _, start_raw = frames
            start_seq = int.from_bytes(start_raw, "big")
            # Snapshot: publishing may append while we stream.
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"), payload])
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._replay = self._ctx = None

    def sources(self) -> dict[str, dict[str, Any]]:
        """``GET /kv_event_sources`` as vLLM 0.32 answers it, keyed by data-parallel rank."""
        return {
            str(self.data_parallel_rank): {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint,
                "buffer_steps": self.buffer_steps,
                "hwm": self.hwm,
                "max_queue_size": 100_000,
                "topic": self.topic,
            }
        }
