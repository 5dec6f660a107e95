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
