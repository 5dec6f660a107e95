"""The SUB sockets of one ingester, in both directions, read as one stream of (source, frames).

A socket connects to an engine that binds (``--source``) or binds for engines that connect
(``--bind``); its options are ingester/socket_options.py's. A bound socket can be a CURVE server
admitting only listed publisher keys (ingester/curve.py), and any socket can carry a ``pods=``
allowlist (enforced where frames are accepted). Each socket's monitor reports handshakes and drops:
a connecting socket that libzmq gave up on is connected again, with backoff. A source whose connection
dropped after it had been up (a heartbeat unanswered, the engine gone) is ``down`` until a publisher's
handshake succeeds again; it is then ``recovered`` (``take_recovered``), for the ingester to replay what its
pods missed meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
import zmq.utils.monitor

from kv_preflight.config import Config
from kv_preflight.ingester.curve import ZAP_DOMAIN, AllowList
from kv_preflight.ingester.socket_options import HANDSHAKE_FAILED, configure
from kv_preflight.ingester.sources import Source

log = logging.getLogger("kvpf.ingester")

# A receive waits at most this long for a first message, so sockets added meanwhile are polled soon.
POLL_MS = 500


class Subscriber:
    """All SUB sockets of one ingester, read as one stream of (source, frames)."""

    def __init__(self, sources: list[Source], ctx: zmq.asyncio.Context | None = None,
                 on_drop: Callable[[Source], None] | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.on_drop = on_drop  # each connection dropped after its handshake (counted: stream_drops)
        self._up: set[int] = set()  # sources a publisher's handshake succeeded on at least once
        self.down: dict[int, float] = {}  # source index -> when (monotonic) its stream went down
        self._recovered: set[int] = set()  # down, then a handshake again: what they missed is to be replayed
        self.sources = sources
        self.sockets: list[zmq.asyncio.Socket] = []
        self.poller = zmq.asyncio.Poller()
        self.monitors: dict[zmq.asyncio.Socket, Source] = {}
        self._drops: dict[int, int] = {}  # source index -> drops (connecting: since its last good handshake)
        self._peers: dict[int, int] = {}  # bound source -> publishers connected now
        self._reconnects: dict[int, asyncio.TimerHandle] = {}
        # One receive takes at most this many bytes (and at least one message): decoded, a batch
        # takes about ten times its wire size, and a receive is decoded whole.
        self.receive_bytes = max((s.limits.max_frame_bytes for s in sources), default=Config.max_frame_bytes)
        self.authenticator = None
        given = list(sources)
        sources.clear()  # the caller's list, kept as ours: filled as each socket opens
        self.add(given)

    def _ensure_authenticator(self, sources: list[Source]) -> None:
        servers = [s for s in sources if s.bind and s.curve is not None]
        if not servers or self.authenticator is not None:
            return
        # Started before any bind, so no handshake can happen without it (and ZAP_ENFORCE_DOMAIN
        # refuses every key if it is ever gone).
        from zmq.auth.asyncio import AsyncioAuthenticator

        self.allow_list = AllowList(frozenset().union(*(s.curve.allowed for s in servers)),
                                     servers[0].curve.on_refused)
        self.authenticator = AsyncioAuthenticator(self.ctx)
        self.authenticator.start()
        self.authenticator.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                                    credentials_provider=self.allow_list)

    def add(self, sources: list[Source]) -> None:
        """Open sockets for more sources (at start, and for engines discovered later): all of them, or none.

        An endpoint libzmq refuses (an address in use, a path too long, no file descriptor left) raises
        ``zmq.ZMQError`` after the sockets this call opened are closed again, so the caller (the fleet
        membership, per engine) can refuse that engine and go on; a second engine asking to bind an address
        a source here binds already raises ValueError before any socket is made (two engines' frames on one
        bound socket cannot be told apart by the socket)."""
        bound = {s.endpoint for s in self.sources if s.bind}
        for src in sources:
            if src.bind and src.endpoint in bound:
                raise ValueError(f"{src.endpoint} is already bound here for another source: an engine asking to be "
                                 "bound at an address another engine uses is refused (give each its own port)")
            if src.bind:
                bound.add(src.endpoint)
        self._ensure_authenticator(sources)
        opened: list[Source] = []
        for src in sources:
            try:
                self._open(src)
            except Exception:
                self.remove(opened)
                raise
            opened.append(src)
        self.receive_bytes = max((s.limits.max_frame_bytes for s in self.sources), default=Config.max_frame_bytes)

    def _open(self, src: Source) -> None:
        sock = self.ctx.socket(zmq.SUB)
        try:
            configure(sock, src, server=src.bind)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if "[" in src.endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            # Connecting: every (re)connection is reported once its handshake is done, so an engine that
            # restarted behind the same endpoint can be probed before it publishes anything; drops and
            # failed handshakes too (see _dropped). Bound: drops only, logged (the publisher reconnects).
            # A bound socket named with pod= counts its publishers too: its frames carry no pod of their own,
            # so it is only trusted while exactly one publisher is connected (see ``crowded``).
            # Bound sockets count their publishers too, so one left by its last publisher is down until one is back.
            # The monitor is attached before connect/bind: libzmq does not report events from before it, and a
            # handshake on loopback can finish first; the start's restart probe was then never run.
            mon = sock.get_monitor_socket((zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
                                          if src.bind else
                                          zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
            try:
                if src.bind:
                    sock.bind(src.endpoint)
                else:
                    sock.connect(src.endpoint)
            except Exception:
                sock.disable_monitor()
                mon.close(linger=0)
                raise
        except Exception:
            sock.close(linger=0)
            raise
        self.sources.append(src)  # sources[i] is sockets[i]'s
        self.sockets.append(sock)
        self.poller.register(sock, zmq.POLLIN)
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
                        i = self.sources.index(src)
                        self._drops.pop(i, None)
                        was_up = i in self._up
                        self._up.add(i)
                        # A bound socket's publisher that connects again may have lost frames meanwhile whether or
                        # not the socket had another publisher (its old connection still counted, half-open)
                        if self.down.pop(i, None) is not None or (src.bind and was_up):
                            self._recovered.add(i)
                            log.warning("%s: a publisher connected again after a stream went down; replaying what "
                                        "its pods missed", src.endpoint)
                        if not src.bind or i in self._recovered:
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
        if peers > 1 and src.pod:
            log.error("%s: %d publishers connected to a socket named pod=%s: its frames are refused until only one "
                      "is left (give each publisher its own --bind, or let them publish kv@POD@MODEL topics)",
                      src.endpoint, peers, src.pod)

    def take_recovered(self, src: Source) -> bool:
        """Whether this source came back after its stream went down (once: the caller replays its pods)."""
        try:
            i = self.sources.index(src)
        except ValueError:
            return False
        if i in self._recovered:
            self._recovered.discard(i)
            return True
        return False

    def down_endpoints(self) -> set[str]:
        """The endpoints of the sources whose stream is down now."""
        return {self.sources[i].endpoint for i in self.down}

    def mark_down(self, src: Source, now: float) -> None:
        """A stream found dead by other means (ingester/liveness.py): down until a handshake again; a connecting
        socket is connected anew at once (libzmq keeps a connection it believes alive)."""
        i = self.sources.index(src)
        self.down.setdefault(i, now)
        if not src.bind and i not in self._reconnects:
            self._reconnects[i] = asyncio.get_running_loop().call_soon(self._reconnect, i)

    def _went_down(self, i: int, src: Source) -> None:
        if i not in self._up or i in self.down:
            return
        self.down[i] = time.monotonic()
        if self.on_drop is not None:
            self.on_drop(src)

    def _dropped(self, src: Source) -> None:
        i = self.sources.index(src)
        drops = self._drops[i] = self._drops.get(i, 0) + 1
        if src.bind:
            self._peers[i] = max(0, self._peers.get(i, 0) - 1)
            if self._peers[i] == 0:
                self._went_down(i, src)
        else:
            self._went_down(i, src)
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
            log.warning("%s: connection dropped (a heartbeat unanswered: a half-open connection or a partition; a "
                        "frame over --max-frame-bytes %d, a failed handshake, or the engine went away); reconnecting "
                        "in %.1f s", src.endpoint, src.limits.max_frame_bytes, delay)
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
                self.sources[i] = Source(endpoint=f"removed://{i}")
                self._drops.pop(i, None)
                self._peers.pop(i, None)
                self._up.discard(i)
                self.down.pop(i, None)
                self._recovered.discard(i)
                log.info("unsubscribed", extra={"endpoint": src.endpoint})

    def close(self) -> None:
        for handle in self._reconnects.values():
            handle.cancel()
        self._reconnects.clear()
        for mon in self.monitors:
            mon.close(linger=0)
        for src, sock in zip(self.sources, self.sockets):
            sock.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
