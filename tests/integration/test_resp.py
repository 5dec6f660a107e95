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
