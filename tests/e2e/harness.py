"""Runs kv-preflight's real processes beside a real engine and waits for the index to catch up."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from kv_preflight.cli.valkey_server import free_port


def spawn(args: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "kv_preflight", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
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


def wait_log(path: str, text: str, proc: subprocess.Popen | None = None, timeout_s: float = 30) -> str:
    """Until a process's log (as ``spawn`` writes it) holds ``text``: a step the process itself reports,
    rather than a fixed sleep that an overloaded machine outlasts. Fails at once if ``proc`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            got = f.read()
        if text in got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before logging {text!r}: {got[-2000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not log {text!r} in {timeout_s}s")


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
