"""A long replay comes back whole: an engine's replay ROUTER (vLLM's, and the simulator's like it) drops what its
send queue to a slow reader cannot hold (ZMQ's default 1,000 messages), so one ask for thousands of batches came
back with holes and no end marker (7,000 of vLLM's 10,000-batch buffer, every time: a rebuild from seq 0, or a gap of
thousands, ended flagged though the engine still held every batch). The replay client asks again from the first
seq missing until the reply is whole. Real ZMQ sockets, the simulator's publisher (vLLM 0.32's protocol)."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.events import BlockStored
from kv_preflight.ingester.replay import fetch_replay
from kv_preflight.simulator.publisher import EventPublisher

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def stored(i: int) -> BlockStored:
    """A prefill's batch: 16 blocks of 32 tokens (about 2 KB on the wire, as a real engine's are: a reply of
    thousands of them fills the kernel's socket buffers, and then the ROUTER's queue)."""
    return BlockStored(block_hashes=[i * 16 + j + 1 for j in range(16)], parent_block_hash=None,
                       token_ids=[(i + t) % 30_000 for t in range(512)], block_size=32)


@contextmanager
def engine(batches: int, buffer_steps: int):
    """An engine's publisher that has published ``batches``, answering replays from a thread of its own (as an
    engine process does: its ROUTER sends as fast as it can, whatever the reader keeps up with)."""
    replay = f"tcp://127.0.0.1:{free_port()}"
    loop = asyncio.new_event_loop()
    ready, done = threading.Event(), threading.Event()

    async def serve() -> None:
        pub = EventPublisher(f"tcp://127.0.0.1:{free_port()}", replay, "kv@pod-long@m", buffer_steps=buffer_steps)
        pub.start()
        for i in range(batches):
            await pub.publish([stored(i)])
        ready.set()
        while not done.is_set():
            await asyncio.sleep(0.05)
        await pub.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(60)
    try:
        yield replay
    finally:
        done.set()
        thread.join(10)
        loop.close()


async def busy_loop(stop: asyncio.Event) -> None:
    """The ingester's loop applying live batches beside the replay's task: the replay is read between them."""
    while not stop.is_set():
        time.sleep(0.0005)
        await asyncio.sleep(0)


@pytest.mark.parametrize("batches", [3_000])
async def test_a_replay_of_thousands_of_batches_comes_back_whole(batches):
    with engine(batches, 10_000) as replay:
        stop = asyncio.Event()
        busy = asyncio.ensure_future(busy_loop(stop))
        try:
            frames, complete = await fetch_replay(replay, 0, timeout_s=2)
        finally:
            stop.set()
            await busy
        assert complete and [f.seq for f in frames] == list(range(batches)), (
            complete, len(frames), [f.seq for f in frames][:3], [f.seq for f in frames][-3:])
        # from the middle too, and from past the end (nothing, whole)
        frames, complete = await fetch_replay(replay, 2_210, timeout_s=5)
        assert complete and [f.seq for f in frames] == list(range(2_210, batches))
        assert await fetch_replay(replay, batches, timeout_s=5) == ([], True)


async def test_a_buffer_that_moved_on_is_kept_and_said_by_its_first_seq():
    """Asked from a seq the engine no longer buffers, the reply starts later: kept whole (the caller sees the gap
    by its first seq and flags the pod), never taken for a hole to ask again forever."""
    with engine(300, 100) as replay:
        frames, complete = await fetch_replay(replay, 10, timeout_s=5)
        assert complete and [f.seq for f in frames] == list(range(200, 300))
