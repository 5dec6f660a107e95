"""Reading a predict or route body within its limits: media type, size and time.

Each limit is checked as early as it can be known: the media type and a declared
Content-Length before a byte of body is read, the size again while streaming (a
chunked body declares none), and the time around the whole read, so a client that
trickles its body (or stops sending it) is answered 408 instead of holding a
connection and a task forever. The time to send the headers is bounded by the
server protocol (predictor/http/protocols.py); this bounds the body after them.
"""
from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope

from kv_preflight.predictor.errors import BadRequest, BodyTooLarge, RequestTimeout, UnsupportedMediaType, clip


def is_json_media_type(content_type: str | None) -> bool:
    """JSON, in any spelling a client may send: ``application/json`` (any parameters, e.g. charset) or a
    ``application/*+json`` suffix type. No Content-Type at all is read as JSON, as curl ``-d`` users expect
    nothing else; one that names another type (a form, plain text) is a client mistake worth saying."""
    if content_type is None or not content_type.strip():
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json_body(request: Request, *, limit: int, timeout_s: float) -> bytes:
    """The body of a JSON request, or the PredictorError that says which limit it broke.

    A client that disconnects mid-body raises starlette's ``ClientDisconnect``, which the caller
    counts as such (it is not a server error).
    """
    return await read_json(request.scope, request.receive, limit=limit, timeout_s=timeout_s)


async def read_json(scope: Scope, receive: Receive, *, limit: int, timeout_s: float) -> bytes:
    """``read_json_body`` from the ASGI scope and receive channel themselves (the gateway's path: no Request,
    no Headers object, read for every forwarded request)."""
    content_type = declared = None
    for name, value in scope["headers"]:
        if name == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif name == b"content-length" and declared is None:
            declared = value.decode("latin-1")
    if not is_json_media_type(content_type):
        raise UnsupportedMediaType(f"Content-Type {clip(repr(content_type))} is not JSON: send application/json "
                                   "(or no Content-Type)")
    try:
        async with asyncio.timeout(timeout_s):
            return await read_body(receive, declared, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s (request_read_timeout)") from None


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed ``limit``: by header, else while streaming."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length {clip(repr(declared))}") from None
        if size > limit:
            raise BodyTooLarge(f"body of {size} bytes exceeds the limit of {limit} bytes (max_body_bytes)")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
