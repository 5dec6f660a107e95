"""`kv-preflight up --demo` over two simulated engines: round robin vs /v1/cache/route as the engines count
their cached tokens, and one explained round-robin miss (cli/affinity_demo.py)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped

pytestmark = pytest.mark.integration


def test_up_demo_compares_round_robin_with_route_and_explains_a_miss(tmp_path):
    with reaped(tmp_path) as env:
        out = subprocess.run([sys.executable, "-m", "kv_preflight", "up", "--data-dir", ".data", "--port", str(free_port()),
                              "--demo", "--exit-after-demo"], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                             env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    rr = float(re.search(r"round robin: +([\d.]+)%", out.stdout).group(1))
    routed = float(re.search(r"/v1/cache/route: +([\d.]+)%", out.stdout).group(1))
    # 3 families x 4 sends over 2 engines: round robin finds a prefix on 2 of the 4 sends, routing on 3
    assert 0 < rr < routed, out.stdout
    assert "a round-robin repeat sent to sim-1, explained just before" in out.stdout
    assert re.search(r"sim-1: stops at block 0 \(token 0\), reuses 0", out.stdout)
    assert re.search(r"sim-0: stops at block [1-9]\d*", out.stdout)
    assert "findings: none" in out.stdout and "/v1/cache/route sends it there" in out.stdout
