"""A TCP proxy between a publisher and a subscriber, for the faults a network can make of a connection.

* ``pass``: bytes flow both ways (each new connection is connected to the upstream side anew);
* ``refuse``: new connections are closed at once;
* ``blackhole``: a partition. Every byte read is dropped, nothing is closed, and a new connection is accepted and
  held (connected upstream, nothing forwarded) until the path heals; then forwarding resumes on every connection;
* ``half_open()``: a middlebox that lost a connection's state (a NAT or conntrack drop, a host that crashed and
  came back): the engine's half of every connection open now is closed, so the engine sees its peer gone, while
  the ingester's half stays open and silent for good, reading and dropping whatever arrives. New connections
  pass (the path itself is fine).

The "downstream" side is the one that connects to the proxy's port (the ingester's SUB for an engine that binds;
the engine's PUB for an ingester that binds: then the proxy's upstream is the ingester).
"""
from __future__ import annotations

import selectors
import socket
import threading
from dataclasses import dataclass, field


@dataclass
class _Pair:
    down: socket.socket  # accepted from the side that connects to the proxy
    up: socket.socket | None  # connected to the target; None once cut (half-open)
    dead: bool = False  # half-open: the down side is held silent for good


@dataclass
class TcpProxy:
    target_port: int
    port: int = 0  # 0: any free port (read it after start)
    host: str = "127.0.0.1"
    mode: str = "pass"
    pairs: list[_Pair] = field(default_factory=list)
    accepted: int = 0  # connections accepted so far

    def start(self) -> "TcpProxy":
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.host, self.port))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, daemon=True, name="tcp-proxy")
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def pass_(self) -> None:
        with self._lock:
            self.mode = "pass"

    def refuse(self) -> None:
        """New connections are closed at once (existing ones go on as they are)."""
        with self._lock:
            self.mode = "refuse"

    def blackhole(self) -> None:
        with self._lock:
            self.mode = "blackhole"

    def half_open(self, keep: str = "down") -> None:
        """Cut one half of every connection open now (an RST: that end sees its peer gone at once); the other half
        (``keep``: "down", the side that connected to the proxy, or "up") stays open and silent for good."""
        with self._lock:
            for pair in self.pairs:
                cut = pair.up if keep == "down" else pair.down
                if cut is not None:
                    try:
                        cut.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        cut.close()
                    except OSError:
                        pass
                if keep == "down":
                    pair.up = None
                else:
                    pair.down = pair.up  # the kept half, read and dropped from here on
                    pair.up = None
                pair.dead = True

    def live_connections(self) -> int:
        """Connections forwarding now (neither end closed, not held half-open)."""
        with self._lock:
            return sum(1 for p in self.pairs if not p.dead and p.up is not None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for pair in self.pairs:
                for s in (pair.down, pair.up):
                    if s is not None:
                        s.close()
            self.pairs.clear()
        self._listener.close()

    # ---- the loop: one thread, a selector over every socket

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        registered: set[socket.socket] = {self._listener}
        while not self._stop.is_set():
            with self._lock:
                wanted = {self._listener} | {s for p in self.pairs for s in (p.down, p.up) if s is not None}
            for s in registered - wanted:
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
            for s in wanted - registered:
                sel.register(s, selectors.EVENT_READ)
            registered = wanted
            for key, _ in sel.select(timeout=0.05):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept()
                else:
                    self._pump(sock)
        sel.close()

    def _accept(self) -> None:
        down, _ = self._listener.accept()
        with self._lock:
            refused = self.mode == "refuse"
        if refused:
            down.close()
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
        except OSError:  # nobody listens there now (a side stopped): the connection is refused, as it would be
            down.close()
            return
        up.settimeout(None)
        for s in (down, up):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self.pairs.append(_Pair(down, up))
            self.accepted += 1

    def _pump(self, sock: socket.socket) -> None:
        with self._lock:
            pair = next((p for p in self.pairs if sock is p.down or sock is p.up), None)
            mode = self.mode
        if pair is None:
            return
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:  # one end closed: close the other (a half-open pair's down side stays, but it is gone)
            self._drop(pair)
            return
        if pair.dead or mode == "blackhole":
            return  # dropped
        other = pair.up if sock is pair.down else pair.down
        if other is None:
            return
        try:
            other.sendall(data)
        except OSError:
            self._drop(pair)

    def _drop(self, pair: _Pair) -> None:
        with self._lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        for s in (pair.down, pair.up):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
