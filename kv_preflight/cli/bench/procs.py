"""Processes the benchmark starts (and only those): readiness, CPU accounting, clean stop."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def wait_port(port: int, timeout_s: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s}s")


def tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except OSError:
            pass
    return total / CLK_TCK


class Server:
    """A subprocess in its own process group, stopped by its own pid/group only."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict | None = None):
        self.port = port
        self.log = log
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def ready(self, timeout_s: float = 30.0) -> "Server":
        wait_port(self.port, timeout_s, self.proc)
        return self

    def pids(self) -> list[int]:
        return tree(self.proc.pid)

    def cpu(self) -> float:
        return cpu_seconds(self.pids())

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the group we created for it
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def python() -> str:
    return sys.executable
