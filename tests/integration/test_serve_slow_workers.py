"""Workers that start slowly still serve, with real processes: ``kv-preflight serve --workers 2`` and ``kv-preflight
gateway --workers 2`` whose spawned workers take 7 s to start (a ``sitecustomize`` on PYTHONPATH sleeps in every
process multiprocessing spawns, as imports do on a loaded node). uvicorn's supervisor used to kill a worker that did
not answer its ping within 5 s, start-up included, and start another, forever: the compose stack under load never
came up ("Child process [..] died" every 6 s). predictor/serve.py gives workers WORKER_PING_TIMEOUT_S."""
from __future__ import annotations

import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop

pytestmark = [pytest.mark.integration]

SLOW_START = '''import sys, time
if any("spawn_main" in a for a in sys.orig_argv):  # a worker multiprocessing spawned, not the server itself
    time.sleep(7)
'''


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_workers_that_take_7_s_to_start_serve(valkey_url, tmp_path, command):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_START)
    port = free_port()
    log = tmp_path / f"{command}.log"
    proc = spawn([command, "--valkey-url", valkey_url, "--port", str(port), "--workers", "2"], str(log),
                 env={"PYTHONPATH": str(tmp_path / "site")})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"no worker came up in 60 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        assert "died" not in log.read_text(), log.read_text()[-3000:]
    finally:
        stop(proc)
