"""`kv-preflight up`, the README's first command."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_up_runs_the_stack_and_the_demo_matches(tmp_path):
    """The README's first command, end to end: relative data dir, simulated engines, demo exact."""
    import subprocess
    import sys

    from kv_preflight.cli.valkey_server import free_port

    out = subprocess.run([sys.executable, "-m", "kv_preflight", "up", "--data-dir", ".data", "--port", str(free_port()),
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

    from kv_preflight.cli.valkey_server import free_port

    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "kv_preflight", "up", "--cluster", "--data-dir", ".data", "--port",
                              str(free_port()), "--demo", "--exit-after-demo"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "12/12 predictions exact" in out.stdout and "Valkey Cluster" in out.stdout
        assert (tmp_path / ".data" / "valkey-cluster" / "cluster.json").exists()
        assert (tmp_path / ".data" / "valkey-cluster" / "node-0" / "appendonlydir").exists()
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left running: {left}"


FOREIGN_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    do_POST = do_GET
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _left_running(tmp_path) -> list[str]:
    import subprocess

    return subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()


def test_up_refuses_a_port_another_server_answers_on(tmp_path):
    """With a server already on the chosen port, up printed "ready" and ran the demo against it
    (Operator experience, finding 2): now it stops with the predictor's own error on screen."""
    import subprocess
    import sys
    import time

    import httpx

    from kv_preflight.cli.valkey_server import free_port

    port = free_port()
    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN_SERVER, str(port)])
    try:
        for _ in range(200):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        out = subprocess.run([sys.executable, "-m", "kv_preflight", "up", "--data-dir", str(tmp_path / ".data"), "--port", str(port),
                              "--sim-engines", "1", "--workers", "1", "--demo", "--exit-after-demo"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=180)
    finally:
        foreign.kill()
        foreign.wait()
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "ready" not in out.stdout and "predictions exact" not in out.stdout, text
    assert "predictor exited" in out.stderr and "address already in use" in out.stderr.lower(), text
    assert "Traceback" not in text and "stopped." in out.stdout
    assert not _left_running(tmp_path)


@pytest.mark.parametrize("signals", [1, 5])
def test_ctrl_c_is_not_reported_as_a_crash(tmp_path, signals):
    """About one Ctrl-C in four printed "ingester-0 exited (0) ... Stopping." (the children shared the
    terminal's process group and exited on the same SIGINT); a second Ctrl-C during the stop cut it short.
    Here SIGINT goes to up's whole process group, as a terminal sends it, once and five times in a row."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kv_preflight.cli.valkey_server import free_port

    log = tmp_path / "up.out"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", "up", "--data-dir", str(tmp_path / ".data"),
                                 "--port", str(free_port()), "--sim-engines", "1", "--workers", "1"],
                                cwd=tmp_path, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C stops everything" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
        for _ in range(signals):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.05)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "exited (" not in text and "Stopping." not in text, text
    assert "Traceback" not in text and text.rstrip().endswith("stopped."), text
    assert rc == 0, text
    assert not _left_running(tmp_path)
