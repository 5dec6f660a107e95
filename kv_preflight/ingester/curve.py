"""CURVE for the ingester's sockets: key files (z85 text, as zmq.auth.create_certificates writes them),
this ingester's keypair, and the allow list a bound socket's ZAP handler checks publishers against.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

log = logging.getLogger("kvpf.ingester")

ZAP_DOMAIN = b"kvpf"


@dataclass(frozen=True)
class Curve:
    """This ingester's CURVE keypair (z85) and, on bound sockets, the publisher keys admitted."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed: frozenset[bytes] = frozenset()
    on_refused: Callable[[bytes], None] | None = field(default=None, compare=False, repr=False)



def z85_key(text: str | bytes, what: str) -> bytes:
    """A 40-character z85 CURVE key, checked."""
    key = (text.encode() if isinstance(text, str) else text).strip()
    try:
        ok = len(key) == 40 and len(z85.decode(key)) == 32
    except Exception:
        ok = False
    if not ok:
        raise ValueError(f"{what}: not a 40-character z85 CURVE key")
    return key


def load_keypair(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``*.key_secret`` certificate (zmq.auth.create_certificates), or from a
    file holding nothing but the 40-character z85 secret key (the public key is derived)."""
    text = Path(path).read_bytes()
    if b"secret-key" in text:
        public, secret = zmq.auth.load_certificate(path)
        if not secret:
            raise ValueError(f"{path}: no secret-key in the certificate")
        return z85_key(public, path), z85_key(secret, path)
    secret = z85_key(text, path)
    return zmq.curve_public(secret), secret


def load_allowed_keys(path: str) -> frozenset[bytes]:
    """Publisher public keys: a directory of certificates (each ``*.key`` / ``*.key_secret``), one
    certificate, or a text file of z85 public keys, one per line, anything after the key and a space
    ignored; ``# `` (hash, space) starts a comment line ("#" alone is a z85 character)."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.suffix in (".key", ".key_secret")) if p.is_dir() else [p]
    keys: set[bytes] = set()
    for f in files:
        text = f.read_bytes()
        if b"public-key" in text:
            keys.add(z85_key(zmq.auth.load_certificate(f)[0], str(f)))
            continue
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if words and words[0] != b"#":
                keys.add(z85_key(words[0], f"{f}:{n}"))
    if not keys:
        raise ValueError(f"--curve-allow {path}: no public key found")
    return frozenset(keys)


class AllowList:
    """The ZAP credentials check of bound CURVE sockets: a publisher key is in --curve-allow or refused."""

    def __init__(self, keys: frozenset[bytes], on_refused: Callable[[bytes], None] | None):
        self.keys = keys
        self.on_refused = on_refused
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        if self.on_refused is not None:
            self.on_refused(key)
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("refused a publisher: CURVE key %s is not in --curve-allow (%d refused so far)",
                        key[:40].decode("ascii", "replace"), self.refused)
        return False
