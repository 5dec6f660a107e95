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

from starlette.requests import Request

from kv_preflight.predictor.http.errors import BadRequest, BodyTooLarge, RequestTimeout, UnsupportedMediaType, clip


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
    content_type = request.headers.get("content-type")
    if not is_json_media_type(content_type):
        raise UnsupportedMediaType(f"Content-Type {clip(repr(content_type))} is not JSON: send application/json "
                                   "(or no Content-Type)")
    try:
        async with asyncio.timeout(timeout_s):
            return await read_body(request, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g}s (request_read_timeout)") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing (413) as soon as it is known to exceed ``limit``: by header, else while streaming."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise BadRequest(f"invalid Content-Length {clip(repr(declared))}") from None
        if size > limit:
            raise BodyTooLarge(f"body of {size} bytes exceeds the limit of {limit} bytes (max_body_bytes)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body exceeds the limit of {limit} bytes (max_body_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)
