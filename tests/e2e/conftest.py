"""The real vLLM (CPU build) from the launcher named by KVPF_VLLM_UP.

Users of the repo have no launcher, so these tests skip with a reason; CI sets
KVPF_REQUIRE_E2E=1, which turns that skip into a failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

import pytest


def launcher() -> str:
    path = os.environ.get("KVPF_VLLM_UP", "")
    if path and os.access(path, os.X_OK):
        return path
    reason = ("KVPF_VLLM_UP is not set to an executable vLLM launcher (e.g. ../shared/vllm-cpu/up.sh); "
              "end-to-end tests against a real vLLM are skipped")
    if os.environ.get("KVPF_REQUIRE_E2E") == "1":
        pytest.fail(reason + " but KVPF_REQUIRE_E2E=1")
    pytest.skip(reason)


@dataclass
class VllmEngine:
    url: str
    zmq: str
    replay: str
    topic: str
    pid: int
    log: str

    @property
    def pod_id(self) -> str:
        return self.topic.split("@")[1]

    def stop(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def hybrid_model_dir() -> str:
    """The launcher's tiny model with a sliding-window layer beside a full-attention one (vLLM's hybrid KV
    cache manager: two KV cache groups), as the launcher ships it beside itself."""
    path = os.path.join(os.path.dirname(launcher()), "tiny-hybrid-model")
    if not os.path.isdir(path):
        reason = f"the vLLM launcher has no tiny-hybrid-model beside it ({path})"
        if os.environ.get("KVPF_REQUIRE_E2E") == "1":
            pytest.fail(reason + " but KVPF_REQUIRE_E2E=1")
        pytest.skip(reason)
    return path


def start_vllm(*, pod: str, port: int, zmq_port: int, replay_port: int, blocks: int, bind_events: bool = True,
               timeout_s: float = 400, model_dir: str | None = None) -> VllmEngine:
    log = f"/tmp/kvpf-vllm-{pod}.log"
    args = [launcher(), "--pod", pod, "--port", str(port), "--zmq-port", str(zmq_port),
            "--replay-port", str(replay_port), "--blocks", str(blocks), "--log", log]
    if model_dir:
        args += ["--model-dir", model_dir]
    if bind_events:
        args.append("--bind-events")
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    line = next((l for l in out.stdout.splitlines() if l.startswith("READY ")), None)
    if line is None:
        raise RuntimeError(f"vLLM did not start: {out.stderr[-2000:]}")
    _, url, zmq_ep, replay_ep, topic, pid = line.split()
    return VllmEngine(url, zmq_ep, replay_ep, topic, int(pid), log)
