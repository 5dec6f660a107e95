"""The lookup's lean Valkey connection: pipelining, NOSCRIPT, lost connections, errors."""
from __future__ import annotations

import asyncio

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from kv_preflight.index.index import Index, StoreBlock
from kv_preflight.index.resp import FastConnection

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
    assert ix.backend.fast is not None
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


async def test_commands_written_in_one_turn_of_the_loop_go_in_one_send_when_coalescing(valkey_url):
    """The gateway's connection (``coalesce``): a decision's lookup and the read beside it, and every booking written
    in the same turn, leave in one send, answered in order; without it, a send each."""
    r = redis.Redis.from_url(valkey_url)
    sha = r.script_load("return ARGV[1]")
    r.close()
    for coalesce, sends in ((True, 1), (False, 41)):
        conn = FastConnection.from_url(valkey_url)
        conn.coalesce = coalesce
        assert await conn.execute("PING") == b"PONG"
        transport = conn._proto.transport
        written, write = [], transport.write
        transport.write = lambda data: (written.append(data), write(data))[-1]
        replies = await asyncio.gather(*(conn.execute("ECHO", f"m{i}") for i in range(20)),
                                       conn.evalsha_many(sha, "return ARGV[1]", [["a"], ["b"]]),
                                       *(conn.execute("ECHO", f"n{i}") for i in range(20)))
        assert replies == [f"m{i}".encode() for i in range(20)] + [[b"a", b"b"]] + [f"n{i}".encode() for i in range(20)]
        assert len(written) == sends
        await conn.close()


async def test_evalsha_now_writes_at_once_and_takes_evalsha_manys_way_for_anything_but_plain_replies(valkey_url):
    """The gateway's read beside its lookup (``evalsha_now``: written in the caller's turn, no task): plain replies
    as they come; a script the server forgot loaded and run again; an error reply raised; no connection open: None
    (the caller awaits ``evalsha_many``)."""
    script = "if ARGV[1] == 'boom' then return redis.error_reply('boom') end return ARGV[1]"
    r = redis.Redis.from_url(valkey_url)
    sha = r.script_load(script)
    conn = FastConnection.from_url(valkey_url)
    assert conn.evalsha_now(sha, script, [["a"]]) is None  # not connected yet
    assert await conn.execute("PING") == b"PONG"
    sent = conn.evalsha_now(sha, script, [["a"], ["b"]])
    assert sent is not None and not sent.done()
    assert await sent == [b"a", b"b"]
    r.script_flush()
    assert await conn.evalsha_now(sha, script, [["c"], ["d"]]) == [b"c", b"d"]  # NOSCRIPT: loaded, sent again
    with pytest.raises(ResponseError, match="boom"):
        await conn.evalsha_now(sha, script, [["e"], ["boom"]])
    assert await conn.execute("PING") == b"PONG"  # the stream in step after each
    given_up = conn.evalsha_now(sha, script, [["f"]])
    given_up.cancel()  # a caller that gave up: its reply is read and dropped
    assert await conn.evalsha_many(sha, script, [["g"]]) == [b"g"]
    await conn.close()
    r.close()


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


async def test_a_cancelled_run_leaves_the_stream_in_step(valkey_server, valkey_url):
    """A pipelined run whose caller gave up before its replies came (one waiter for the whole run): its replies
    are read and dropped when they come, and the commands written after it get their own."""
    import signal

    r = redis.Redis.from_url(valkey_url)
    r.mset({"a": "1", "b": "2", "c": "3"})
    conn = FastConnection.from_url(valkey_url, timeout_s=5)
    assert await conn.execute("PING") == b"PONG"
    valkey_server.proc.send_signal(signal.SIGSTOP)  # nothing answers until the run is cancelled
    try:
        run = asyncio.ensure_future(conn.pipeline([("GET", "a"), ("GET", "b")]))
        after = asyncio.ensure_future(conn.execute("GET", "c"))
        await asyncio.sleep(0.05)  # both written
        run.cancel()
    finally:
        valkey_server.proc.send_signal(signal.SIGCONT)
    assert await after == b"3"
    assert await conn.pipeline([("GET", "b"), ("GET", "a")]) == [b"2", b"1"]
    with pytest.raises(asyncio.CancelledError):
        await run
    await conn.close()
    r.close()


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


# ---------------------------------------------------------------- lost connections: what is resent


class Proxy:
    """Between a client and Valkey. ``fault`` applies to the next request the proxy reads:
    "drop" closes the client's connection without forwarding it (Valkey never sees it), "run"
    forwards it and closes the client's connection instead of passing the reply back (Valkey ran
    it), "cut" passes back only the reply's first 3 bytes, then closes, "first" passes back the first
    reply (up to its first CRLF: a one-line reply) and closes. ``sticky`` keeps the fault for every later
    request too."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.fault: str | None = None
        self.sticky = False
        self.connections = 0
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> "Proxy":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        armed: str | None = None

        def close() -> None:
            cw.close()
            uw.close()

        async def up() -> None:
            nonlocal armed
            while data := await cr.read(1 << 16):
                fault = self.fault
                if not self.sticky:
                    self.fault = None
                if fault == "drop":
                    return close()
                armed = fault
                uw.write(data)
                await uw.drain()
            close()

        async def down() -> None:
            while data := await ur.read(1 << 16):
                if armed in ("run", "cut", "first"):
                    if armed == "cut":
                        cw.write(data[:3])
                        await cw.drain()
                    if armed == "first":
                        cw.write(data[:data.index(b"\r\n") + 2])
                        await cw.drain()
                    return close()
                cw.write(data)
                await cw.drain()
            close()

        try:
            await asyncio.gather(up(), down(), return_exceptions=True)
        except asyncio.CancelledError:
            close()


@pytest.mark.parametrize("coalesce", [False, True])
async def test_lean_connection_resends_only_what_can_run_twice(valkey_server, valkey_url, coalesce):
    r = redis.Redis.from_url(valkey_url)
    r.set("k", "v")
    incr = "return redis.call('INCR', KEYS[1])"
    sha = r.script_load(incr)
    async with Proxy(valkey_server.port) as proxy:
        conn = FastConnection.from_url(proxy.url, resend_scripts={sha})
        conn.coalesce = coalesce
        assert await conn.execute("PING") == b"PONG"
        for fault in ("drop", "run"):  # closed before or after Valkey ran it, nothing of the reply back
            proxy.fault = fault
            assert await conn.execute("GET", "k") == b"v"  # read-only: sent again on a fresh connection
        proxy.fault = "drop"
        with pytest.raises(RedisConnectionError):  # never seen by Valkey, but the client cannot know that
            await conn.execute("INCR", "n")
        proxy.fault = "run"
        with pytest.raises(RedisConnectionError):
            await conn.execute("INCR", "n")
        assert r.get("n") == b"1"  # ran once, not twice
        proxy.fault = "run"  # a script named as safe to run twice is resent
        assert await conn.evalsha(sha, incr, [], ("s",)) == 2 and r.get("s") == b"2"
        proxy.fault = "run"  # the unanswered commands of a run are written once more, in order
        assert await conn.evalsha_many(sha, incr, [[], []], [("t",), ("u",)]) == [2, 2]
        other = FastConnection.from_url(proxy.url)  # the same script, not named: not resent
        other.coalesce = coalesce
        assert await other.execute("PING") == b"PONG"
        proxy.fault = "run"
        with pytest.raises(RedisConnectionError):
            await other.evalsha(sha, incr, [], ("w",))
        assert r.get("w") == b"1"
        proxy.fault = "cut"  # part of the reply came: not resent, even read-only
        with pytest.raises(RedisConnectionError):
            await conn.execute("GET", "k")
        proxy.fault, proxy.sticky = "drop", True  # lost again on the fresh connection: the error
        before = proxy.connections
        with pytest.raises(RedisConnectionError):
            await conn.execute("GET", "k")
        assert proxy.connections - before == 2  # the first try's connection, then one more
        await conn.close()
        await other.close()
    r.close()


async def test_a_run_cut_after_its_first_reply_is_resent_from_the_first_unanswered_command(valkey_server, valkey_url):
    """A pipelined run whose connection is lost after some of its replies came: those stand, and (when the
    caller says every command can run twice) the rest are written once more, in order; otherwise the error."""
    r = redis.Redis.from_url(valkey_url)
    async with Proxy(valkey_server.port) as proxy:
        conn = FastConnection.from_url(proxy.url)
        assert await conn.execute("PING") == b"PONG"
        proxy.fault = "first"
        assert await conn.pipeline([("INCR", "a"), ("INCR", "b"), ("INCR", "c")], resend=True) == [1, 2, 2]
        assert [r.get(k) for k in "abc"] == [b"1", b"2", b"2"]  # a answered: not sent again; b and c ran twice
        proxy.fault = "first"
        with pytest.raises(RedisConnectionError):  # INCR is not safe to run twice: judged per command
            await conn.pipeline([("INCR", "d"), ("INCR", "e")])
        assert [r.get(k) for k in "de"] == [b"1", b"1"]
        assert await conn.pipeline([("GET", "a"), ("GET", "e")]) == [b"1", b"1"]  # the next run reconnects
        await conn.close()
    r.close()


async def test_redis_client_resends_only_what_can_run_twice(valkey_server, valkey_url):
    from kv_preflight.index.resend import redis_client
    from kv_preflight.index.resp import script_sha

    r = redis.Redis.from_url(valkey_url)
    r.set("k", "v")
    read = "return redis.call('GET', KEYS[1])"
    async with Proxy(valkey_server.port) as proxy:
        client = redis_client(proxy.url, timeout_s=1.0, resend_scripts={script_sha(read)})
        script = client.register_script(read)
        assert await client.ping()
        for fault in ("drop", "run"):
            proxy.fault = fault
            assert await client.get("k") == b"v"
            proxy.fault = fault
            assert await script(keys=["k"]) == b"v"  # EVALSHA of a named script
            proxy.fault = fault
            async with client.pipeline(transaction=False) as pipe:
                pipe.get("k").hgetall("h")
                assert await pipe.execute() == [b"v", {}]
        for fault in ("drop", "run"):
            assert await client.ping()  # a connected connection first: the fault is for HINCRBY, not a handshake
            proxy.fault = fault
            with pytest.raises(RedisConnectionError):
                await client.hincrby("h", "n", 1)
        assert r.hget("h", "n") == b"1"  # ran once ("run"), never twice
        await client.aclose()
    r.close()


async def test_redis_client_replaces_a_pooled_connection_the_server_closed(valkey_url):
    """redis-py 8's pool skipped this check ("auto" maintenance notifications): after a restart
    or CLIENT KILL, the next command on each pooled connection failed, even a write."""
    from kv_preflight.index.resend import redis_client

    client = redis_client(valkey_url, timeout_s=1.0)
    assert await client.ping()
    redis.Redis.from_url(valkey_url).client_kill_filter(_type="normal")
    await asyncio.sleep(0.1)  # the loop reads the server's close
    assert await client.hincrby("h", "n", 1) == 1
    await client.aclose()


async def test_a_pipeline_answers_in_order_with_errors_in_place(valkey_url):
    conn = FastConnection.from_url(valkey_url)
    sync = redis.Redis.from_url(valkey_url)
    sync.hset("h", mapping={"a": "1"})
    sync.rpush("l", "x")
    try:
        out = await conn.pipeline([("HGETALL", "h"), ("HLEN", "l"), ("HLEN", "h"), ("HGETALL", "none")])
        assert out[0] == [b"a", b"1"] and out[2] == 1 and out[3] == []
        assert isinstance(out[1], ResponseError) and str(out[1]).startswith("WRONGTYPE")
        assert await conn.execute("PING") == b"PONG"  # the stream is still in step
        assert await conn.pipeline([]) == []
    finally:
        sync.close()
        await conn.close()
