"""What the ingester subscribes to: a source's syntax (``--source``, ``--bind``), its limits and its CURVE keys.

vLLM (0.32) *binds* its PUB socket when the endpoint contains ``*`` and *connects* otherwise, so an
ingester connects to the former (``--source``) and binds for the latter (``--bind``). The replay socket
is always a ROUTER bound by the engine.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import zmq

from kv_preflight.config import Config
from kv_preflight.engines import DEFAULT, ENGINES, engine
from kv_preflight.engines.endpoints import check_zmq_endpoint
from kv_preflight.events import Topic
from kv_preflight.ingester.curve import Curve, load_allowed_keys, load_keypair, z85_key

log = logging.getLogger("kvpf.ingester")

# A pods= allowlist is one option value: pod names joined by the one character a pod name cannot
# hold (the topic is kv@<pod>@<model>, so "@" always ends the pod).
POD_LIST_SEPARATOR = "@"
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class Limits:
    """What one socket may make this process hold (``--max-frame-bytes``, ``--max-queue-bytes``)."""

    max_frame_bytes: int = Config.max_frame_bytes
    max_queue_bytes: int = Config.max_queue_bytes

    @property
    def rcvhwm(self) -> int:
        """ZMQ counts its receive queue in messages, not bytes: as many as ``max_queue_bytes`` holds at
        the largest frame, so a full queue of one connection stays within that budget (8 by default).
        Nothing is lost to it: past it ZMQ stops reading the TCP connection and the engine's
        PUB queue (vLLM's hwm: 100,000 messages) holds the rest; beyond that, gaps are replayed.
        ``Subscriber.receive`` waits a moment for a queue it emptied to refill, so batching holds up."""
        return max(1, self.max_queue_bytes // self.max_frame_bytes)



@dataclass(frozen=True)
class Liveness:
    """How a socket notices a connection that went dead without a word (``--zmq-heartbeat``, ``--tcp-keepalive``):
    a middlebox that dropped the engine's half of the connection and left ours open and silent, a partition, an
    engine host gone. ZMTP heartbeats are what notice those: the side that sets ZMQ_HEARTBEAT_IVL sends PINGs and
    any ZMTP 3.1 peer answers PONG by itself (vLLM sets none: our SUB and DEALER sockets are the ones that ask),
    and no traffic within ``heartbeat_timeout_s`` closes the connection, which libzmq then connects again (a
    connecting socket) or the engine does (a bound one). TCP keepalive also closes a connection to a host that
    vanished, where the kernel alone would wait for hours."""

    heartbeat_s: float = Config.zmq_heartbeat_s  # PING interval; 0: no heartbeat
    heartbeat_timeout_s: float = Config.zmq_heartbeat_timeout_s  # no traffic this long after a PING: closed
    keepalive_s: float = Config.tcp_keepalive_s  # idle before the first TCP keepalive probe; 0: the OS default (off)

    def options(self) -> list[tuple[int, int]]:
        """(ZMQ option, value) pairs for a socket."""
        out: list[tuple[int, int]] = []
        if self.heartbeat_s > 0:
            timeout_ms = int(self.heartbeat_timeout_s * 1000)
            out += [(zmq.HEARTBEAT_IVL, int(self.heartbeat_s * 1000)), (zmq.HEARTBEAT_TIMEOUT, timeout_ms),
                    # the peer may drop us after as long without a word from us (vLLM's PUB has no other way to
                    # free a subscriber that vanished); a ZMTP handshake that does not finish in that time is
                    # abandoned and tried again (libzmq waits 30 s by default: a partition that heals would)
                    (zmq.HEARTBEAT_TTL, min(timeout_ms, 6_553_500)), (zmq.HANDSHAKE_IVL, timeout_ms)]
        if self.keepalive_s > 0:
            idle = max(1, int(self.keepalive_s))
            out += [(zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, idle),
                    (zmq.TCP_KEEPALIVE_INTVL, max(1, idle // 3)), (zmq.TCP_KEEPALIVE_CNT, 3)]
        return out


@dataclass(frozen=True)
class Source:
    endpoint: str
    bind: bool = False
    replay: str | None = None
    topic: str | None = None  # known when discovered from the engine
    rank: int | None = None  # data-parallel rank, known when discovered (each rank has its own sockets)
    pods: frozenset[str] | None = None  # pods= : frames of any other pod on this socket are refused
    curve_server_key: bytes | None = None  # curve_server_key= : the engine's public key (connecting sockets)
    limits: Limits = Limits()
    liveness: Liveness = Liveness()
    curve: Curve | None = None  # ours: a bound socket is a CURVE server; a connecting one uses it as client keys
    engine: str = DEFAULT  # engine= : the adapter that decodes its frames (kv_preflight/engines/)
    pod: str | None = None  # pod= and model= : the publisher's topic is empty or foreign; these name it
    model: str | None = None
    serving: str | None = None  # the rank's serving address "<ip>:<port>", llm-d-router's pod id (--pod-id endpoint)

    @property
    def named_topic(self) -> Topic | None:
        """The pod and model the command line gave this source, standing for its topic frame."""
        return Topic(self.pod, self.model) if self.pod and self.model else None


def parse_source(spec: str, *, bind: bool = False) -> Source:
    """``ENDPOINT[,replay=ENDPOINT][,pods=POD@POD...][,curve_server_key=Z85][,pod=P,model=M][,engine=E]``."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or not parts[0].startswith(_SCHEMES):
        raise ValueError(f"source {spec!r} must start with tcp://, ipc:// or inproc://")
    if not parts[0].startswith("inproc://"):  # inproc: a socket of this process (tests)
        check_zmq_endpoint(parts[0], bind=bind)
    replay, pods, server_key = None, None, None
    named: dict[str, str] = {}
    for opt in parts[1:]:
        key, sep, value = opt.partition("=")
        if key in ("pod", "model", "engine") and sep and value.strip():
            named[key] = value.strip()
        elif key == "replay" and sep and value.startswith(_SCHEMES):
            replay = value if value.startswith("inproc://") else check_zmq_endpoint(value, bind=False)
        elif key == "pods" and sep:
            names = [p.strip() for p in value.split(POD_LIST_SEPARATOR)]
            if not all(names):
                raise ValueError(f"source option {opt!r}: pods=POD{POD_LIST_SEPARATOR}POD... with no empty name")
            pods = frozenset(names)
        elif key == "curve_server_key" and sep:
            if bind:
                raise ValueError("curve_server_key= is for --source (the engine is the CURVE server); a --bind "
                                 "socket is a server itself: --curve-secret-key-file and --curve-allow")
            server_key = z85_key(value, "curve_server_key")
        else:
            raise ValueError(f"source option {opt!r} is not replay=tcp://HOST:PORT, pods=POD{POD_LIST_SEPARATOR}POD..., "
                             f"curve_server_key=Z85, pod=POD, model=MODEL or engine={'|'.join(sorted(ENGINES))}")
    name = engine(named.get("engine")).name  # ValueError naming the engines for an unknown one
    pod, model = named.get("pod"), named.get("model")
    if (pod is None) != (model is None):
        raise ValueError(f"source {parts[0]}: pod= and model= go together (they stand for the topic kv@POD@MODEL)")
    if pod is not None and POD_LIST_SEPARATOR in pod:
        raise ValueError(f"source {parts[0]}: pod={pod!r} may not contain {POD_LIST_SEPARATOR!r}")
    if pod is not None and pods is not None:
        raise ValueError(f"source {parts[0]}: pod= names the one pod of this socket; pods= would be redundant")
    return Source(endpoint=parts[0], bind=bind, replay=replay, pods=pods, curve_server_key=server_key,
                  engine=name, pod=pod, model=model)


def secure_sources(sources: list[Source], cfg: Config,
                   on_refused: Callable[[bytes], None] | None = None) -> list[Source]:
    """The sources with the config's limits and CURVE settings; raises ValueError on a bad key file
    or a combination that would leave a bound CURVE socket open to any key."""
    if cfg.curve_allow and not cfg.curve_secret_key_file:
        raise ValueError("--curve-allow needs --curve-secret-key-file (the ingester's own keypair)")
    limits = Limits(cfg.max_frame_bytes, cfg.max_queue_bytes)
    liveness = Liveness(cfg.zmq_heartbeat_s, cfg.zmq_heartbeat_timeout_s, cfg.tcp_keepalive_s)
    curve = None
    if cfg.curve_secret_key_file:
        public, secret = load_keypair(cfg.curve_secret_key_file)
        allowed = load_allowed_keys(cfg.curve_allow) if cfg.curve_allow else frozenset()
        if any(s.bind for s in sources) and not allowed:
            raise ValueError("--curve-secret-key-file with --bind needs --curve-allow: a CURVE server that admits "
                             "any key authenticates nobody")
        curve = Curve(public, secret, allowed, on_refused)
    elif any(s.curve_server_key for s in sources):
        public, secret = zmq.curve_keypair()  # the engine admits any client key, or lists ours: give the file then
        curve = Curve(public, secret)
    out = []
    for s in sources:
        uses_curve = s.curve_server_key is not None if not s.bind else curve is not None
        out.append(replace(s, limits=limits, liveness=liveness, curve=curve if uses_curve else None))
        if s.bind and not uses_curve:
            log.warning("%s accepts any publisher, which can then write for %s: give --curve-secret-key-file "
                        "and --curve-allow, or a pods= allowlist", s.endpoint,
                        "any pod" if s.pods is None else "the pods " + POD_LIST_SEPARATOR.join(sorted(s.pods)))
    return out
