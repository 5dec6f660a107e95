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


# A long reply is read in several asks: an engine's ROUTER drops what a slow reader has not taken past its send
# limit (ZMQ's default 1,000 messages; the DEALER reads a few ahead), so a reply of thousands of batches comes back
# with holes and often no end marker. Each ask after the first starts at the first seq missing; asks go on while
# each brings new batches, at most this many.
MAX_ASKS = 64


async def fetch_replay(
    endpoint: str, start_seq: int, *, timeout_s: float = 2.0, source: Source | None = None,
) -> tuple[list[DecodedFrame], bool]:
    """Every batch the engine still buffers from ``start_seq`` on, in seq order, and whether they came whole: the
    end marker came, with no seq missing after the first one the engine sent.

    A DEALER sends ``["", start_seq as 8 bytes big-endian]``; the ROUTER answers one message per buffered batch
    and ends with seq -1. The engine drops what its send queue to a slow reader cannot hold, so a reply with a
    hole is asked again from the first seq missing (``MAX_ASKS``), for as long as each ask brings new batches. A
    first batch past ``start_seq`` is the engine's buffer having moved on: kept, and the caller sees the gap. The
    reply ends incomplete when the connection drops (a frame over ``max_frame_bytes`` does that, and is never
    asked for again by this call: the engine would only send it again) or past ``max_queue_bytes`` over all asks;
    the caller flags the seqs it did not get. ``source``: the source the replay socket belongs to, whose limits
    and CURVE keys the DEALER takes (``Routes.replay_source``); a bare one if not given."""
    ctx = zmq.asyncio.Context.instance()
    src = source or Source(endpoint)
    frames: list[DecodedFrame] = []
    expect = max(start_seq, 0)
    budget = src.limits.max_queue_bytes
    for ask in range(MAX_ASKS):
        got, complete, used = await _ask(endpoint, expect, timeout_s, ctx, src, budget, moved_on_ok=ask == 0)
        budget -= used
        frames += got
        expect = next((f.seq + 1 for f in reversed(frames) if f.seq is not None), expect)
        if complete:
            return frames, True
        if not any(f.seq is not None for f in got) or budget <= 0:  # nothing new: another ask would bring nothing
            return frames, False
        log.info("replay from %s: %d batch(es) so far, seq %d on missing (the engine dropped what its send queue "
                 "could not hold); asking again", endpoint, len(frames), expect)
    return frames, False


async def _ask(endpoint: str, start_seq: int, timeout_s: float, ctx: zmq.asyncio.Context, src: Source,
               budget: int, *, moved_on_ok: bool) -> tuple[list[DecodedFrame], bool, int]:
    """One ask: what the engine sends from ``start_seq`` on, up to the first seq missing (the engine dropped it:
    the caller asks again from there), whether the reply came whole to its end marker, and the bytes read.
    ``moved_on_ok``: a first seq past ``start_seq`` is the engine's buffer having moved on, kept (the first ask)."""
    sock = ctx.socket(zmq.DEALER)
    configure(sock, src, server=False)
    monitor = sock.get_monitor_socket(REPLAY_BROKEN)
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    frames: list[DecodedFrame] = []
    expect = start_seq
    received = 0
    try:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            ready = dict(await poller.poll(timeout=int(timeout_s * 1000)))
            if sock not in ready:
                if monitor in ready:
                    log.warning("replay from %s ended after %d batch(es): the connection dropped (a frame over "
                                "--max-frame-bytes %d, the engine going away, or a refused CURVE handshake)",
                                endpoint, len(frames), src.limits.max_frame_bytes)
                return frames, False, received
            message = await sock.recv_multipart()
            received += sum(len(f) for f in message)
            if received > budget:
                log.warning("replay from %s ended after %d batch(es): over --max-queue-bytes %d",
                            endpoint, len(frames), src.limits.max_queue_bytes)
                return frames, False, received
            decoded = engine(src.engine).decode_frames(message, topic=src.named_topic)
            if decoded.seq == SEQ_END:
                return frames, True, received
            if decoded.seq is not None:
                if decoded.seq > expect and not (moved_on_ok and not frames):
                    return frames, False, received  # a seq dropped by the engine's send queue: ask again from it
                if decoded.seq < expect:
                    continue  # (sent twice: never seen from vLLM, kept out all the same)
                expect = decoded.seq + 1
            frames.append(decoded)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
