"""The lookup's lean Valkey connection: pipelining, NOSCRIPT, lost connections, errors."""
from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.index import Index, StoreBlock
from shared.resp import FastConnection

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_concurrent_commands_share_one_connection(valkey_url):
    conn = FastConnection.from_url(valkey_url)
    replies = await asyncio.gather(*(conn.execute("ECHO", f"m{i}") for i in range(200)))
    assert replies == [f"m{i}".encode() for i in range(200)]
    with pytest.raises(ResponseError):
        await conn.execute("NOSUCHCOMMAND")
    assert await conn.execute("PING") == b"PONG"  # an error reply leaves the stream in step
    await conn.close()


async def test_script_reloaded_after_flush_and_connection_after_restart(valkey_server, valkey_url):
    ix = Index.from_url(valkey_url)
    assert ix.fast is not None
    fld = ix.entry_field("pod-a", "GPU", 0)
    await ix.apply_batch(pod_id="pod-a", rank=0, seq=0, ts=0.0, model="m", engine_block_size=16, mode="import",
                         mutations=[StoreBlock(1, "gpu", fld, (101, 102))])
    assert [(m.pod_id, m.blocks) for m in await ix.lookup([101, 102])] == [("pod-a", 2)]
    redis.Redis.from_url(valkey_url).script_flush()
    assert [(m.pod_id, m.blocks) for m in await ix.lookup([101, 102])] == [("pod-a", 2)]
    valkey_server.stop()
    with pytest.raises(RedisConnectionError):
        await ix.lookup([101, 102])
    valkey_server.start()  # AOF brings the data back; the next lookup reconnects
    assert [(m.pod_id, m.blocks) for m in await ix.lookup([101, 102])] == [("pod-a", 2)]
    await ix.close()


def test_only_plain_urls_get_a_fast_connection():
    assert FastConnection.from_url("rediss://127.0.0.1:6379/0") is None
    c = FastConnection.from_url("redis://user:pw@127.0.0.1:7000/3")
    assert (c.host, c.port, c.db, c.username, c.password) == ("127.0.0.1", 7000, 3, "user", "pw")


async def test_a_cancelled_command_leaves_the_others_alone_on_a_healthy_connection(valkey_url):
    """One caller giving up (its client went away) must not drop the connection every other
    in-flight command shares, just because the connection had been idle for a while before."""
    conn = FastConnection.from_url(valkey_url, timeout_s=0.05)
    assert await conn.execute("PING") == b"PONG"
    await asyncio.sleep(0.2)  # idle between requests, longer than timeout_s
    a = asyncio.ensure_future(conn.execute("SET", "k", "v"))
    b = asyncio.ensure_future(conn.execute("PING"))
    await asyncio.sleep(0)  # both written
    b.cancel()
    assert await a == b"OK"
    assert await conn.execute("GET", "k") == b"v"
    await conn.close()


async def test_a_connection_that_went_quiet_is_dropped_when_its_caller_gives_up(valkey_server, valkey_url):
    import signal

    conn = FastConnection.from_url(valkey_url, timeout_s=0.05)
    assert await conn.execute("PING") == b"PONG"
    valkey_server.proc.send_signal(signal.SIGSTOP)  # the server stops answering
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await conn.execute("PING")
        assert conn._proto is None or conn._proto.closed or conn._proto.transport.is_closing()
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    assert await conn.execute("PING") == b"PONG"  # a fresh connection
    await conn.close()


async def test_pipelined_scripts_fail_when_the_server_goes_quiet(valkey_server, valkey_url):
    """The ingester's runs (evalsha_send) had no bound at all: a server that stops answering
    without closing the connection (paused, partitioned) hung the ingester, and its stop, for
    as long as TCP took to give up. Now the future fails once nothing has come back for
    timeout_s, the connection is dropped, and the next command reconnects."""
    import signal

    conn = FastConnection.from_url(valkey_url, timeout_s=0.1)
    sha = await conn.execute("SCRIPT", "LOAD", "return ARGV[1]")
    assert await conn.evalsha_many(sha.decode(), "return ARGV[1]", [["a"], ["b"]]) == [b"a", b"b"]
    valkey_server.proc.send_signal(signal.SIGSTOP)
    try:
        pending = await conn.evalsha_send(sha.decode(), "return ARGV[1]", [["c"]])
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(pending, 30)  # the guard only keeps a regression from hanging the suite
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    assert await conn.evalsha_many(sha.decode(), "return ARGV[1]", [["d"]]) == [b"d"]
    await conn.close()
