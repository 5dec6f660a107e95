"""Simulated engines as real processes (``kv-preflight simulate``), for tests that need an engine's
HTTP API, KV events and replay socket together."""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import zmq

from kv_preflight.cli.valkey_server import free_port, free_ports
from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.events import EventBatch
from tests.e2e.harness import spawn, stop, wait_http


@dataclass
class SimEngine:
    pod: str
    url: str
    zmq_port: int
    replay_port: int
    proc: object = None
    log: str = ""
    blocks: int = 64  # the engine's KV blocks (one is vLLM's reserved null block)
    block_size: int = 16
    sliding_window: int | None = None  # a hybrid engine: a sliding-window group beside full attention
    dp_size: int = 1  # data-parallel ranks: rank r publishes on zmq_port + r, replays on replay_port + r

    def start(self) -> "SimEngine":
        host = self.url.rsplit(":", 1)[0].split("//", 1)[1]
        self.proc = spawn(["simulate", "--pod", self.pod, "--model", "sim", "--host", host,
                           "--port", self.url.rsplit(":", 1)[1],
                           "--zmq", f"tcp://*:{self.zmq_port}", "--replay", f"tcp://*:{self.replay_port}",
                           "--block-size", str(self.block_size), "--blocks", str(self.blocks),
                           *(["--sliding-window", str(self.sliding_window)] if self.sliding_window else []),
                           *(["--dp-size", str(self.dp_size)] if self.dp_size > 1 else [])],
                          self.log)
        wait_http(self.url + "/v1/models")
        return self

    def stop(self, kill: bool = False) -> None:
        stop(self.proc, kill=kill)

    def complete(self, tokens: list[int]) -> int:
        """Serve a prompt (one output token); the tokens the engine found cached, its own account."""
        r = httpx.post(self.url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1},
                       timeout=30)
        r.raise_for_status()
        return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    def clear(self, filler: list[int]) -> None:
        """Empty its prefix cache: the AllBlocksCleared goes out with the next step, ``filler``'s, which caches
        ``filler`` alone."""
        r = httpx.post(self.url + "/reset_prefix_cache", timeout=10)
        r.raise_for_status()
        assert r.json().get("success"), r.text
        self.complete(filler)

    def published(self, rank: int = 0) -> list[EventBatch]:
        """Every batch the engine (its data-parallel rank ``rank``) has published so far, in seq order, read back
        from its replay socket (it buffers 10,000): the engine's own account of its cache, to compare with."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://127.0.0.1:{self.replay_port + rank}")
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
            out = []
            while sock.poll(10_000):
                frames = sock.recv_multipart()  # ["", topic, seq, payload]; the end is seq -1
                if frames[2] == b"\xff" * 8:
                    return out
                got = VLLM.decode_frames(frames[1:])
                assert not got.errors and got.seq == len(out), (got.seq, len(out), got.errors)
                out.append(got.batch)
            raise TimeoutError(f"{self.pod}'s replay socket did not finish its answer")
        finally:
            sock.close(0)
            ctx.term()


def sim_engine(pod: str, tmp_path, host: str = "127.0.0.1", port: int | None = None, blocks: int = 64,
               dp_size: int = 1) -> SimEngine:
    return SimEngine(pod, f"http://{host}:{port or free_port()}", free_ports(dp_size), free_ports(dp_size),
                     log=str(tmp_path / f"{pod}.log"), blocks=blocks, dp_size=dp_size)
