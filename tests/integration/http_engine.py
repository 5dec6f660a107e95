"""An engine's HTTP side, as the predictor sees it: /tokenize, Prometheus /metrics, /v1/models and
/kv_event_sources, on a real port (uvicorn in a thread). The test sets what each returns."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from kv_preflight.cli.valkey_server import free_port


@dataclass
class HttpEngine:
    pod: str
    models: list[str]
    tokenize_fn: Callable[[dict], list[int]] | None = None
    # the status /tokenize answers for a body (with an OpenAI-style error), else 200 with tokenize_fn's tokens
    tokenize_status: Callable[[dict], int] | None = None
    running: float = 0
    waiting: float = 0
    kv_usage: float = 0.0
    metrics_ok: bool = True
    tokenize_requests: list[dict] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    kv_event_sources: dict | None = None  # what /kv_event_sources answers (default: one rank, tcp://*:5557)

    def __post_init__(self) -> None:
        app = Starlette(routes=[
            Route("/tokenize", self._tokenize, methods=["POST"]),
            Route("/metrics", self._metrics), Route("/v1/models", self._models),
            Route("/kv_event_sources", self._sources),
        ])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _tokenize(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.tokenize_requests.append(body)
        status = self.tokenize_status(body) if self.tokenize_status is not None else 200
        if status != 200:
            return JSONResponse({"error": {"message": f"stub refusal {status}", "code": status}}, status)
        if self.tokenize_fn is None:
            return JSONResponse({"error": "no tokenizer"}, 500)
        tokens = self.tokenize_fn(body)
        return JSONResponse({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _metrics(self, request: Request) -> PlainTextResponse:
        if not self.metrics_ok:
            return PlainTextResponse("down", 500)
        m = self.models[0]
        text = (f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine="0",model_name="{m}"}} '
                f'{float(self.running)}\nvllm:num_requests_waiting{{engine="0",model_name="{m}"}} '
                f'{float(self.waiting)}\nvllm:kv_cache_usage_perc{{engine="0",model_name="{m}"}} {self.kv_usage}\n')
        return PlainTextResponse(text)

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _sources(self, request: Request) -> JSONResponse:
        if self.kv_event_sources is not None:
            return JSONResponse(self.kv_event_sources)
        return JSONResponse({"0": {"endpoint": "tcp://*:5557", "topic": f"kv@{self.pod}@{self.models[0]}"}})

    def start(self) -> "HttpEngine":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "http engine stub did not start"
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
