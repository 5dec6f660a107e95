"""ZMQ edges: SUB sockets in both directions and the replay client.

vLLM (0.32) *binds* its PUB socket when the endpoint contains ``*`` and *connects*
otherwise, so an ingester connects to the former (``--source``) and binds for the
latter (``--bind``). The replay socket is always a ROUTER bound by the engine.

Every socket opened here is bounded (docs/operations.md, "Hostile publishers and memory"):
ZMQ_MAXMSGSIZE makes ZMQ drop a connection whose next frame is larger than ``max_frame_bytes``
before it allocates it, and the receive queue holds ``max_queue_bytes`` worth of such frames.
A bound socket can be a CURVE server admitting only listed publisher keys, and any socket can
carry a ``pods=`` allowlist (enforced where frames are accepted, ingester/service.py).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.monitor
from zmq.utils import z85

from kv_preflight.config import Config
from kv_preflight.engines import ENGINES, engine
from kv_preflight.events import SEQ_END, DecodedFrame, Topic

log = logging.getLogger("kvpf.ingester")

# A pods= allowlist is one option value: pod names joined by the one character a pod name cannot
# hold (the topic is kv@<pod>@<model>, so "@" always ends the pod).
POD_LIST_SEPARATOR = "@"
ZAP_DOMAIN = b"kvpf"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class Limits:
    """What one socket may make this process hold (``--max-frame-bytes``, ``--max-queue-bytes``)."""

    max_frame_bytes: int = Config.max_frame_bytes
    max_queue_bytes: int = Config.max_queue_bytes

    @property
    def rcvhwm(self) -> int:
        """ZMQ counts its receive queue in messages, not bytes: as many as ``max_queue_bytes`` holds at
        the largest frame, so a full queue of one connection stays within that budget (8 by default, it
        was 200,000). Nothing is lost to it: past it ZMQ stops reading the TCP connection and the engine's
        PUB queue (vLLM's hwm: 100,000 messages) holds the rest; beyond that, gaps are replayed.
        ``Subscriber.receive`` waits a moment for a queue it emptied to refill, so batching holds up."""
        return max(1, self.max_queue_bytes // self.max_frame_bytes)


@dataclass(frozen=True)
class Curve:
    """This ingester's CURVE keypair (z85) and, on bound sockets, the publisher keys admitted."""

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed: frozenset[bytes] = frozenset()
    on_refused: Callable[[bytes], None] | None = field(default=None, compare=False, repr=False)


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
    curve: Curve | None = None  # ours: a bound socket is a CURVE server; a connecting one uses it as client keys
    engine: str = "vllm"  # engine= : the adapter that decodes its frames (kv_preflight/engines/)
    pod: str | None = None  # pod= and model= : the publisher's topic is empty or foreign; these name it
    model: str | None = None

    @property
    def named_topic(self) -> Topic | None:
        """The pod and model the command line gave this source, standing for its topic frame."""
        return Topic(self.pod, self.model) if self.pod and self.model else None
    serving: str | None = None  # the rank's serving address "<ip>:<port>", llm-d-router's pod id (--pod-id endpoint)


def parse_source(spec: str, *, bind: bool = False) -> Source:
    """``ENDPOINT[,replay=ENDPOINT][,pods=POD@POD...][,curve_server_key=Z85][,pod=P,model=M][,engine=E]``."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or not parts[0].startswith(_SCHEMES):
        raise ValueError(f"source {spec!r} must start with tcp://, ipc:// or inproc://")
    replay, pods, server_key = None, None, None
    named: dict[str, str] = {}
    for opt in parts[1:]:
        key, sep, value = opt.partition("=")
        if key in ("pod", "model", "engine") and sep and value.strip():
            named[key] = value.strip()
        elif key == "replay" and sep and value.startswith(_SCHEMES):
            replay = value
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


# ---- CURVE keys (z85 text, as zmq.auth.create_certificates writes them)


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


def secure_sources(sources: list[Source], cfg: Config,
                   on_refused: Callable[[bytes], None] | None = None) -> list[Source]:
    """The sources with the config's limits and CURVE settings; raises ValueError on a bad key file
    or a combination that would leave a bound CURVE socket open to any key."""
    if cfg.curve_allow and not cfg.curve_secret_key_file:
        raise ValueError("--curve-allow needs --curve-secret-key-file (the ingester's own keypair)")
    limits = Limits(cfg.max_frame_bytes, cfg.max_queue_bytes)
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
        out.append(replace(s, limits=limits, curve=curve if uses_curve else None))
        if s.bind and not uses_curve:
            log.warning("%s accepts any publisher, which can then write for %s: give --curve-secret-key-file "
                        "and --curve-allow, or a pods= allowlist", s.endpoint,
                        "any pod" if s.pods is None else "the pods " + POD_LIST_SEPARATOR.join(sorted(s.pods)))
    return out


def _configure(sock: zmq.Socket, src: Source, *, server: bool) -> None:
    """Limits on every socket; CURVE server keys on a bound one (``server``), client keys on one that
    connects to an engine named with curve_server_key=. Any CURVE key set makes a socket speak CURVE,
    so none is set otherwise (a bound source's replay DEALER, for one, stays plain)."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, src.limits.max_frame_bytes)
    sock.setsockopt(zmq.RCVHWM, src.limits.rcvhwm)
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


class _AllowList:
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


# Replay endpoint -> the source it belongs to, so fetch_replay (called with an endpoint) opens its
# DEALER with that source's limits and CURVE keys. Filled by Subscriber for the sockets it opens.
_replay_sources: dict[str, Source] = {}


# A receive waits at most this long for a first message, so sockets added meanwhile are polled soon.
POLL_MS = 500


class Subscriber:
    """All SUB sockets of one ingester, read as one stream of (source, frames)."""

    def __init__(self, sources: list[Source], ctx: zmq.asyncio.Context | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.sources = sources
        self.sockets: list[zmq.asyncio.Socket] = []
        self.poller = zmq.asyncio.Poller()
        self.monitors: dict[zmq.asyncio.Socket, Source] = {}
        self._drops: dict[int, int] = {}  # source index -> drops (connecting: since its last good handshake)
        self._peers: dict[int, int] = {}  # bound source with pod= -> publishers connected now
        self._reconnects: dict[int, asyncio.TimerHandle] = {}
        # One receive takes at most this many bytes (and at least one message): decoded, a batch
        # takes about ten times its wire size, and a receive is decoded whole.
        self.receive_bytes = max((s.limits.max_frame_bytes for s in sources), default=Config.max_frame_bytes)
        self.authenticator = None
        self.add(sources)

    def _ensure_authenticator(self, sources: list[Source]) -> None:
        servers = [s for s in sources if s.bind and s.curve is not None]
        if not servers or self.authenticator is not None:
            return
        # Started before any bind, so no handshake can happen without it (and ZAP_ENFORCE_DOMAIN
        # refuses every key if it is ever gone).
        from zmq.auth.asyncio import AsyncioAuthenticator

        self.allow_list = _AllowList(frozenset().union(*(s.curve.allowed for s in servers)),
                                     servers[0].curve.on_refused)
        self.authenticator = AsyncioAuthenticator(self.ctx)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                                    credentials_provider=self.allow_list)

    def add(self, sources: list[Source]) -> None:
        """Open sockets for more sources (at start, and for engines discovered later)."""
        self._ensure_authenticator(sources)
        if self.sources is not sources:
            self.sources.extend(sources)
        self.receive_bytes = max((s.limits.max_frame_bytes for s in self.sources), default=Config.max_frame_bytes)
        for src in sources:
            sock = self.ctx.socket(zmq.SUB)
            _configure(sock, src, server=src.bind)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if src.replay:
                _replay_sources[src.replay] = src
            if "[" in src.endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            if src.bind:
                sock.bind(src.endpoint)
            else:
                sock.connect(src.endpoint)
            self.sockets.append(sock)
            self.poller.register(sock, zmq.POLLIN)
            # Connecting: every (re)connection is reported once its handshake is done, so an engine that
            # restarted behind the same endpoint can be probed before it publishes anything; drops and
            # failed handshakes too (see _dropped). Bound: drops only, logged (the publisher reconnects).
            # A bound socket named with pod= counts its publishers too: its frames carry no pod of their own,
            # so it is only trusted while exactly one publisher is connected (see ``crowded``).
            mon = sock.get_monitor_socket((zmq.EVENT_DISCONNECTED | (zmq.EVENT_ACCEPTED if src.pod else 0)) if src.bind
                                          else zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
            self.monitors[mon] = src
            self.poller.register(mon, zmq.POLLIN)
            log.info("subscribed", extra={"endpoint": src.endpoint, "mode": "bind" if src.bind else "connect",
                                          "curve": src.curve is not None, "pods": sorted(src.pods or ())})

    async def receive(self, max_messages: int = 512) -> list[tuple[Source, list[bytes] | None]]:
        """At least one message; more if they are already queued (batched application), up to
        ``max_messages`` and ``receive_bytes``. ``None`` instead of frames means the source has
        just (re)connected."""
        out: list[tuple[Source, list[bytes] | None]] = []
        data = []
        while not out and not data:
            ready = await self.poller.poll(timeout=POLL_MS)
            if not ready:
                return out  # nothing for a while: the caller polls again (and sees sockets added since)
            for sock, _ in ready:
                if sock in self.monitors:
                    src = self.monitors[sock]
                    event = zmq.utils.monitor.parse_monitor_message(await sock.recv_multipart())["event"]
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self._drops.pop(self.sources.index(src), None)
                        out.append((src, None))
                    elif event == zmq.EVENT_ACCEPTED:
                        self._accepted(src)
                    elif event == zmq.EVENT_DISCONNECTED:
                        self._dropped(src)
                    elif self._drops.get(self.sources.index(src), 0) < 3:  # then the drop follows
                        log.warning("%s: handshake failed (a wrong curve_server_key, or CURVE on one side only)",
                                    src.endpoint)
                else:
                    data.append(sock)
        taken = {sock: 0 for sock in data}
        size = 0
        # Round-robin over the ready sockets, so one busy engine cannot starve the others.
        while data and len(out) < max_messages and size < self.receive_bytes:
            for sock in list(data):
                src = self.sources[self.sockets.index(sock)]
                try:
                    frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    # A queue that was full (rcvhwm messages taken) has more behind it in the TCP
                    # connection: ZMQ reads it as soon as we drained, so wait a moment for it.
                    if taken[sock] < src.limits.rcvhwm or not await sock.poll(timeout=1):
                        data.remove(sock)
                    taken[sock] = 0
                    continue
                taken[sock] += 1
                size += sum(len(f) for f in frames)
                out.append((src, frames))
                if len(out) >= max_messages or size >= self.receive_bytes:
                    break
        return out

    def crowded(self, src: Source) -> bool:
        """A bound socket named with pod= while more than one publisher is connected to it: whose frame is
        whose cannot be told, so its frames are refused until only one is left."""
        return bool(src.bind and src.pod and self._peers.get(self.sources.index(src), 0) > 1)

    def _accepted(self, src: Source) -> None:
        i = self.sources.index(src)
        peers = self._peers[i] = self._peers.get(i, 0) + 1
        if peers > 1:
            log.error("%s: %d publishers connected to a socket named pod=%s: its frames are refused until only one "
                      "is left (give each publisher its own --bind, or let them publish kv@POD@MODEL topics)",
                      src.endpoint, peers, src.pod)

    def _dropped(self, src: Source) -> None:
        i = self.sources.index(src)
        drops = self._drops[i] = self._drops.get(i, 0) + 1
        if i in self._peers:
            self._peers[i] = max(0, self._peers[i] - 1)
        if src.bind:
            if drops <= 10 or drops % 1000 == 0:
                log.warning("%s: a publisher's connection dropped (a frame over --max-frame-bytes %d, a refused "
                            "CURVE key, or the publisher went away); %d so far", src.endpoint,
                            src.limits.max_frame_bytes, drops)
            return
        self._reconnect_later(i, drops)

    def _reconnect_later(self, i: int, drops: int) -> None:
        """After a protocol error (a frame over ZMQ_MAXMSGSIZE is one, a failed CURVE handshake another)
        libzmq 4.3 ends a connecting socket's session for good, it does not retry: so connect again, or
        the engine's events would stop here silently (a plain drop it would retry itself; connecting anew
        does the same). The oversized frame is not sent again (PUB never resends), so the seqs lost are a
        gap, replayed or flagged. Drops with no good handshake between them back off, 0.1 s doubling to
        5 s, so a peer that always fails is not hammered."""
        if i in self._reconnects:
            return
        src = self.sources[i]
        delay = min(5.0, 0.1 * 2 ** (drops - 1))
        if drops <= 3 or drops % 100 == 0:
            log.warning("%s: connection dropped (a frame over --max-frame-bytes %d, a failed handshake, or the "
                        "engine went away); reconnecting in %.1f s", src.endpoint, src.limits.max_frame_bytes, delay)
        self._reconnects[i] = asyncio.get_running_loop().call_later(delay, self._reconnect, i)

    def _reconnect(self, i: int) -> None:
        self._reconnects.pop(i, None)
        sock, endpoint = self.sockets[i], self.sources[i].endpoint
        if sock.closed:
            return
        try:
            sock.disconnect(endpoint)
        except zmq.ZMQError:
            pass  # already gone
        sock.connect(endpoint)

    def remove(self, sources: list[Source]) -> None:
        """Close the sockets of these sources (an engine that left, or that another ingester now owns).
        Positions are kept (indexes key the drop counts and reconnect timers): the slot holds a closed
        socket no longer polled, and a placeholder source that equals no real one."""
        for src in sources:
            for i, have in enumerate(self.sources):
                if have is not src:
                    continue
                handle = self._reconnects.pop(i, None)
                if handle is not None:
                    handle.cancel()
                sock = self.sockets[i]
                for mon, owner in list(self.monitors.items()):
                    if owner is src:
                        self.poller.unregister(mon)
                        mon.close(linger=0)
                        del self.monitors[mon]
                if not sock.closed:
                    self.poller.unregister(sock)
                    sock.close(linger=0)
                if src.replay and _replay_sources.get(src.replay) is src:
                    del _replay_sources[src.replay]
                self.sources[i] = Source(endpoint=f"removed://{i}")
                self._drops.pop(i, None)
                self._peers.pop(i, None)
                log.info("unsubscribed", extra={"endpoint": src.endpoint})

    def close(self) -> None:
        for handle in self._reconnects.values():
            handle.cancel()
        self._reconnects.clear()
        for mon in self.monitors:
            mon.close(linger=0)
        for src, sock in zip(self.sources, self.sockets):
            if src.replay and _replay_sources.get(src.replay) is src:
                del _replay_sources[src.replay]
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None


# Replay connection events that end a reply early: a frame over the size limit (ZMQ drops the
# connection rather than allocate it), the engine going away, or a refused CURVE handshake.
_REPLAY_BROKEN = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


async def fetch_replay(
    endpoint: str, start_seq: int, *, timeout_s: float = 2.0, ctx: zmq.asyncio.Context | None = None,
    source: Source | None = None,
) -> tuple[list[DecodedFrame], bool]:
    """Every batch the engine still buffers from ``start_seq`` on, and whether the end marker came.

    A DEALER sends ``["", start_seq as 8 bytes big-endian]``; the ROUTER answers one
    message per buffered batch and ends with seq -1. The reply ends early, incomplete, when
    the connection drops (a frame over ``max_frame_bytes`` does that, and is never asked for
    again by this call: the engine would only send it again) or past ``max_queue_bytes``; the
    caller flags the seqs it did not get.
    """
    ctx = ctx or zmq.asyncio.Context.instance()
    src = source or _replay_sources.get(endpoint) or Source(endpoint)
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, src, server=False)
    monitor = sock.get_monitor_socket(_REPLAY_BROKEN)
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    frames: list[DecodedFrame] = []
    received = 0
    try:
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        await sock.send_multipart([b"", max(start_seq, 0).to_bytes(8, "big")])
        while True:
            ready = dict(await poller.poll(timeout=int(timeout_s * 1000)))
            if sock not in ready:
                if monitor in ready:
                    log.warning("replay from %s ended after %d batch(es): the connection dropped (a frame over "
                                "--max-frame-bytes %d, the engine going away, or a refused CURVE handshake)",
                                endpoint, len(frames), src.limits.max_frame_bytes)
                return frames, False
            message = await sock.recv_multipart()
            received += sum(len(f) for f in message)
            if received > src.limits.max_queue_bytes:
                log.warning("replay from %s ended after %d batch(es): over --max-queue-bytes %d",
                            endpoint, len(frames), src.limits.max_queue_bytes)
                return frames, False
            decoded = engine(src.engine).decode_frames(message, topic=src.named_topic)
            if decoded.seq == SEQ_END:
                return frames, True
            frames.append(decoded)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def sleep_backoff(attempt: int, cap_s: float = 5.0) -> None:
    await asyncio.sleep(min(cap_s, 0.05 * (2 ** min(attempt, 10))))
