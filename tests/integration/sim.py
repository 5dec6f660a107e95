"""Simulated engines as real processes (``kv-preflight simulate``), for tests that need an engine's
HTTP API, KV events and replay socket together."""
from __future__ import annotations

from dataclasses import dataclass

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop, wait_http


@dataclass
class SimEngine:
    pod: str
    url: str
    zmq_port: int
    replay_port: int
    proc: object = None
    log: str = ""

    def start(self) -> "SimEngine":
        host = self.url.rsplit(":", 1)[0].split("//", 1)[1]
        self.proc = spawn(["simulate", "--pod", self.pod, "--model", "sim", "--host", host,
                           "--port", self.url.rsplit(":", 1)[1],
                           "--zmq", f"tcp://*:{self.zmq_port}", "--replay", f"tcp://*:{self.replay_port}",
                           "--block-size", "16", "--blocks", "64"], self.log)
        wait_http(self.url + "/v1/models")
        return self

    def stop(self, kill: bool = False) -> None:
        stop(self.proc, kill=kill)


def sim_engine(pod: str, tmp_path, host: str = "127.0.0.1", port: int | None = None) -> SimEngine:
    return SimEngine(pod, f"http://{host}:{port or free_port()}", free_port(), free_port(),
                     log=str(tmp_path / f"{pod}.log"))
