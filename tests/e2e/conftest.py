"""The real vLLM (CPU build) from the launcher named by KVPF_VLLM_UP.

Users of the repo have no launcher, so these tests skip with a reason; CI sets
KVPF_REQUIRE_E2E=1, which turns that skip into a failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
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
               timeout_s: float = 400, model_dir: str | None = None, extra: tuple[str, ...] = ()) -> VllmEngine:
    log = f"/tmp/kvpf-vllm-{pod}.log"
    args = [launcher(), "--pod", pod, "--port", str(port), "--zmq-port", str(zmq_port),
            "--replay-port", str(replay_port), "--blocks", str(blocks), "--log", log]
    if model_dir:
        args += ["--model-dir", model_dir]
    if extra:
        args += ["--extra", " ".join(extra)]
    if bind_events:
        args.append("--bind-events")
    # One OpenMP thread: the tiny model gains nothing from a second, and with the engines started ahead, the
    # predictor, the ingester and the test on the same few cores, a second thread spin-waiting at every barrier
    # of every step cost about four times the CPU per request (and the wall time with it). A launcher's caller
    # may still set OMP_NUM_THREADS itself.
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    # At a lower CPU priority (the engine's processes inherit it): see VllmPool.
    out = subprocess.run(["nice", "-n", str(NICE), *args], capture_output=True, text=True, timeout=timeout_s,
                         env=env)
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
    dp_size: int = 1  # vLLM's --data-parallel-size: rank r publishes and replays on the ports + r


class VllmPool:
    """The session's engines, started ahead. A vLLM takes ~35 s to start (about 30 CPU-seconds over its
    processes) and the serial phase starts nine. The pool is made as soon as the session's tests are known and
    queues every engine they name (``VLLM_ENGINES`` of each collected module, in test order), two starting at a
    time (the first alone: it may install vLLM), at the CPU priority ``NICE``: they take the CPU the tests
    leave. The serial phase runs its integration tests first (tests/conftest.py), which mostly wait on failovers, leases and timeouts of their own, and
    take the CPU first whenever they want it; then the compose tests, whose stacks wait on health checks; so
    most engines are ready before the first vLLM module asks, where one started while the module before it
    ran made a module wait whenever that module's tests were shorter than a start. An engine the session
    does not name is started when asked for."""

    def __init__(self, order: list[VllmSpec]):
        self.order = list(dict.fromkeys(order))
        self._starting: dict[VllmSpec, Future] = {}
        # two at once at most, in the session's order (the executor's queue): the engine the next module waits
        # for shares the CPU with one more start at most
        self._threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vllm-start")
        # The session's first start runs alone: on a machine that never ran vLLM, the launcher installs it
        # first (about 4 minutes), and two launchers installing into one environment at once break it (a
        # fresh machine's CI: "File exists" in one, half-written package metadata left in the other).
        self._first = threading.Lock()
        self._first_done = False

    def _start(self, spec: VllmSpec) -> VllmEngine:
        with self._first:
            if not self._first_done:
                try:
                    return self._launch(spec)
                finally:
                    self._first_done = True
        return self._launch(spec)

    def _launch(self, spec: VllmSpec) -> VllmEngine:
        from tests.integration.sim import free_ports

        extra = ("--data-parallel-size", str(spec.dp_size)) if spec.dp_size > 1 else ()
        return start_vllm(pod=spec.pod, port=free_port(), zmq_port=free_ports(spec.dp_size),
                          replay_port=free_ports(spec.dp_size), blocks=spec.blocks,
                          model_dir=hybrid_model_dir() if spec.hybrid else None, extra=extra)

    def start_ahead(self, spec: VllmSpec) -> None:
        if spec not in self._starting:
            self._starting[spec] = self._threads.submit(self._start, spec)

    def start_all(self) -> None:
        """Queue every engine of the session, when a launcher is there (else each test skips or fails, with
        the reason, as it takes its engine)."""
        if os.access(os.environ.get("KVPF_VLLM_UP", ""), os.X_OK):
            for spec in self.order:
                self.start_ahead(spec)

    def take(self, spec: VllmSpec) -> VllmEngine:
        """The engine, started (or being started) for it. The caller stops it."""
        launcher()  # skips (or fails under KVPF_REQUIRE_E2E), with the reason, in the test's own context
        if spec.hybrid:
            hybrid_model_dir()
        self.start_ahead(spec)
        return self._starting.pop(spec).result()

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


# 10: when a test's own processes want the CPU, the engines starting beside them get about a tenth of it
NICE = 10
_pool: VllmPool | None = None


def pytest_collection_finish(session) -> None:
    """The session's pool, made once its tests are known, before the first of them runs."""
    global _pool
    _pool = VllmPool([spec for item in session.items
                      for spec in getattr(getattr(item, "module", None), "VLLM_ENGINES", ())])
    if not session.config.option.collectonly:
        _pool.start_all()


def pytest_sessionfinish(session) -> None:
    if _pool is not None:
        _pool.close()


@pytest.fixture(scope="session")
def vllm_pool() -> VllmPool:
    assert _pool is not None, "made by pytest_collection_finish"
    return _pool
