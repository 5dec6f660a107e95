"""An engine that answers at once, for the gateway's speed row (cli/bench/gateway.py): what the gateway adds is
measured against calling it directly, so its own cost must be small and the same either way.

A raw asyncio HTTP/1.1 server (keep-alive, Content-Length bodies): ``POST /v1/completions`` and
``/v1/chat/completions`` answer a fixed vLLM-shaped completion (usage included), ``GET /v1/models`` its model,
``GET /metrics`` an idle engine's load, ``GET /health`` 200. A completion can be answered ``DELAY_MS`` after it
arrived (a generation's time; every request its own timer, none waits for another).

    python -m kv_preflight.cli.bench.echo_engine PORT MODEL [DELAY_MS]
"""
from __future__ import annotations

import asyncio
import json
import sys


def _answer(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def answers(model: str) -> dict[tuple[bytes, bytes], bytes]:
    completion = json.dumps({
        "id": "cmpl-echo", "object": "text_completion", "created": 0, "model": model,
        "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 4096, "total_tokens": 4097, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }).encode()
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]}).encode()
    metrics = (b"vllm:num_requests_running 0.0\nvllm:num_requests_waiting 0.0\nvllm:kv_cache_usage_perc 0.0\n")
    return {
        (b"POST", b"/v1/completions"): _answer("200 OK", completion),
        (b"POST", b"/v1/chat/completions"): _answer("200 OK", completion),
        (b"GET", b"/v1/models"): _answer("200 OK", models),
        (b"GET", b"/metrics"): _answer("200 OK", metrics, b"text/plain"),
        (b"GET", b"/health"): _answer("200 OK", b""),
    }


class _Http(asyncio.Protocol):
    def __init__(self, table: dict[tuple[bytes, bytes], bytes], delay_s: float = 0.0):
        self.table, self.delay_s = table, delay_s
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end])
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            del self.buf[:end + 4 + length]
            method, path = head.split(b" ", 2)[:2]
            reply = self.table.get((method, path.split(b"?", 1)[0]), _answer("404 Not Found", b"{}"))
            assert self.transport is not None
            if self.delay_s and method == b"POST":
                asyncio.get_running_loop().call_later(self.delay_s, self._write, reply)
            else:
                self.transport.write(reply)

    def _write(self, reply: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(reply)


async def serve(port: int, model: str, delay_ms: float = 0.0) -> None:
    table = answers(model)
    server = await asyncio.get_running_loop().create_server(lambda: _Http(table, delay_ms / 1000), "127.0.0.1", port,
                                                            backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    port, model = int(sys.argv[1]), sys.argv[2]
    delay_ms = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    try:
        import uvloop

        uvloop.run(serve(port, model, delay_ms))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(port, model, delay_ms))


if __name__ == "__main__":
    main()
