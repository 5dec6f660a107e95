"""A lean pipelined Valkey connection for the two hot paths: the predictor's lookup (one EVALSHA
per prediction) and the ingester's batch scripts (runs of EVALSHAs written at once).

redis-py spends ~70 us of Python per command (connection pool, health checks, per-argument
encoding, timeouts); a prediction sends exactly one command, so that was most of its Valkey
cost. Here one connection per process carries every in-flight command: commands are written
as they come (no pool, no lock on the hot path), packed in C (shared._chain.pack_command), and
replies, parsed by hiredis, resolve the waiting futures in order. Everything else keeps using
redis-py.

Failures surface as redis-py's exceptions (ConnectionError, ResponseError), so callers treat
both clients alike. A lost connection fails what was in flight and the next command
reconnects; so does a server that went quiet (nothing back for timeout_s: for the ingester's
runs here, for a single command when its caller gives up); a script the server forgot
(restart, SCRIPT FLUSH) is loaded again. Plain
``redis://`` and ``unix://`` URLs only: ``from_url`` returns None for anything else (TLS), and
the caller stays on redis-py.
"""
from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any

import hiredis
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


try:
    from shared._chain import pack_command as _pack_c
except ImportError:  # pragma: no cover - no compiler at install time
    _pack_c = None


def pack(*args: Any) -> bytes:
    """One command in RESP: bytes, str and int arguments (C when built, else Python)."""
    if _pack_c is not None:
        return _pack_c(args)
    return _pack_py(args)


def _pack_py(args: Any) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        elif not isinstance(a, (bytes, bytearray, memoryview)):
            a = str(a).encode()
        out.append(b"$%d\r\n" % len(a))
        out.append(a)
        out.append(b"\r\n")
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.pending: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_rx = time.monotonic()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        self.reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisConnectionError(f"protocol error from valkey: {exc}"))
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            if not pending:  # a reply nobody waits for: the stream is out of step
                self._fail(RedisConnectionError("unexpected reply from valkey"))
                if self.transport is not None:
                    self.transport.close()
                return
            fut = pending.popleft()
            if not fut.done():
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to valkey lost: {exc or 'closed by server'}"))

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(exc)


class FastConnection:
    def __init__(self, *, host: str | None = None, port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, timeout_s: float = 1.0):
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password = username, password
        self.timeout_s = timeout_s
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0) -> "FastConnection | None":
        if not url.startswith(("redis://", "unix://")):
            return None
        kw = parse_url(url)
        return cls(host=kw.get("host"), port=int(kw.get("port") or 6379), path=kw.get("path"), db=int(kw.get("db") or 0),
                   username=kw.get("username"), password=kw.get("password"), timeout_s=timeout_s)

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            try:
                if self.path:
                    _, proto = await loop.create_unix_connection(_Protocol, self.path)
                else:
                    _, proto = await loop.create_connection(_Protocol, self.host, self.port)
            except OSError as exc:
                raise RedisConnectionError(f"cannot connect to valkey: {exc}") from None
            sock = proto.transport.get_extra_info("socket") if proto.transport else None
            if sock is not None and not self.path:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            setup = []
            if self.password:
                setup.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                setup.append(("SELECT", self.db))
            for cmd in setup:
                reply = await self._send(proto, pack(*cmd))
                if isinstance(reply, hiredis.ReplyError):
                    proto.transport.close()
                    raise RedisConnectionError(f"valkey refused {cmd[0]}: {reply}")
        return proto

    async def _conn(self) -> _Protocol:
        proto = self._proto
        # a transport closed by us (a caller gave up on a quiet server) is lost a loop turn later
        if proto is not None and not proto.closed and proto.transport is not None and not proto.transport.is_closing():
            return proto
        if self._connecting is None:  # one connect at a time; concurrent callers share it
            self._connecting = asyncio.ensure_future(self._open())
        try:
            proto = await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None
        self._proto = proto
        return proto

    @staticmethod
    async def _send(proto: _Protocol, raw: bytes) -> Any:
        fut = asyncio.get_running_loop().create_future()
        proto.pending.append(fut)
        assert proto.transport is not None
        proto.transport.write(raw)
        return await fut

    async def execute(self, *args: Any) -> Any:
        """One command; a server error reply raises ResponseError (NoScriptError for NOSCRIPT)."""
        proto = await self._conn()
        sent = time.monotonic()
        try:
            reply = await self._send(proto, pack(*args))
        except asyncio.CancelledError:
            # The caller gave up (its deadline). If the server has gone quiet (nothing received
            # for timeout_s since this command went out), drop the connection so the next command
            # does not queue behind a stalled stream. A connection that was merely idle before
            # is not quiet: the other commands in flight on it must not fail for this one.
            now = time.monotonic()
            if proto.last_rx < sent and now - sent > self.timeout_s and proto.transport is not None:
                proto.transport.close()
            raise
        if isinstance(reply, hiredis.ReplyError):
            msg = str(reply)
            raise (NoScriptError if msg.startswith("NOSCRIPT") else ResponseError)(msg)
        return reply

    async def evalsha(self, sha: str, script: str, args: list[Any]) -> Any:
        """EVALSHA with no KEYS; loads the script once if the server does not know it."""
        try:
            return await self.execute("EVALSHA", sha, 0, *args)
        except NoScriptError:
            await self.execute("SCRIPT", "LOAD", script)
            return await self.execute("EVALSHA", sha, 0, *args)

    async def evalsha_many(self, sha: str, script: str, arg_lists: list[list[Any]]) -> list[Any]:
        """Several EVALSHAs written at once, replies in order; a server error reply raises."""
        return await (await self.evalsha_send(sha, script, arg_lists))

    async def evalsha_send(self, sha: str, script: str, arg_lists: list[list[Any]]) -> "asyncio.Future[list[Any]]":
        """Write several EVALSHAs now; the returned future gives their replies, in order.

        If the server did not know the script, it is loaded and the commands that failed on
        that are sent again, in order (those that ran are not repeated). A server error
        reply raises ResponseError from the future.
        """
        loop = asyncio.get_running_loop()
        if not arg_lists:
            done = loop.create_future()
            done.set_result([])
            return done
        proto = await self._conn()
        futs = [loop.create_future() for _ in arg_lists]
        proto.pending.extend(futs)
        assert proto.transport is not None
        proto.transport.write(b"".join(pack("EVALSHA", sha, 0, *a) for a in arg_lists))
        sent = time.monotonic()

        async def replies() -> list[Any]:
            out = [await self._reply(proto, f, sent) for f in futs]
            missing = [i for i, r in enumerate(out) if isinstance(r, hiredis.ReplyError) and str(r).startswith("NOSCRIPT")]
            if missing:
                await self.execute("SCRIPT", "LOAD", script)
                again = await self.evalsha_many(sha, script, [arg_lists[i] for i in missing])
                for i, r in zip(missing, again):
                    out[i] = r
            for r in out:
                if isinstance(r, hiredis.ReplyError):
                    raise ResponseError(str(r))
            return out

        return asyncio.ensure_future(replies())

    async def _reply(self, proto: _Protocol, fut: asyncio.Future, sent: float) -> Any:
        """The reply, or ConnectionError once the server has gone quiet: nothing received for
        timeout_s since the command was sent (a paused or partitioned server never closes the
        connection; without this an ingester run would wait as long as TCP does)."""
        while True:
            if fut.done():
                return fut.result()
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except TimeoutError:
                if fut.done():
                    continue
                if time.monotonic() - max(proto.last_rx, sent) > self.timeout_s and proto.transport is not None:
                    proto.transport.close()  # fails every pending future; the next command reconnects

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None and proto.transport is not None:
            proto.transport.close()
