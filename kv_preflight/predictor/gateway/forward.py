"""The gateway's one pooled HTTP client to the engines, and what counts as a failure worth another pod.

A lean HTTP/1.1 client on asyncio protocols with httptools' parser (both already the server's), over TLS for
https:// engines (verified against the system's CAs, or the bundle ``SSL_CERT_FILE`` names): keep-alive
connections pooled per engine, the request's headers and body written in one call, the answer parsed as it
arrives. It is what a proxy needs and no more, because httpx, measured here, spent about 1.2 ms of CPU per
forwarded request (its pool, anyio streams, sniffio) where the whole gateway is allowed 1 ms (docs/gateway.md).

No pool limit of its own: the gateway admits at most ``--gateway-max-inflight`` requests, each holds one
connection, so no request ever waits for a connection another, slow one holds. Connect is bounded by
``--gateway-connect-timeout``, every wait for the engine's next bytes by ``--gateway-read-timeout`` (a
generation may take minutes; a silent engine may not hold a request forever). The request body goes up as the
client sent it; the answer's body comes back as the engine sent it (no decompression), its chunked framing
undone (the gateway's own server frames it again), its headers less the hop-by-hop ones.

Retryable, before the first byte of an answer: the connection failed (refused, timed out, or closed by the
engine without an answer) or the engine answered 5xx. A kept-alive connection the engine closed just as it
was reused is tried once more, on a new connection, before that counts. Anything after the answer's first
byte is the client's answer: a stream cut short is cut short for the client too.
"""
from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from urllib.parse import urlsplit

import httptools

from kv_preflight.config import Config

# RFC 9110 7.6.1 hop-by-hop headers, and what the client sets itself from the body and URL it is given.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
_HOP = frozenset(h.encode() for h in HOP_BY_HOP)
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's header that pins a request to a data-parallel rank
KEEPALIVE_S = 30.0  # an idle connection older than this is closed rather than reused (engines close theirs too)
MAX_IDLE = 512  # idle connections kept per engine
_Key = tuple[str, str, int]  # an engine's connections: (scheme, host, port)
HIGH_WATER = 1 << 20  # answer bytes buffered before the engine's connection stops being read (client slower)


class UpstreamFailed(Exception):
    """The engine gave no answer worth passing on; ``connect``: it could not be reached at all."""

    def __init__(self, kind: str, detail: str, *, connect: bool):
        super().__init__(detail)
        self.kind, self.detail, self.connect = kind, detail, connect


class Cut(Exception):
    """The connection ended before the answer did (or the engine fell silent for the read timeout)."""


class _Conn(asyncio.Protocol):
    """One connection to an engine; one exchange at a time."""

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.idle_since = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.head: asyncio.Future | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.more = asyncio.Event()
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.got_bytes = False
        self.paused = False

    # ---- asyncio.Protocol

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Cut(f"the engine's answer does not parse: {exc}"))
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.head is not None and self.head.done() and not self.complete and not self._length_known():
            self.complete = True  # a body delimited by the connection's end (no length, not chunked)
            self.more.set()
            return
        self._fail(Cut(f"connection closed by the engine{f': {exc}' if exc else ''}"))

    # ---- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(bytes(body))
        self.buffered += len(body)
        self.more.set()
        if self.buffered > HIGH_WATER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # asked here: llhttp answers it while the message is on
        self.complete = True
        self.more.set()

    # ----

    def _length_known(self) -> bool:
        for name, value in self.headers:
            n = name.lower()
            if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
                return True
        return False

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.head is not None and not self.head.done():
            self.head.set_exception(exc)
        self.more.set()

    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None


class Response:
    """An engine's answer: status and headers read, the body streamed by ``aiter_raw`` (then ``aclose``)."""

    def __init__(self, conn: _Conn, pool: "Upstream", read_timeout_s: float):
        self._conn, self._pool, self._timeout = conn, pool, read_timeout_s
        self.status_code = conn.status
        self.headers = conn.headers
        self._done = False

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk, _ in self.aiter_last():
            yield chunk

    async def aiter_last(self) -> AsyncIterator[tuple[bytes, bool]]:
        """The body's chunks as they come, each with whether it is the last (the relay sends the last one as the
        answer's end: one send, not a chunk and then an empty end). An empty body is one empty last chunk."""
        conn = self._conn
        while True:
            while conn.chunks:
                chunk = conn.chunks.popleft()
                conn.buffered -= len(chunk)
                if conn.paused and conn.buffered < HIGH_WATER // 2 and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                if not conn.chunks and conn.complete:
                    self._done = True
                    yield chunk, True
                    return
                yield chunk, False
            if conn.complete:
                self._done = True
                yield b"", True
                return
            if conn.error is not None:
                raise conn.error
            conn.more.clear()
            try:
                async with asyncio.timeout(self._timeout):  # a timer, not a task per wait (wait_for's)
                    await conn.more.wait()
            except TimeoutError:
                raise Cut(f"no bytes from the engine within {self._timeout:g}s") from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_raw()])

    async def aclose(self) -> None:
        """Back to the pool when the answer was read whole on a connection the engine keeps open; else closed
        (the engine sees the request abandoned: vLLM aborts it)."""
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and conn.complete and conn.alive and conn.keep_alive:
            self._pool._put(conn)
        else:
            conn.close()


class Upstream:
    def __init__(self, cfg: Config):
        self.connect_timeout_s = cfg.gateway_connect_timeout_s
        self.read_timeout_s = cfg.gateway_read_timeout_s
        self._idle: dict[_Key, list[_Conn]] = {}
        self._tls: ssl.SSLContext | None = None  # made at the first https:// engine

    async def open(self, url: str, body: bytes, headers: Iterable[tuple[bytes, bytes]],
                   dp_rank: int | None = None, sent: Callable[[], None] | None = None) -> Response:
        """The engine's answer, its status and headers read, its body not yet: the caller streams and closes it.
        UpstreamFailed when the engine gave nothing worth passing on (see the module's docstring). ``sent`` is
        called as each attempt's request is written (the caller's work that need not delay the request: after)."""
        parts = urlsplit(url)
        host = parts.hostname or "127.0.0.1"
        if parts.scheme not in ("http", "https"):
            raise UpstreamFailed("scheme", f"{parts.scheme}:// engines are not supported (http:// and https://)",
                                 connect=False)
        key = (parts.scheme, host, parts.port or (443 if parts.scheme == "https" else 80))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [b"POST ", target.encode(), b" HTTP/1.1\r\nhost: ", parts.netloc.encode(), b"\r\ncontent-length: ",
                str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            if name.lower() not in _HOP:
                head += [name, b": ", value, b"\r\n"]
        if dp_rank is not None:
            head += [DP_RANK_HEADER.encode(), b": ", str(dp_rank).encode(), b"\r\n"]
        head.append(b"\r\n")
        request = b"".join(head) + body
        for attempt in (0, 1):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            try:
                return await self._exchange(conn, request, sent)
            except Cut as exc:
                conn.close()
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # a kept-alive connection the engine had closed: once more, on a new one
                raise UpstreamFailed("protocol", f"closed without an answer: {exc}", connect=False) from None
            except TimeoutError:
                conn.close()
                raise UpstreamFailed("timeout", f"no answer within {self.read_timeout_s:g}s", connect=False) from None
            except UpstreamFailed:
                raise  # a 5xx: its connection is back in the pool or closed already
            except BaseException:
                conn.close()  # cancelled (the client left): the engine sees the request abandoned
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Conn, request: bytes, sent: Callable[[], None] | None = None) -> Response:
        conn._reset()
        conn.head = asyncio.get_running_loop().create_future()
        assert conn.transport is not None
        conn.transport.write(request)
        if sent is not None:
            sent()
        async with asyncio.timeout(self.read_timeout_s):
            await conn.head
        response = Response(conn, self, self.read_timeout_s)
        if response.status_code >= 500:
            try:
                text = (await response.aread())[:300].decode("utf-8", "replace")
            except (Cut, TimeoutError):
                text = ""
            await response.aclose()
            raise UpstreamFailed("5xx", f"answered {response.status_code}: {text}", connect=False)
        return response

    async def _connect(self, key: _Key) -> _Conn:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        tls = {"ssl": self._tls_context(), "server_hostname": host} if scheme == "https" else {}
        try:
            async with asyncio.timeout(self.connect_timeout_s):  # the TLS handshake included
                _, conn = await loop.create_connection(lambda: _Conn(key), host, port, **tls)
        except TimeoutError:
            raise UpstreamFailed("connect", f"cannot connect within {self.connect_timeout_s:g}s",
                                 connect=True) from None
        except ssl.SSLError as exc:
            # the engine answers, its certificate is not trusted here (or the handshake failed): this gateway's
            # trust, not the engine's health, so the fleet is not told it is unreachable
            raise UpstreamFailed("tls", f"TLS with {host}:{port} failed: {exc.reason or exc} (a private CA: "
                                        "SSL_CERT_FILE names its PEM bundle)", connect=False) from None
        except OSError as exc:
            raise UpstreamFailed("connect", f"cannot connect: {exc.strerror or exc}", connect=True) from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        """https:// engines are verified against the system's CAs, or the bundle ``SSL_CERT_FILE`` names (OpenSSL's
        variable, which httpx, the gateway's other client, reads too): one trust for every client of the process."""
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def _take(self, key: _Key) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.alive and now - conn.idle_since < KEEPALIVE_S:
                return conn
            conn.close()
        return None

    def _put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= MAX_IDLE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


def answer_headers(response: Response) -> list[tuple[bytes, bytes]]:
    """The engine's response headers to pass on: all but hop-by-hop (content-length stays: the body is passed
    on as the engine sent it, byte for byte)."""
    return [(k, v) for k, v in response.headers if (name := k.lower()) == b"content-length" or name not in _HOP]
