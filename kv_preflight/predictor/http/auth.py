"""Optional API keys: ``Authorization: Bearer <key>`` on every route but ``/health`` and ``/ready``.

Checked in a pure ASGI middleware before any routing or body read, so a refused
request costs almost nothing. The presented key is hashed once (SHA-256) and compared
with *every* configured key's digest by ``hmac.compare_digest``, never stopping
early: the time taken says nothing about how much of a key matched, nor which key.
Keys are never logged, and the process keeps only their digests.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/ready"})
_UNAUTHORIZED = b'{"error":"missing or invalid API key: send Authorization: Bearer <key>"}'


def load_api_keys(path: str = "", inline: Iterable[str] = ()) -> list[str]:
    """Keys from a file (one per line, ``#`` comments and blank lines ignored) plus ``KVPF_API_KEYS``-style ones.

    A key list that is given but names no key (``KVPF_API_KEYS=" , "``) is an error, never "no auth".
    """
    inline = list(inline)
    keys = [k.strip() for k in inline if k.strip()]
    if inline and not keys:
        raise ValueError("KVPF_API_KEYS is set but names no key (only blanks and commas): give k1,k2, "
                         "or unset it to serve without API keys")
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ValueError(f"cannot read --api-keys-file {path}: {exc.strerror or exc}") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-keys-file {path} holds no key")
    return keys


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, keys: Iterable[str], *, on_reject: Callable[[], None] | None = None):
        self.app = app
        self.digests = [digest(k) for k in keys]
        if not self.digests:
            raise ValueError("ApiKeyAuth needs at least one key")
        self.on_reject = on_reject

    def allowed(self, authorization: bytes | None) -> bool:
        if not authorization or authorization[:7].lower() != b"bearer ":
            presented = digest(os.urandom(16))  # still compare, so a missing header takes the same path
        else:
            presented = digest(authorization[7:].strip())
        ok = False
        for d in self.digests:
            ok |= hmac.compare_digest(presented, d)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                auth = value
                break
        if self.allowed(auth):
            await self.app(scope, receive, send)
            return
        if self.on_reject:
            self.on_reject()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(_UNAUTHORIZED)).encode()),
            (b"www-authenticate", b'Bearer realm="kv-preflight"')]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
