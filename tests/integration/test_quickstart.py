"""The README quickstart as a newcomer walks it (issue 27, findings 2, 6 and 7): ``scripts/up`` with
simulated engines, then the CLI with no flags at all, from the directory the data lives in.

Real processes throughout: scripts/up (which runs setup, then ``kv-preflight up``), its valkey-server,
simulated engines, ingesters and predictor, on free ports in a temporary data directory; the CLI commands
as a user types them. Then what must fail fast, before anything starts: a second ``up`` on the same data
directory, an engine that is not there, a busy predictor port.
"""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped, still_running

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "kv_preflight"]


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = log.read_text()
        if text in got:
            return got
        assert proc.poll() is None, got
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not printed within {timeout_s}s: {log.read_text()}")


def _cli(args: list[str], cwd: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    """A command as the user types it: no --valkey-url, no --predictor-url, no KVPF_ variable."""
    clean = {k: v for k, v in env.items() if not k.startswith("KVPF_") or k == "KVPF_TEST_STACK"}
    return subprocess.run([*CLI, *args], cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout)


def _doc_example() -> tuple[str, str]:
    """docs/explain.md's checked example: the command (after ``$ ``) and its output."""
    text = (REPO / "docs" / "explain.md").read_text().split("<!-- explain-example -->", 1)[1]
    block = text.split("```", 2)[1].strip("\n").splitlines()
    assert block[0].startswith("$ kv-preflight explain ")
    return block[0][2:], "\n".join(block[1:]).strip()


def test_readme_quickstart_then_the_cli_with_no_flags(tmp_path):
    port = free_port()
    data = tmp_path / ".data"
    log = tmp_path / "up.out"
    with reaped(tmp_path) as env:
        env = {k: v for k, v in env.items() if not k.startswith("KVPF_") or k == "KVPF_TEST_STACK"}
        with open(log, "w") as fh:
            # scripts/up runs from the checkout; the data directory is the newcomer's working directory's .data
            up = subprocess.Popen([str(REPO / "scripts" / "up"), "--data-dir", str(data), "--port", str(port),
                                   "--sim-engines", "2", "--workers", "1", "--ingesters", "1"],
                                  stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            out = _wait_for(log, "Ctrl-C stops everything", up)
            # 2: up prints the URLs and an export line, and writes them where the CLI looks
            assert f"export KVPF_VALKEY_URL=redis://127.0.0.1:" in out and f"KVPF_PREDICTOR_URL=http://127.0.0.1:{port}" in out
            env_file = (data / "env").read_text()
            assert "export KVPF_VALKEY_URL=redis://127.0.0.1:" in env_file
            assert f"export KVPF_PREDICTOR_URL=http://127.0.0.1:{port}" in env_file
            assert "kv-preflight index stats" in out  # how to run the CLI (it is not on PATH)

            # the CLI with no flags finds the stack (its Valkey on a random port, its predictor on --port)
            r = _cli(["index", "pods"], tmp_path, env)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "sim-0" in r.stdout and "sim-1" in r.stdout and "live" in r.stdout
            r = _cli(["index", "stats"], tmp_path, env)
            assert r.returncode == 0 and "sim-0" in r.stdout, r.stdout + r.stderr
            r = _cli(["explain", "--model", "sim-model", "--prompt", "You are a helpful assistant."], tmp_path, env)
            assert r.returncode == 0, r.stdout + r.stderr
            r = _cli(["diagnose", "fleet", "--window", "0", "--json"], tmp_path, env)
            assert r.returncode == 0, r.stdout + r.stderr
            # finding 10: the wait is announced before it starts, and a dead predictor is one warning, not two
            dead = f"http://127.0.0.1:{free_port()}"
            r = _cli(["diagnose", "fleet", "--window", "0.5", "--predictor-url", dead], tmp_path, env)
            assert r.returncode == 0, r.stdout + r.stderr
            assert r.stderr.startswith("sampling the engines' and the predictor's counters for 0.5s (--window"), r.stderr
            assert r.stderr.count(f"cannot read the predictor's /stats at {dead}") == 1, r.stderr

            # docs/explain.md's example is this stack's real output (it had drifted from it)
            command, expected = _doc_example()
            sim0 = next(ln.split()[1] for ln in out.splitlines() if ln.strip().startswith("engines "))
            httpx.post(sim0 + "/v1/completions", json={"model": "sim-model", "max_tokens": 1,
                       "prompt": "You are a helpful assistant. Summarize the following report."}, timeout=10)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                r = _cli(shlex.split(command)[1:], tmp_path, env)
                if r.stdout.strip() == expected:
                    break
                time.sleep(0.5)  # until the ingester has applied the engine's events
            assert r.stdout.strip() == expected, r.stdout + r.stderr

            # 7: a second up on the same data directory is refused at once, naming the first
            started = time.monotonic()
            second = _cli(["up", "--data-dir", str(data), "--port", str(free_port())], tmp_path, env, timeout=60)
            assert second.returncode != 0 and time.monotonic() - started < 15, second.stdout + second.stderr
            assert "in use by kv-preflight up (pid" in second.stderr and f"127.0.0.1:{port}" in second.stderr, second.stderr
            assert "starting" not in second.stdout, second.stdout
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGINT)
            rc = up.wait(timeout=120)
        assert rc == 0, log.read_text()
        assert not (data / "env").exists()  # gone with the stack: no command reaches a stopped stack
        assert not still_running(tmp_path)

        r = _cli(["index", "stats"], tmp_path, env, timeout=60)
        assert r.returncode != 0  # no stack: the default 6379 (nothing there), not the stopped stack's port


def test_up_checks_ports_and_engines_before_starting_anything(tmp_path):
    """6: a busy predictor port, an engine that is not there: refused in one line naming it and the cause,
    before Valkey or anything else starts (it used to take ~10 s, or 30 s and a message naming nothing)."""
    data = tmp_path / ".data"
    with reaped(tmp_path) as env:
        dead = f"http://127.0.0.1:{free_port()}"
        started = time.monotonic()
        r = _cli(["up", "--data-dir", str(data), "--port", str(free_port()), "--engine", dead], tmp_path, env)
        assert r.returncode == 2 and time.monotonic() - started < 15, r.stdout + r.stderr
        assert f"engine {dead}: cannot connect" in r.stderr, r.stderr
        assert "starting" not in r.stdout and not (data / "valkey").exists(), r.stdout

        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            taken = busy.getsockname()[1]
            r = _cli(["up", "--data-dir", str(data), "--port", str(taken)], tmp_path, env)
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"port {taken} for the predictor is not free" in r.stderr, r.stderr
        assert "starting" not in r.stdout and not (data / "valkey").exists(), r.stdout
        assert not still_running(tmp_path)
