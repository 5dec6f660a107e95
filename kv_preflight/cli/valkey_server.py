"""Start and stop a private valkey-server (or redis-server) on loopback.

Used by ``kv-preflight up`` and by the test suite, so both run against a real
server they own, never a system one.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from kv_preflight import parent_death


def _listen_ports(spec: str) -> tuple[int, int]:
    """[lo, hi): where ``free_port`` draws from. 10000-20000 unless ``KVPF_LISTEN_PORTS=LO-HI`` says otherwise
    (the test suite gives each of its workers, and the ``up`` stacks they start, a share of their own: two
    processes drawing from one range can draw one port before either binds it). Below Linux's ephemeral range
    (32768-60999) and the cluster's ports. A value that is not such a range is logged and ignored."""
    lo, _, hi = spec.partition("-")
    if spec:
        if lo.strip().isdigit() and hi.strip().isdigit() and 1024 <= int(lo) < int(hi) <= 65536:
            return int(lo), int(hi)
        logging.getLogger("kvpf").warning("KVPF_LISTEN_PORTS=%r is not a range LO-HI (1024 <= LO < HI <= 65536): "
                                          "ports are drawn from 10000-20000", spec)
    return 10000, 20000


LISTEN_PORTS = _listen_ports(os.environ.get("KVPF_LISTEN_PORTS", ""))


HANDED_OUT_HOLD_S = 120.0


class _HandedOut:
    """Ports free_port handed out lately (port -> monotonic time): one not bound yet is still free, and drawing
    it again would give two servers one port ("Address already in use", or a client reaching the wrong one).
    Process-wide by nature (any two callers in a process must differ), so one instance per process; locked,
    since the test suite draws ports from a thread that starts engines ahead."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: dict[int, float] = {}


_HANDED_OUT = _HandedOut()


def reserve_port(port: int) -> None:
    """A port this process will bind itself later (a flag's): ``free_port`` does not hand it out meanwhile."""
    with _HANDED_OUT.lock:
        _HANDED_OUT.at[port] = time.monotonic()


def free_port(lo: int = LISTEN_PORTS[0], hi: int = LISTEN_PORTS[1]) -> int:
    """A port in [lo, hi) free now, for a server that another process binds a moment later (Valkey, an
    engine, a predictor). Not the kernel's pick (bind to port 0): that comes from the ephemeral range, from
    which every outgoing connection takes its local port too, so in the gap before the server binds a
    client could take it (a real vLLM failed to start in CI with "Address already in use" on such a port).
    Never one this process handed out in the last ``HANDED_OUT_HOLD_S``: several drawn before any is bound
    (``up``'s engine: HTTP, ZMQ and replay; a test's predictor and engine) would otherwise share one now and
    then, as nothing is listening on it yet."""
    rng = random.Random()
    with _HANDED_OUT.lock:
        now = time.monotonic()
        held = _HANDED_OUT.at
        for port in [p for p, at in held.items() if now - at > HANDED_OUT_HOLD_S]:
            del held[port]
        for _ in range(500):
            port = rng.randrange(lo, hi)
            if port in held:
                continue
            try:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            held[port] = now
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")



def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports (a data-parallel engine's rank r publishes and replays on the
    ports + r, as vLLM offsets them)."""
    while True:
        first = free_port()
        if n == 1 or all(_bindable(first + i) for i in range(1, n)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

def server_binary() -> str:
    for name in ("valkey-server", "redis-server"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        "neither valkey-server nor redis-server is on PATH; run scripts/install-valkey "
        "(Debian: apt-get install -t bookworm-backports valkey-server)"
    )


@dataclass
class ValkeyServer:
    data_dir: Path
    port: int = 0
    appendonly: bool = True
    requirepass: str = field(default="", repr=False)  # clients must AUTH; the URL then carries it
    tls_cert: Path | None = None  # with tls_key: TLS only (rediss://), this self-signed cert as the CA
    tls_key: Path | None = None
    # DEBUG (SLEEP, ...) from loopback clients, for fault tests; valkey 7+ refuses it by default
    debug_command: bool = False
    extra_args: tuple[str, ...] = ()  # more valkey-server options (a cluster node's, for one)
    # `up`'s Valkey: a session of its own, so a terminal's Ctrl-C reaches `up` alone, which stops Valkey
    # after its clients; and SIGTERM (a clean shutdown, AOF written out) when its starter dies, even by
    # SIGKILL (Linux, kv_preflight/parent_death.py)
    tied_to_parent: bool = False
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{quote(self.requirepass, safe='')}@" if self.requirepass else ""
        if self.tls_cert:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls_cert), safe='/')}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "ValkeyServer":
        if not self.port:
            self.port = free_port()
        # valkey-server chdirs into --dir before opening --logfile: relative paths would nest.
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            # llm-d's PodEntry JSON (~95 bytes) exceeds the default 64, which turns every request-key
            # hash into a full hash table; 128 keeps them compact (the saving: docs/benchmarks.md).
            "--hash-max-listpack-value", "128", "--protected-mode", "yes", "--daemonize", "no",
            "--logfile", str(self.data_dir / "valkey.log"),
        ]
        if self.requirepass:
            args += ["--requirepass", self.requirepass]
        if self.debug_command:
            args += ["--enable-debug-command", "local"]
        args += list(self.extra_args)
        if self.tls_cert and self.tls_key:
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(self.tls_cert), "--tls-key-file",
                     str(self.tls_key), "--tls-ca-cert-file", str(self.tls_cert), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=self.tied_to_parent,
                                     preexec_fn=parent_death.preexec() if self.tied_to_parent else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"valkey-server exited ({self.proc.returncode}): {err} see {self.data_dir}/valkey.log")
            try:
                with self._probe_socket() as s:
                    if self.requirepass:
                        pw = self.requirepass.encode()
                        s.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                        if not s.recv(64).startswith(b"+OK"):
                            raise OSError("AUTH refused")
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"valkey-server did not answer PING on port {self.port} within {timeout_s}s")

    def _probe_socket(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.2)
        if not self.tls_cert:
            return sock
        ctx = ssl.create_default_context(cafile=str(self.tls_cert))
        ctx.check_hostname = False
        return ctx.wrap_socket(sock)

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()  # a restart starts a new process: its pipe is not left to the GC

    def restart(self) -> None:
        self.stop()
        self.start()
