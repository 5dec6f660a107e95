"""A publisher that speaks vLLM 0.32's KV-event protocol (PUB + replay ROUTER), driven by the test.

Its PUB is an XPUB, which sends exactly as a PUB does and also hands the test each subscription that
reaches it: ``subscribed`` is how a test knows an ingester it started is listening. A PUB drops what it
sends before a subscriber's subscription has arrived, and none of the ingester's own signals (its log,
its /metrics) can say that: its SUB connects and subscribes in the background after it has logged."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

import zmq

from kv_preflight.events import EventBatch, encode_frames


def zmq_threads() -> str:
    """This process's libzmq threads (I/O and reaper) with their state and where in the kernel each waits:
    for a CI failure where one pytest worker's subscriptions and replays stopped reaching their peers for
    minutes, test after test (an I/O thread stuck would explain it; its stack is native, out of Python's
    reach, so this is what can be seen from here)."""
    import os

    out = []
    try:
        for tid in sorted(os.listdir("/proc/self/task"), key=int):
            base = f"/proc/self/task/{tid}"
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            if not comm.startswith("ZMQbg"):
                continue
            with open(f"{base}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{base}/wchan") as f:
                wchan = f.read().strip()
            out.append(f"{comm}[{tid}] {fields[0]} {wchan} cpu={int(fields[11]) + int(fields[12])}")
    except OSError as exc:  # not Linux, or a thread gone meanwhile
        out.append(f"({exc})")
    return ", ".join(out) or "none"


class EngineStub:
    def __init__(self, pub_endpoint: str, replay_endpoint: str, topic: str, *, bind: bool = True, buffer: int = 10_000,
                 replay_topic: bool = True):
        # replay_topic=False answers replays as ``["", seq, payload]``, without the topic frame
        # (SGLang, and vLLM before 0.2x): the ingester must know the pod some other way.
        self.replay_topic = replay_topic
        self.ctx = zmq.Context()
        self.subscriptions = 0  # subscriptions that reached the publisher, over the stub's life (see subscribed)
        self.pub = self._xpub()
        (self.pub.bind if bind else self.pub.connect)(pub_endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(replay_endpoint)
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, list[bytes]]] = deque(maxlen=buffer)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # cleared: replay requests are taken (counted: ``replay_requests``) but answered only once it is set
        self.answer_replays = threading.Event()
        self.answer_replays.set()
        self.replay_starts: list[int] = []  # the seq each replay request asked from, in order
        # while answer_replays is clear, requests from these seqs are answered all the same (the others wait)
        self.release_starts: set[int] = set()
        # set: replays answer as the engine stood before this seq (a replay answered before the batches from
        # here on were published, which then arrive live after it)
        self.replay_before: int | None = None
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    @property
    def replay_requests(self) -> int:
        """Replay requests taken so far (answered or waiting)."""
        return len(self.replay_starts)

    def _xpub(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscriber's subscription, not only a topic's first
        return sock

    def count_subscriptions(self) -> int:
        """The subscriptions that have reached the publisher so far (each subscriber's, and each
        reconnection's: a subscriber subscribes again when it reconnects)."""
        while True:
            try:
                msg = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return self.subscriptions
            if msg[:1] == b"\x01":  # \x00 is an unsubscription (a subscriber gone)
                self.subscriptions += 1

    async def subscribed(self, total: int = 1, timeout_s: float = 30.0) -> None:
        """Until ``total`` subscriptions have reached the publisher since the stub started (an ingester
        restarted, or a second one, subscribes again: wait for 2): from then on every frame published
        reaches that subscriber. Called from the thread that publishes (a ZMQ socket is not thread-safe)."""
        deadline = time.monotonic() + timeout_s
        while self.count_subscriptions() < total:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.subscriptions} of {total} subscription(s) reached the engine stub "
                                     f"in {timeout_s}s: the ingester is not listening (see its log); this "
                                     f"process's ZMQ threads: {zmq_threads()}")
            await asyncio.sleep(0.01)

    def publish(self, batch: EventBatch, *, send: bool = True) -> int:
        """Publish the next batch; ``send=False`` buffers it for replay only (a frame lost on the wire)."""
        with self._lock:
            seq = self.seq
            frames = encode_frames(self.topic, seq, batch)
            self.buffer.append((seq, frames))
            self.seq += 1
        if send:
            self.pub.send_multipart(frames)
        return seq

    def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish an already encoded batch (another engine's layout, from a fixture) as the next seq."""
        with self._lock:
            seq = self.seq
            frames = [self.topic.encode(), seq.to_bytes(8, "big", signed=True), payload]
            self.buffer.append((seq, frames))
            self.seq += 1
        if send:
            self.pub.send_multipart(frames)
        return seq

    def reopen_pub(self, endpoint: str) -> None:
        """Drop and re-bind the PUB socket, as a network blip looks to subscribers: same process,
        same seq and replay buffer."""
        self.pub.close(0)
        self.pub = self._xpub()
        for _ in range(100):  # the old socket's port is released asynchronously
            try:
                self.pub.bind(endpoint)
                return
            except zmq.ZMQError:
                time.sleep(0.05)
        self.pub.bind(endpoint)

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def _serve_replay(self) -> None:
        """Replay requests, answered in arrival order; while ``answer_replays`` is clear they are taken (and
        counted) but wait, several at once if need be, but for those asking from a seq in ``release_starts``."""
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        waiting: list[tuple[bytes, int]] = []
        while not self._stop.is_set():
            if dict(poller.poll(50)):
                ident, _, start = self.router.recv_multipart()
                first = int.from_bytes(start, "big")
                self.replay_starts.append(first)
                waiting.append((ident, first))
            answer = waiting if self.answer_replays.is_set() else [w for w in waiting if w[1] in self.release_starts]
            for ident, first in answer:
                with self._lock:
                    replies = [f for s, f in self.buffer
                               if s >= first and (self.replay_before is None or s < self.replay_before)]
                for frames in replies:
                    self.router.send_multipart([ident, b"", *(frames if self.replay_topic else frames[1:])])
                self.router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
            waiting = [w for w in waiting if w not in answer]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.pub.close(0)
        self.router.close(0)
        self.ctx.term()
