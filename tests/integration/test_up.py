"""`kv-preflight up`, the README's first command."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_up_runs_the_stack_and_the_demo_matches(tmp_path):
    """The README's first command, end to end: relative data dir, simulated engines, demo exact."""
    import subprocess
    import sys

    from cli.valkey_server import free_port

    out = subprocess.run([sys.executable, "-m", "cli", "up", "--data-dir", ".data", "--port", str(free_port()),
                          "--demo", "--exit-after-demo"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "predictions exact" in out.stdout and "MISMATCH" not in out.stdout
    assert (tmp_path / ".data" / "valkey" / "appendonlydir").exists()
    assert "stopped." in out.stdout


def test_up_on_a_local_valkey_cluster(tmp_path):
    """`up --cluster`: a 3+3 Valkey Cluster on loopback with AOF, the same stack on it, the demo exact,
    every node stopped afterwards; started again on the same data directory, the same cluster returns."""
    import subprocess
    import sys

    from cli.valkey_server import free_port

    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "cli", "up", "--cluster", "--data-dir", ".data", "--port",
                              str(free_port()), "--demo", "--exit-after-demo"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "12/12 predictions exact" in out.stdout and "Valkey Cluster" in out.stdout
        assert (tmp_path / ".data" / "valkey-cluster" / "cluster.json").exists()
        assert (tmp_path / ".data" / "valkey-cluster" / "node-0" / "appendonlydir").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"
