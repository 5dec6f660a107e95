"""An engine's OpenAI side whose answers the test sets to the byte: what a gateway must pass on untouched, fail
over from, or wait for. uvicorn in a thread on a real port; /v1/models, /metrics and /health as an engine's."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kv_preflight.cli.valkey_server import free_port


@dataclass
class OpenAIStub:
    model: str = "sim"
    status: int = 200
    body: bytes = b'{"ok":true}'
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})
    chunks: list[bytes] | None = None  # a streamed answer, one chunk at a time, ``chunk_gap_s`` apart
    chunk_gap_s: float = 0.0
    hold_s: float = 0.0  # wait this long before answering (a slow engine)
    seen: list[dict] = field(default_factory=list)  # each request: its path, headers and body
    aborted: int = 0  # requests whose client went away before the answer was done
    port: int = field(default_factory=free_port)
    tls: tuple[str, str] | None = None  # (cert, key): served over https

    def __post_init__(self) -> None:
        app = Starlette(routes=[
            Route("/v1/completions", self._answer, methods=["POST"]),
            Route("/v1/chat/completions", self._answer, methods=["POST"]),
            Route("/v1/models", self._models), Route("/metrics", self._metrics), Route("/health", self._health),
        ])
        tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls else {}
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off", **tls))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> "OpenAIStub":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("stub engine did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    async def _answer(self, request: Request) -> Response:
        self.seen.append({"path": request.url.path, "headers": dict(request.headers), "body": await request.body()})
        if self.hold_s:
            try:
                await _held(request, self.hold_s)
            except _Gone:
                self.aborted += 1
                return Response(status_code=499)
        if self.chunks is not None:
            async def stream():
                try:
                    for chunk in self.chunks or []:
                        yield chunk
                        await asyncio.sleep(self.chunk_gap_s)
                except asyncio.CancelledError:
                    self.aborted += 1
                    raise
            return StreamingResponse(stream(), status_code=self.status, headers=self.headers)
        return Response(self.body, status_code=self.status, headers=self.headers)

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: Request) -> PlainTextResponse:
        return PlainTextResponse("vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\n"
                                 "vllm:kv_cache_usage_perc 0.0\n")

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)


class _Gone(Exception):
    pass


async def _held(request: Request, seconds: float) -> None:
    """Sleep ``seconds`` unless the client goes away first (then _Gone)."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    try:
        await asyncio.wait_for(gone(), seconds)
    except TimeoutError:
        return
    raise _Gone
