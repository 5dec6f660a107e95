"""The end-to-end tests' vLLM pool (tests/e2e/conftest.py) starts its first engine alone: on a machine that never
ran vLLM, the launcher installs it first, and two installs into one environment broke it (a fresh machine's CI).
A launcher script of its own records when each start ran; the real launcher's installs are the e2e tests'."""
from __future__ import annotations

import os
import stat
import time

from tests.e2e.conftest import VllmPool, VllmSpec

LAUNCHER = """#!/usr/bin/env bash
pod=""
while [ $# -gt 0 ]; do case "$1" in --pod) pod="$2"; shift 2;; *) shift;; esac; done
echo "start $pod $(date +%s.%N)" >> "{log}"
sleep 0.4
echo "end $pod $(date +%s.%N)" >> "{log}"
echo "READY http://127.0.0.1:1 tcp://127.0.0.1:2 tcp://127.0.0.1:3 kv@$pod@tiny $$"
"""


def test_the_first_engine_starts_alone_and_the_rest_two_at_a_time(tmp_path, monkeypatch):
    log = tmp_path / "starts.log"
    script = tmp_path / "up.sh"
    script.write_text(LAUNCHER.replace("{log}", str(log)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("KVPF_VLLM_UP", str(script))
    specs = [VllmSpec(f"pod-{i}", 16) for i in range(4)]
    pool = VllmPool(specs)
    t0 = time.time()
    pool.start_all()
    try:
        pods = [pool.take(s).pod_id for s in specs]
    finally:
        pool.close()
    assert pods == [s.pod for s in specs]
    events = [line.split() for line in log.read_text().splitlines()]
    times = {(kind, pod): float(t) for kind, pod, t in events}
    assert all(t >= t0 for t in times.values())
    first_end = times[("end", "pod-0")]
    assert all(times[("start", s.pod)] >= first_end for s in specs[1:]), events  # none beside the first
    running = max_running = 0
    for kind, _, _ in sorted(events, key=lambda e: float(e[2])):
        running += 1 if kind == "start" else -1
        max_running = max(max_running, running)
    assert max_running == 2, events  # after it, two at a time, as before
