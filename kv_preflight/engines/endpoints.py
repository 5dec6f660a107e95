"""ZMQ endpoint rules shared by the engine adapters: who binds, where to reach an endpoint an engine
binds, what to bind for one it connects to, and the serving address llm-d-router names a rank by.

Pure apart from ``serving_address``, which resolves a host name to the pod IP when it must.
"""
from __future__ import annotations

import ipaddress
import re
import logging
import socket
from urllib.parse import urlsplit

log = logging.getLogger("kvpf.engines")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (0.32, distributed/kv_events.py ``_is_bind_endpoint``): the engine binds a wildcard
    (``*``), anything with ``::`` and ipc/inproc endpoints, and connects to any other; its subscriber
    must do the opposite."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def host_part(host: str) -> str:
    """A host as it goes before ``:PORT``: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def reachable(endpoint: str, host: str) -> str:
    """Where to connect to an endpoint the engine binds, from here: ``tcp://*:5557`` and
    ``tcp://[::]:5557`` are ``tcp://<engine host>:5557`` (IPv6 hosts in brackets); ipc:// paths are
    the same path (an engine on this host); an explicit host is kept."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    rest = endpoint[len("tcp://"):]
    addr, _, port = rest.rpartition(":")
    if addr in ("*", "[::]", "::", "[*]", "0.0.0.0", ""):
        return f"tcp://{host_part(host)}:{port}"
    return endpoint


def bind_for(endpoint: str) -> str:
    """What to bind for an engine that connects to ``tcp://host:port``: ``tcp://*:port`` (``[::]`` for
    an IPv6 host, so both families are accepted)."""
    rest = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else endpoint
    addr, _, port = rest.rpartition(":")
    return f"tcp://{'[::]' if addr.startswith('[') else '*'}:{port}"


def serving_address(engine_url: str, rank: int, target_ports: tuple[int, ...] = ()) -> str:
    """The pod identifier llm-d-router (>= v0.10, PR #2233) writes for a rank: ``<pod IP>:<the
    InferencePool's target port of that rank>`` (preciseprefixcache/extractor.go ``sourceEndpoint``, with
    datastore.go ``Address: pod.Status.PodIP, Port: TargetPorts[rank]``), formatted ``%s:%s`` (an IPv6
    address has no brackets). The IP is the engine URL's host, resolved if it is a name; the port
    ``target_ports[rank]`` (``ingest --target-ports``), else the URL's port plus the rank."""
    parts = urlsplit(engine_url)
    host = parts.hostname or "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            host = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError:
            log.warning("%s: cannot resolve %s to the pod IP llm-d names the pod by; using the name", engine_url, host)
    if rank < len(target_ports):
        port = target_ports[rank]
    else:
        port = (parts.port or (443 if parts.scheme == "https" else 80)) + rank
    return f"{host}:{port}"


# ---- checking an endpoint before any socket sees it

# A Unix socket path holds at most 107 bytes (sockaddr_un.sun_path is 108, NUL included); libzmq refuses a
# longer one only when the socket binds or connects, as an error that used to end the ingester.
IPC_PATH_MAX = 107
_TCP_ENDPOINT = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|\*|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?):([0-9]{1,5})")
_WILDCARDS = ("*", "[::]", "0.0.0.0", "[*]")


def check_zmq_endpoint(endpoint: str, *, bind: bool) -> str:
    """``endpoint`` if a socket of this process can use it in that direction (``bind``: we bind it for an
    engine that connects; else we connect to it), else ValueError saying why. Checked whole (``fullmatch``:
    no trailing newline or space passes), so nothing libzmq would refuse reaches a socket:
    ``tcp://HOST:PORT`` with a port 1-65535 (a wildcard host only to bind), ``ipc://PATH`` of at most 107
    bytes with no control character; ``inproc://`` lives inside another process, out of our reach."""
    if not isinstance(endpoint, str) or not endpoint:
        raise ValueError("empty endpoint")
    shown = repr(endpoint[:120])
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        # "@" alone: an abstract-namespace socket with no name, which libzmq refuses (EINVAL)
        if path in ("", "@") or any(ord(c) < 32 or ord(c) == 127 for c in path):
            raise ValueError(f"endpoint {shown}: an ipc:// path, non-empty, with no control character")
        if len(path.encode()) > IPC_PATH_MAX:
            raise ValueError(f"endpoint {shown}: ipc path of {len(path.encode())} bytes, over the {IPC_PATH_MAX} "
                             "a Unix socket path may hold")
        return endpoint
    if endpoint.startswith("inproc://"):
        raise ValueError(f"endpoint {shown}: inproc:// names a socket inside another process")
    m = _TCP_ENDPOINT.fullmatch(endpoint)
    if m is None:
        raise ValueError(f"endpoint {shown}: expected tcp://HOST:PORT or ipc://PATH")
    host, port = m.group(1), int(m.group(2))
    if not 1 <= port <= 65535:
        raise ValueError(f"endpoint {shown}: port {port} is not 1-65535")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"endpoint {shown}: {host} is not an IPv6 address") from None
    if not bind and host in _WILDCARDS:
        raise ValueError(f"endpoint {shown}: a wildcard host names nothing to connect to")
    return endpoint


def endpoint_identity(endpoint: str) -> str:
    """What an endpoint reaches, for telling two spellings of one socket apart: every loopback address
    (127.0.0.0/8, ::1, localhost) is one host, addresses are compared in canonical form, host names in lower
    case, ports as numbers; an ipc:// path as given."""
    m = _TCP_ENDPOINT.fullmatch(endpoint)
    if m is None:
        return endpoint
    host, port = m.group(1).strip("[]").lower(), int(m.group(2))
    try:
        addr = ipaddress.ip_address(host)
        host = "loopback" if addr.is_loopback else addr.compressed
    except ValueError:
        host = "loopback" if host == "localhost" else host
    return f"tcp://{host}:{port}"
