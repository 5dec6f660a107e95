"""`kv-preflight up` with serve's routing and tokenizer options: the predictor it starts has them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped
from tests.tokenizer_files import write_tokenizer

pytestmark = pytest.mark.integration


def test_up_hands_routing_and_tokenizer_options_to_the_predictor(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    port = free_port()
    with reaped(tmp_path) as env:
        proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", "up", "--data-dir", ".data", "--port", str(port),
                                 "--sim-engines", "1", "--tokenizer", f"sim-model={tok}", "--no-tokenizer-check",
                                 "--route-good-match", "0.7", "--route-tier-weight", "cpu=0.5"],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            assert proc.poll() is None, proc.stdout.read()
            tokenization = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["tokenization"]
            assert tokenization["sim-model"]["source"] == "local", tokenization
            # Route options have no echo in /stats: the predictor's own command line shows they arrived.
            cmdlines = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0"))
                except OSError:
                    pass  # gone meanwhile
            serves = [c for c in cmdlines if b"serve" in c and str(port).encode() in c]
            assert serves, "no predictor process found"
            args = [a.decode() for a in serves[0]]
            assert args[args.index("--route-good-match") + 1] == "0.7"
            assert args[args.index("--route-tier-weight") + 1] == "cpu=0.5"
            assert "--no-tokenizer-check" in args
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()  # its children: ended by `reaped`
                out, _ = proc.communicate()
        assert "stopped." in out
