"""The options every ingester socket gets: the size limits of its source, its liveness checks (ZMTP heartbeats,
TCP keepalive: ``Liveness``), and CURVE keys where it uses CURVE.

Every socket opened with them is bounded (docs/operations.md, "Hostile publishers and memory"):
ZMQ_MAXMSGSIZE makes ZMQ drop a connection whose next frame is larger than ``max_frame_bytes``
before it allocates it, and the receive queue holds ``max_queue_bytes`` worth of such frames.
"""
from __future__ import annotations

import zmq

from kv_preflight.ingester.curve import ZAP_DOMAIN
from kv_preflight.ingester.sources import Source

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def configure(sock: zmq.Socket, src: Source, *, server: bool) -> None:
    """Limits on every socket; CURVE server keys on a bound one (``server``), client keys on one that
    connects to an engine named with curve_server_key=. Any CURVE key set makes a socket speak CURVE,
    so none is set otherwise (a bound source's replay DEALER, for one, stays plain)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, src.limits.max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, src.limits.rcvhwm)
    for option, value in src.liveness.options():
        sock.setsockopt(option, value)
    if src.curve is None or not (server or src.curve_server_key):
        return
    sock.setsockopt(zmq.CURVE_PUBLICKEY, src.curve.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, src.curve.secret_key)
    if server:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        # Fail closed: with no ZAP handler answering, ZMQ would admit any key; enforced, it refuses all.
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, src.curve_server_key)
