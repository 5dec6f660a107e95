"""The replay client: what an engine still buffers from a seq on, asked on its replay socket (a ROUTER the
engine binds) through a DEALER with the limits and CURVE keys of the source it belongs to.
"""
from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from kv_preflight.engines import engine
from kv_preflight.events import SEQ_END, DecodedFrame
from kv_preflight.ingester.socket_options import HANDSHAKE_FAILED, configure
from kv_preflight.ingester.sources import Source

log = logging.getLogger("kvpf.ingester")

# Replay connection events that end a reply early: a frame over the size limit (ZMQ drops the
# connection rather than allocate it), the engine going away, or a refused CURVE handshake.
REPLAY_BROKEN = zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED


async def fetch_replay(
    endpoint: str, start_seq: int, *, timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None,
    source: Source | None = None,
) -> tuple[list[DecodedFrame], bool]:
    """Every batch the engine still buffers from ``start_seq`` on, and whether the end marker came.

    A DEALER sends ``["", start_seq as 8 bytes big-endian]``; the ROUTER answers one
    message per buffered batch and ends with seq -1. The reply ends early, incomplete, when
    the connection drops (a frame over ``max_frame_bytes`` does that, and is never asked for
    again by this call: the engine would only send it again) or past ``max_queue_bytes``; the
    caller flags the seqs it did not get. ``source``: the source the replay socket belongs to, whose
    limits and CURVE keys the DEALER takes (``Routes.replay_source``); a bare one if not given.
    """
    ctx = ctx or zmq.asyncio.Context.instance()
    src = source or Source(endpoint)
    sock = ctx.socket(zmq.DEALER)
    configure(sock, src, server=False)
    monitor = sock.get_monitor_socket(REPLAY_BROKEN)
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    frames: list[DecodedFrame] = []
    received = 0
    try:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        await sock.send_multipart([b"", max(start_seq, 0).to_bytes(8, "big")])
        while True:
            ready = dict(await poller.poll(timeout=int(timeout_s * 1000)))
            if sock not in ready:
                if monitor in ready:
                    log.warning("replay from %s ended after %d batch(es): the connection dropped (a frame over "
                                "--max-frame-bytes %d, the engine going away, or a refused CURVE handshake)",
                                endpoint, len(frames), src.limits.max_frame_bytes)
                return frames, False
            message = await sock.recv_multipart()
            received += sum(len(f) for f in message)
            if received > src.limits.max_queue_bytes:
                log.warning("replay from %s ended after %d batch(es): over --max-queue-bytes %d",
                            endpoint, len(frames), src.limits.max_queue_bytes)
                return frames, False
            decoded = engine(src.engine).decode_frames(message, topic=src.named_topic)
            if decoded.seq == SEQ_END:
                return frames, True
            frames.append(decoded)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
