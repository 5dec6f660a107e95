"""uvicorn's HTTP protocols with a deadline on a request's headers.

uvicorn (0.54) bounds only the idle time between requests (``timeout_keep_alive``):
a client that opens a connection and sends half a header line, or one byte a
minute, holds the connection (and its file descriptor) for as long as it likes, so
a few thousand such clients exhaust the server. These subclasses arm a timer when a
connection opens and when a new request's first byte arrives, and disarm it once the
headers are complete; if it fires first, the client gets a 408 and the connection is
closed. The body is bounded separately, by the handler (predictor/http/body.py), so a
request's headers and then its body each get ``read_timeout_s``.

uvicorn builds its protocol with ``http_protocol_class(config=..., server_state=...,
app_state=..., _loop=...)``; ``protocol_factory`` returns a ``functools.partial`` of one
of these classes that adds the timeout, which pickles (module-level class, plain
arguments), so it reaches ``--workers`` processes too.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvpf.predictor")

# Connections open now, per client address and in all, in this process; and those refused, by reason
# (PredictorMetrics reads REFUSED into kvpf_connections_refused).
OPEN: dict[str, int] = {}
REFUSED: dict[str, int] = {"per_client": 0, "total": 0}
_TOO_MANY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
             b"content-length: %d\r\nconnection: close\r\n\r\n%s")


def connection_cap(max_connections: int) -> int:
    """``max_connections``, or with 0 what the open-file limit leaves (64 descriptors kept for Valkey, engines
    and files), so new connections are refused with a 503 rather than left unaccepted (EMFILE)."""
    if max_connections > 0:
        return max_connections
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 4096
    return max(16, (soft if soft > 0 else 4096) - 64)

_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n%s")


class _HeaderDeadline:
    """The timer and what to do when it fires; mixed into both protocol classes."""

    read_timeout_s: float
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None
    _header_timer: asyncio.TimerHandle | None

    def __init__(self, *args: Any, read_timeout_s: float, max_per_client: int = 0, max_total: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]  # the uvicorn protocol's
        self.read_timeout_s = read_timeout_s
        self.max_per_client = max_per_client
        self.max_total = max_total
        self._header_timer = None
        self._counted: str | None = None  # the client address this connection is counted under

    def connection_made(self, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        reason = ""
        if self.max_total and sum(OPEN.values()) >= self.max_total:
            reason = "total"
        elif self.max_per_client and OPEN.get(address, 0) >= self.max_per_client:
            reason = "per_client"
        if reason:  # answered and closed at once: a client holding many connections locks nobody else out
            REFUSED[reason] += 1
            body = b'{"error":"too many connections (%s limit)"}' % reason.encode()
            transport.write(_TOO_MANY % (len(body), body))
            transport.close()
            if REFUSED[reason] <= 10 or REFUSED[reason] % 1000 == 0:
                log.warning("refused a connection from %s: %s connection limit reached (%d refused so far)", address,
                            reason.replace("_", " "), REFUSED[reason])
            self.transport = transport
            return
        OPEN[address] = OPEN.get(address, 0) + 1
        self._counted = address
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted is None:  # refused in connection_made: the protocol never started
            return
        address, self._counted = self._counted, None
        left = OPEN.get(address, 1) - 1
        if left > 0:
            OPEN[address] = left
        else:
            OPEN.pop(address, None)
        self._disarm_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._counted is None:
            return  # a refused connection: its bytes are not read
        super().data_received(data)  # type: ignore[misc]

    def _arm_header_deadline(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.read_timeout_s, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:  # never write into another request's response
            body = (b'{"error":"request headers did not arrive within %gs (request_read_timeout)"}'
                    % self.read_timeout_s)
            self.transport.write(_REQUEST_TIMEOUT % (len(body), body))
        self.transport.close()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        log.info("closed the connection of %s: request headers not received within %gs", client, self.read_timeout_s)


class BoundedH11Protocol(_HeaderDeadline, H11Protocol):
    def data_received(self, data: bytes) -> None:
        if self._counted is None:
            return
        if self.conn.their_state is h11.IDLE:  # bytes of a new request (or of its headers, still incomplete)
            self._arm_header_deadline()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # h11 produced the Request: the headers are complete
            self._disarm_header_deadline()


if importlib.util.find_spec("httptools") is not None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        def on_message_begin(self) -> None:  # the first byte of a request (httptools' callback)
            super().on_message_begin()
            self._arm_header_deadline()

        def on_headers_complete(self) -> None:
            self._disarm_header_deadline()
            super().on_headers_complete()
else:  # pragma: no cover
    BoundedHttpToolsProtocol = None  # type: ignore[assignment,misc]


def protocol_factory(http: str, read_timeout_s: float, max_per_client: int = 0,
                     max_total: int = 0) -> functools.partial:
    """What to give uvicorn as ``http``: ``"httptools"`` or ``"h11"``, with the header deadline and the
    connection limits (per client address, in all; 0: none)."""
    cls = BoundedH11Protocol
    if http == "httptools" and BoundedHttpToolsProtocol is not None:
        cls = BoundedHttpToolsProtocol
    return functools.partial(cls, read_timeout_s=read_timeout_s, max_per_client=max_per_client, max_total=max_total)
