"""A lean pipelined Valkey connection for the two hot paths: the predictor's lookup (one EVALSHA
per prediction) and the ingester's batch scripts (runs of EVALSHAs written at once).

redis-py spends ~70 us of Python per command (connection pool, health checks, per-argument
encoding, timeouts); a prediction sends exactly one command, so that was most of its Valkey
cost. Here one connection per process carries every in-flight command: commands are written
as they come (no pool, no lock on the hot path), packed in C (_speedups.pack_command), and
replies, parsed by hiredis, resolve the waiting futures in order. Everything else keeps using
redis-py.

Failures surface as redis-py's exceptions (ConnectionError, ResponseError), so callers treat
both clients alike. A lost connection fails what was in flight and the next command
reconnects; so does a server that went quiet (nothing back for timeout_s: for the ingester's
runs here, for a single command when its caller gives up); a script the server forgot
(restart, SCRIPT FLUSH) is loaded again. Plain
``redis://`` and ``unix://`` URLs only: ``from_url`` returns None for anything else (TLS), and
the caller stays on redis-py.

Lost connections: what is sent again, once, on a fresh connection. A Valkey restart, kill -9 or
``CLIENT KILL`` closes every connection, and a client notices only when it next uses one: the
command that notices would fail although Valkey is back (1 or 2 of 12 predictions answered 503
after a restart). Both clients, this one and redis-py as ``redis_client`` configures it, send such
a command once more before returning an error (redis-py's side: kv_preflight/index/resend.py), only when that cannot run it twice to harm:

* the connection was found closed by the server before the command was written: nothing was
  sent, so any command goes on a fresh connection;
* the server closed or reset the connection while the command waited for its reply, none of
  that reply had arrived, and the command can run twice (``can_run_twice``): read-only commands
  (``READ_ONLY``), ``SCRIPT LOAD``/``EXISTS``, and the scripts named in ``resend_scripts``: the
  index's lookups (read-only) and, on the lean connection, the ingester's apply batches, whose
  seq check answers "dup" to a batch it already applied.

Anything else (HINCRBY, an unchecked script, a reply cut half way, a second loss) surfaces as
ConnectionError: Valkey may have run it, and only the caller knows whether to try again. A
server gone quiet (nothing back within timeout_s, so we drop the connection) is not a loss
either: what was sent may still run, so nothing is resent.
"""
from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import hiredis
from redis.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

try:
    from kv_preflight._speedups import pack_command as _pack_c
except ImportError:  # pragma: no cover - no compiler at install time
    _pack_c = None


def pack(*args: Any) -> bytes:
    """One command in RESP: bytes, str and int arguments (C when built, else Python)."""
    if _pack_c is not None:
        return _pack_c(args)
    return _pack_py(args)


# Commands that change nothing: running one twice answers the same as once.
READ_ONLY = frozenset({
    "PING", "ECHO", "TIME", "DBSIZE", "INFO", "SCAN", "EXISTS", "TYPE", "TTL", "PTTL", "GET", "MGET", "STRLEN",
    "HGET", "HMGET", "HGETALL", "HKEYS", "HVALS", "HLEN", "HEXISTS", "HSCAN", "ZRANGE", "ZREVRANGE",
    "ZRANGEBYSCORE", "ZREVRANGEBYSCORE", "ZSCORE", "ZCARD", "SMEMBERS", "SISMEMBER", "SCARD", "LRANGE", "LLEN",
    "EVALSHA_RO", "EVAL_RO",
})


def _text(arg: Any) -> str:
    if isinstance(arg, (bytes, bytearray, memoryview)):
        return bytes(arg).decode("latin-1")
    return str(arg)


def can_run_twice(args: Sequence[Any], scripts: Collection[str] = ()) -> bool:
    """Whether a command may be sent again after its connection was lost (module docstring):
    read-only, SCRIPT LOAD/EXISTS, or EVALSHA of one of ``scripts`` (SHA1s)."""
    words = _text(args[0]).split()  # redis-py passes "SCRIPT LOAD" as one argument
    if not words:
        return False
    name = words[0].upper()
    if name not in ("EVALSHA", "SCRIPT"):
        return name in READ_ONLY
    sub = words[1] if len(words) > 1 else _text(args[1]) if len(args) > 1 else ""
    if name == "SCRIPT":
        return sub.upper() in ("LOAD", "EXISTS")
    return sub.lower() in scripts


def script_sha(script: str) -> str:
    """The SHA1 that names a script in Valkey (as redis-py's ``register_script`` computes it)."""
    return hashlib.sha1(script.encode()).hexdigest()


class ConnectionLost(RedisConnectionError):
    """The server closed or reset the connection before this command's reply was read."""

    def __init__(self, message: str, *, reply_started: bool = False):
        super().__init__(message)
        self.reply_started = reply_started  # part of the reply had come: the command ran


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


class _Run:
    """The replies of a run of commands written at once: one waiter for them all (a future per command cost
    the ingester's cluster rounds, a command or two per engine block, more Python than the command's
    packing). ``replies`` holds those read so far, so a lost connection knows where the run stopped."""

    __slots__ = ("n", "replies", "fut")

    def __init__(self, n: int, fut: asyncio.Future) -> None:
        self.n = n
        self.replies: list[Any] = []
        self.fut = fut


def _evalshas(sha: str, arg_lists: list[list[Any]], key_lists: list[tuple[str, ...]] | None
              ) -> tuple[list[tuple[str, ...]], list[bytes]]:
    """Each EVALSHA's keys (none when not given) and the command packed."""
    kl = key_lists or [()] * len(arg_lists)
    return kl, [pack("EVALSHA", sha, len(k), *k, *a) for k, a in zip(kl, arg_lists)]


def _retrieved(f: asyncio.Future) -> None:
    """A future whose caller may never await it (it gave up on it first): its exception counts as seen."""
    if not f.cancelled():
        f.exception()


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.pending: deque[asyncio.Future | _Run] = deque()  # in the order the commands went out
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_rx = time.monotonic()
        self.dropped: str | None = None  # why we closed it ourselves (None: the server did, if anyone)
        self.coalesce = False  # FastConnection.coalesce
        self._out: list[bytes] = []  # written this turn of the loop, sent at its end (coalesce)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def write(self, data: bytes) -> None:
        """Send ``data``: now, or with ``coalesce`` once this turn of the loop is over, with whatever else was written
        in it (one send, and one read for Valkey, where there were several)."""
        if not self.coalesce:
            self.transport.write(data)  # type: ignore[union-attr]
            return
        self._out.append(data)
        if len(self._out) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        # closed meanwhile: what was written waits in ``pending``, which connection_lost/_fail answer
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def data_received(self, data: bytes) -> None:
        self.last_rx = time.monotonic()
        self.reader.feed(data)
        pending = self.pending
        gets = self.reader.gets
        try:
            while True:
                if pending and type(pending[0]) is _Run:  # a pipelined run: its replies in a tight loop (a
                    # cluster's engine-key rounds get one reply per engine block)
                    head = pending[0]
                    got = head.replies
                    append = got.append
                    for _ in range(head.n - len(got)):
                        reply = gets()
                        if reply is False:
                            return
                        append(reply)
                    pending.popleft()
                    if not head.fut.done():
                        head.fut.set_result(got)
                    continue
                reply = gets()
                if reply is False:
                    return
                if not pending:  # a reply nobody waits for: the stream is out of step
                    self._fail(RedisConnectionError("unexpected reply from valkey"))
                    self.drop("unexpected reply")
                    return
                head = pending.popleft()
                if not head.done():
                    head.set_result(reply)
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"protocol error from valkey: {exc}"))
            self.drop("protocol error")

    @property
    def open(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def drop(self, why: str) -> None:
        """Close from our side: what is in flight fails as a plain ConnectionError (never resent:
        the server may still run it)."""
        if self.dropped is None:
            self.dropped = why
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.dropped is not None:
            self._fail(RedisConnectionError(f"connection to valkey dropped: {self.dropped}"))
            return
        # The server closed or reset it. Bytes in the reader are the start of the first pending
        # reply (that command ran); the others received nothing. (A hiredis before has_data cannot
        # tell, and has_data itself misses a reply cut just past its type byte or inside an array whose
        # first elements it already parsed: counted as nothing, so resent, which is harmless only because
        # what is resent can all run twice.)
        message = f"connection to valkey lost: {exc or 'closed by server'}"
        started = getattr(self.reader, "has_data", lambda: False)()
        self.closed = True
        while self.pending:
            head = self.pending.popleft()
            fut = head.fut if type(head) is _Run else head
            if not fut.done():
                fut.set_exception(ConnectionLost(message, reply_started=started))
            started = False

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        while self.pending:
            head = self.pending.popleft()
            fut = head.fut if type(head) is _Run else head
            if not fut.done():
                fut.set_exception(exc)


class FastConnection:
    def __init__(self, *, host: str | None = None, port: int = 6379, path: str | None = None, db: int = 0,
                 username: str | None = None, password: str | None = None, timeout_s: float = 1.0,
                 resend_scripts: Iterable[str] = ()):
        self.host, self.port, self.path, self.db = host, port, path, db
        self.username, self.password = username, password
        self.timeout_s = timeout_s
        self.resend_scripts = frozenset(resend_scripts)  # SHA1s of scripts that can run twice
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        # Commands written in one turn of the event loop go out in one send at its end: the gateway's lookup and
        # the read beside it, and the bookings of requests decided in the same turn (one syscall here and one read
        # and reply in Valkey, not several; what a command waits for that turn is a few us). Off by default.
        self.coalesce = False

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 1.0, resend_scripts: Iterable[str] = ()) -> "FastConnection | None":
        if not url.startswith(("redis://", "unix://")):
            return None
        kw = parse_url(url)
        return cls(host=kw.get("host"), port=int(kw.get("port") or 6379), path=kw.get("path"), db=int(kw.get("db") or 0),
                   username=kw.get("username"), password=kw.get("password"), timeout_s=timeout_s,
                   resend_scripts=resend_scripts)

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
            proto.coalesce = self.coalesce
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
        """An open connection; the caller writes on it before awaiting anything."""
        for _ in range(2):
            proto = self._proto
            # Closed by the server (seen by the loop before this write) or by us (a caller gave up
            # on a quiet server; lost a loop turn later): nothing is written on it, a fresh one is opened.
            if proto is not None and proto.open:
                return proto
            if self._connecting is None:  # one connect at a time; concurrent callers share it
                self._connecting = asyncio.ensure_future(self._open())
            try:
                proto = await asyncio.shield(self._connecting)
            finally:
                if self._connecting is not None and self._connecting.done():
                    self._connecting = None
            self._proto = proto
            if proto.open:
                return proto
            # Closed again before this waiter resumed (CLIENT KILL right after the connect). Writing
            # anyway raised under uvloop ("the handler is closed": the ingester exited) and was lost
            # silently under asyncio (the command waited for its deadline).
        raise RedisConnectionError("connection to valkey closed as soon as it was opened")

    @staticmethod
    async def _send(proto: _Protocol, raw: bytes) -> Any:
        fut = asyncio.get_running_loop().create_future()
        proto.pending.append(fut)
        assert proto.transport is not None
        proto.write(raw)
        return await fut

    async def execute(self, *args: Any) -> Any:
        """One command; a server error reply raises ResponseError (NoScriptError for NOSCRIPT).

        Lost with its connection before any of its reply came, it is sent once more on a fresh
        connection if it can run twice (module docstring)."""
        raw = pack(*args)
        try:
            reply = await self._roundtrip(raw)
        except ConnectionLost as exc:
            if exc.reply_started or not can_run_twice(args, self.resend_scripts):
                raise
            reply = await self._roundtrip(raw)
        if isinstance(reply, hiredis.ReplyError):
            msg = str(reply)
            raise (NoScriptError if msg.startswith("NOSCRIPT") else ResponseError)(msg)
        return reply

    async def _roundtrip(self, raw: bytes) -> Any:
        proto = await self._conn()
        sent = time.monotonic()
        try:
            return await self._send(proto, raw)
        except asyncio.CancelledError:
            # The caller gave up (its deadline). If the server has gone quiet (nothing received
            # for timeout_s since this command went out), drop the connection so the next command
            # does not queue behind a stalled stream. A connection that was merely idle before
            # is not quiet: the other commands in flight on it must not fail for this one.
            now = time.monotonic()
            if proto.last_rx < sent and now - sent > self.timeout_s:
                proto.drop(f"nothing received for {self.timeout_s}s")
            raise

    async def evalsha(self, sha: str, script: str, args: list[Any], keys: tuple[str, ...] = ()) -> Any:
        """EVALSHA (with ``keys`` as KEYS); loads the script once if the server does not know it."""
        try:
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)
        except NoScriptError:
            await self.execute("SCRIPT", "LOAD", script)
            return await self.execute("EVALSHA", sha, len(keys), *keys, *args)

    async def evalsha_many(self, sha: str, script: str, arg_lists: list[list[Any]],
                           key_lists: list[tuple[str, ...]] | None = None) -> list[Any]:
        """Several EVALSHAs written at once, replies in order; a server error reply raises."""
        if not arg_lists:
            return []
        kl, raws = _evalshas(sha, arg_lists, key_lists)
        return await self._evalsha_replies(sha, script, arg_lists, kl, raws, await self._write_run(raws))

    def evalsha_now(self, sha: str, script: str, arg_lists: list[list[Any]],
                    key_lists: list[tuple[str, ...]] | None = None) -> "asyncio.Future[list[Any]] | None":
        """``evalsha_many``'s replies as a future, the commands written now and no task made (a task is a turn of the
        loop or two on the gateway's path: the read beside its lookup); None when the connection is not open (the
        caller awaits ``evalsha_many``). Anything but plain replies (NOSCRIPT, an error reply, a lost connection)
        goes ``evalsha_many``'s own way from there, in a task. No quiet check of its own: its caller has a deadline."""
        proto = self._proto
        if proto is None or not proto.open or not arg_lists:
            return None
        loop = asyncio.get_running_loop()
        kl, raws = _evalshas(sha, arg_lists, key_lists)
        run = _Run(len(raws), loop.create_future())
        proto.pending.append(run)
        proto.write(b"".join(raws))
        written = (proto, run, time.monotonic())
        out: asyncio.Future = loop.create_future()
        out.add_done_callback(_retrieved)

        def replied(f: asyncio.Future) -> None:
            if out.done():
                return
            if f.exception() is None and not any(type(r) is hiredis.ReplyError for r in f.result()):
                out.set_result(f.result())
                return
            slow = asyncio.ensure_future(self._evalsha_replies(sha, script, arg_lists, kl, raws, written))
            slow.add_done_callback(passed_on)

        def passed_on(t: asyncio.Future) -> None:  # the slow way's outcome is the future's
            if out.done():
                return
            if t.exception() is not None:
                out.set_exception(t.exception())
            else:
                out.set_result(t.result())

        run.fut.add_done_callback(replied)
        return out

    async def evalsha_send(self, sha: str, script: str, arg_lists: list[list[Any]],
                           key_lists: list[tuple[str, ...]] | None = None) -> "asyncio.Future[list[Any]]":
        """Write several EVALSHAs now; the returned future gives their replies, in order.

        If the server did not know the script, it is loaded and the commands that failed on
        that are sent again, in order (those that ran are not repeated). A server error
        reply raises ResponseError from the future. If the server closed the connection before
        answering, the unanswered commands are written once more, in order, on a fresh
        connection when ``sha`` is one of ``resend_scripts`` (module docstring).
        """
        loop = asyncio.get_running_loop()
        if not arg_lists:
            done = loop.create_future()
            done.set_result([])
            return done
        kl, raws = _evalshas(sha, arg_lists, key_lists)
        written = await self._write_run(raws)
        return asyncio.ensure_future(self._evalsha_replies(sha, script, arg_lists, kl, raws, written))

    async def _evalsha_replies(self, sha: str, script: str, arg_lists: list[list[Any]], kl: list[tuple[str, ...]],
                               raws: list[bytes], written: tuple["_Protocol", _Run, float]) -> list[Any]:
        """The replies of EVALSHAs written as ``written``, the script loaded and what failed on that sent again."""
        out = await self._run_replies(raws, written, resend=sha in self.resend_scripts)
        missing = [i for i, r in enumerate(out) if isinstance(r, hiredis.ReplyError) and str(r).startswith("NOSCRIPT")]
        if missing:
            await self.execute("SCRIPT", "LOAD", script)
            again = await self.evalsha_many(sha, script, [arg_lists[i] for i in missing], [kl[i] for i in missing])
            for i, r in zip(missing, again):
                out[i] = r
        for r in out:
            if isinstance(r, hiredis.ReplyError):
                raise ResponseError(str(r))
        return out

    async def pipeline(self, commands: Sequence[Sequence[Any]], *, resend: bool | None = None) -> list[Any]:
        """Several commands written at once, their replies in order; an error reply comes back in
        place as a ResponseError (as redis-py's ``execute(raise_on_error=False)``). Sent once more from
        the first unanswered one after a lost connection when every command can run twice (``resend``:
        the caller's word for it, else each command is judged by ``can_run_twice``)."""
        if not commands:
            return []
        # one C call a command, from C (map): a cluster's engine-key round sends one command per engine block
        raws = list(map(_pack_c or _pack_py, commands))
        if resend is None:
            resend = all(can_run_twice(c, self.resend_scripts) for c in commands)
        out = await self._run_replies(raws, await self._write_run(raws), resend=resend)
        if hiredis.ReplyError in set(map(type, out)):  # (C loops, not a generator's: a reply per engine block)
            return [ResponseError(str(r)) if isinstance(r, hiredis.ReplyError) else r for r in out]
        return out

    async def _write_run(self, raws: list[bytes]) -> tuple[_Protocol, _Run, float]:
        proto = await self._conn()
        run = _Run(len(raws), asyncio.get_running_loop().create_future())
        proto.pending.append(run)
        assert proto.transport is not None
        proto.write(b"".join(raws))
        return proto, run, time.monotonic()

    async def _run_replies(self, raws: list[bytes], written: tuple[_Protocol, _Run, float],
                           resend: bool) -> list[Any]:
        proto, run, sent = written
        try:
            return await self._reply(proto, run.fut, sent)
        except RedisConnectionError as exc:
            if not (resend and isinstance(exc, ConnectionLost) and not exc.reply_started):
                raise
            # Once more from the first unanswered one. Runs written after this one wait for the
            # same reconnect, in order, so they are written after it; had one gone first, its
            # batches would answer "gap", which the ingester recovers from.
            done = list(run.replies)
            return done + await self._run_replies(raws[len(done):], await self._write_run(raws[len(done):]),
                                                  resend=False)

    async def _reply(self, proto: _Protocol, fut: asyncio.Future, sent: float) -> Any:
        """The reply, or ConnectionError once the server has gone quiet: nothing received for
        timeout_s since the command was sent (a paused or partitioned server never closes the
        connection; without this an ingester run would wait as long as TCP does)."""
        if fut.done():
            return fut.result()
        loop = asyncio.get_running_loop()
        timeout_s = self.timeout_s

        def check() -> None:  # a timer, not wait_for's future and shield's per reply
            nonlocal timer
            if fut.done():
                return
            quiet_since = max(proto.last_rx, sent)
            if time.monotonic() - quiet_since > timeout_s:
                proto.drop(f"nothing received for {timeout_s}s")  # fails every pending future; the next reconnects
            else:
                timer = loop.call_later(quiet_since + timeout_s - time.monotonic(), check)

        timer = loop.call_later(timeout_s, check)
        try:
            # (a caller that gives up cancels ``fut``: its reply, when it comes, is read and dropped)
            return await fut
        finally:
            timer.cancel()

    async def close(self) -> None:
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.drop("closed by the client")
