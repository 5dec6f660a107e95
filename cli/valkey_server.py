"""Start and stop a private valkey-server (or redis-server) on loopback.

Used by ``kv-preflight up`` and by the test suite, so both run against a real
server they own, never a system one.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "ValkeyServer":
        if not self.port:
            self.port = free_port()
        # valkey-server chdirs into --dir before opening --logfile: relative paths would nest.
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            server_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.data_dir),
            "--save", "", "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec", "--protected-mode", "yes", "--daemonize", "no",
            "--logfile", str(self.data_dir / "valkey.log"),
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"valkey-server exited ({self.proc.returncode}): {err} see {self.data_dir}/valkey.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"valkey-server did not answer PING on port {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        self.stop()
        self.start()


def default_data_dir() -> Path:
    return Path(os.environ.get("KVPF_DATA_DIR", ".data")) / "valkey"
