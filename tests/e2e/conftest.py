"""The real vLLM (CPU build) from the launcher named by KVPF_VLLM_UP.

Users of the repo have no launcher, so these tests skip with a reason; CI sets
KVPF_REQUIRE_E2E=1, which turns that skip into a failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from kv_preflight.cli.valkey_server import free_port


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


@dataclass(frozen=True)
class VllmSpec:
    """A real vLLM a test module runs against: its pod name, its KV blocks, the hybrid model or the plain one.
    A module names its engines, in the order its tests use them, in a module-level ``VLLM_ENGINES`` tuple."""

    pod: str
    blocks: int
    hybrid: bool = False


class VllmPool:
    """Engines started ahead. A vLLM takes ~35 s to start (about 30 CPU-seconds over its processes), and the
    serial phase starts nine in turn: while one module's tests run, the next ``AHEAD`` modules' engines start
    beside them. One ahead was not enough: several modules' tests take a few seconds, shorter than a start, so
    the module after them waited for its engine while the machine had CPU to spare. The order is the session's
    (``VLLM_ENGINES`` of each collected module); an engine the session does not name is started when asked for."""

    AHEAD = 2

    def __init__(self, order: list[VllmSpec]):
        self.order = list(dict.fromkeys(order))
        self._starting: dict[VllmSpec, Future] = {}
        # two at once at most, in the session's order (the executor's queue): the engine a module waits for is
        # never slowed by a third start beside it
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-start")

    def _start(self, spec: VllmSpec) -> VllmEngine:
        return start_vllm(pod=spec.pod, port=free_port(), zmq_port=free_port(), replay_port=free_port(),
                          blocks=spec.blocks, model_dir=hybrid_model_dir() if spec.hybrid else None)

    def start_ahead(self, spec: VllmSpec) -> None:
        if spec not in self._starting:
            self._starting[spec] = self._threads.submit(self._start, spec)

    def take(self, spec: VllmSpec) -> VllmEngine:
        """The engine, started (or being started) for it; the session's next engine starts meanwhile. The caller
        stops it."""
        launcher()  # skips (or fails under KVPF_REQUIRE_E2E), with the reason, in the test's own context
        if spec.hybrid:
            hybrid_model_dir()
        self.start_ahead(spec)
        started = self._starting.pop(spec)
        if spec in self.order:
            for nxt in self.order[self.order.index(spec) + 1:][:self.AHEAD]:
                self.start_ahead(nxt)
        return started.result()

    def close(self) -> None:
        """Engines started ahead that no test took (a failure ended the session, -x): stopped; those still
        queued are not started at all."""
        for started in self._starting.values():
            if started.cancel():
                continue
            try:
                started.result().stop()
            except BaseException:  # it never started: nothing to stop
                pass
        self._starting.clear()
        self._threads.shutdown(wait=True)


@pytest.fixture(scope="session", autouse=True)
def vllm_pool(request) -> Iterator[VllmPool]:
    """Made at the session's first end-to-end test (the compose stack's, in file order), which starts the first
    ``VllmPool.AHEAD`` engines already when a launcher is there."""
    order = [spec for item in request.session.items for spec in getattr(item.module, "VLLM_ENGINES", ())]
    pool = VllmPool(order)
    if order and os.access(os.environ.get("KVPF_VLLM_UP", ""), os.X_OK):
        for spec in pool.order[:VllmPool.AHEAD]:
            pool.start_ahead(spec)
    yield pool
    pool.close()
