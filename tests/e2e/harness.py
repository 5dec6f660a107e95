"""Runs kv-preflight's real processes beside a real engine and waits for the index to catch up."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import redis
import zmq

from cli.valkey_server import free_port
from shared.index import pod_meta_key


def spawn(args: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "cli", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc: subprocess.Popen, kill: bool = False) -> None:
    if proc.poll() is None:
        proc.kill() if kill else proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_http(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout_s}s")


class EventWatcher:
    """An independent SUB on the engine's PUB: knows the newest seq each pod has published."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.last_seq: dict[str, int] = {}

    def drain(self, quiet_s: float = 0.3, max_s: float = 10.0) -> None:
        """Read until the engine has published nothing for ``quiet_s``."""
        deadline = time.monotonic() + max_s
        while time.monotonic() < deadline:
            if not self.sock.poll(int(quiet_s * 1000)):
                return
            topic, seq, _ = self.sock.recv_multipart()
            self.last_seq[topic.decode().split("@")[1]] = int.from_bytes(seq, "big", signed=True)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def wait_index_caught_up(valkey_url: str, watcher: EventWatcher, timeout_s: float = 20) -> None:
    watcher.drain()
    r = redis.Redis.from_url(valkey_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if all(int(r.hget(pod_meta_key(pod), "seq:0") or -1) >= seq for pod, seq in watcher.last_seq.items()):
                return
            time.sleep(0.02)
        raise TimeoutError(f"index did not reach seqs {watcher.last_seq}")
    finally:
        r.close()


@dataclass
class Stack:
    predictor_url: str
    ingester: subprocess.Popen
    predictor: subprocess.Popen


@contextmanager
def kvpf_stack(valkey_url: str, ingest_args: list[str], serve_args: list[str], tag: str):
    port = free_port()
    ing = spawn(["ingest", "--valkey-url", valkey_url, *ingest_args], f"/tmp/kvpf-{tag}-ingester.log")
    pred = spawn(["serve", "--valkey-url", valkey_url, "--port", str(port), *serve_args], f"/tmp/kvpf-{tag}-predictor.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield Stack(f"http://127.0.0.1:{port}", ing, pred)
    finally:
        stop(ing)
        stop(pred)
