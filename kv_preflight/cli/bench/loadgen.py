"""A lean HTTP/1.1 load generator, run as its own process so its CPU is visible and separable.

Raw asyncio protocol on uvloop, keep-alive connections, pre-built request bytes:
the client spends a few microseconds per request, so it takes little of the
predictor's core budget. It reads a spec (JSON) from argv[1], the request bodies
from a length-prefixed file, and prints one JSON object with latencies (us),
throughput, status counts, its own CPU time, and the first response per body.

    python -m kv_preflight.cli.bench.loadgen spec.json
"""
from __future__ import annotations

import asyncio
import json
import resource
import struct
import sys
import time


def read_bodies(path: str) -> list[bytes]:
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def write_bodies(path: str, bodies: list[bytes]) -> None:
    with open(path, "wb") as f:
        for b in bodies:
            f.write(struct.pack("<I", len(b)))
            f.write(b)


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None
        self.need = -1
        self.status = 0
        self.body_at = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.need < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            self.status = int(head[9:12])
            n = 0
            cl = head.find(b"content-length:")
            if cl >= 0:
                eol = head.find(b"\r\n", cl)
                n = int(head[cl + 15:eol if eol > 0 else len(head)])
            self.body_at = end + 4
            self.need = end + 4 + n
        if len(self.buf) >= self.need and self.waiter is not None and not self.waiter.done():
            body = bytes(self.buf[self.body_at:self.need])
            del self.buf[:self.need]
            self.need = -1
            self.waiter.set_result((self.status, body))

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc}"))

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(raw)
        return await self.waiter


async def run(spec: dict) -> dict:
    host, port, path = spec["host"], spec["port"], spec.get("path", "/v1/cache/predict")
    bodies = read_bodies(spec["bodies"])
    reqs = [
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b
        for b in bodies
    ]
    conc = spec.get("concurrency", 1)
    warmup = spec.get("warmup_requests", 0)
    duration = spec.get("duration_s")
    count = spec.get("requests")
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(conc):
        _, proto = await loop.create_connection(_Conn, host, port)
        conns.append(proto)
    lat: list[float] = []
    statuses: dict[int, int] = {}
    first: dict[int, str] = {}
    counter = 0
    state = {"measuring": False}

    stagger = spec.get("stagger_s", 0.0)  # worker i starts i x this late: clients of an engine with a fixed answer
    # time would otherwise stay in step, all arriving at once (a burst the server queues), every round

    async def worker(c: _Conn, wid: int, stop_at: float | None, limit: int | None) -> None:
        nonlocal counter
        if stagger and state["measuring"]:
            await asyncio.sleep(wid * stagger)
        while True:
            i = counter
            counter += 1
            if limit is not None and i >= limit:
                return
            if stop_at is not None and time.perf_counter() >= stop_at:
                return
            k = i % len(reqs)
            t0 = time.perf_counter()
            status, body = await c.request(reqs[k])
            dt = time.perf_counter() - t0
            if state["measuring"]:
                lat.append(dt)
                statuses[status] = statuses.get(status, 0) + 1
                if k not in first:
                    first[k] = body.decode("utf-8", "replace")

    if warmup:
        counter = 0
        await asyncio.gather(*(worker(c, i, None, warmup) for i, c in enumerate(conns)))
    counter = 0
    state["measuring"] = True
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    stop_at = t0 + duration if duration else None
    await asyncio.gather(*(worker(c, i, stop_at, count) for i, c in enumerate(conns)))
    elapsed = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    for c in conns:
        if c.transport:
            c.transport.close()
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e6 if lat else float("nan")

    return {
        "requests": len(lat),
        "elapsed_s": elapsed,
        "rps": len(lat) / elapsed if elapsed else 0.0,
        "p50_us": pct(50), "p90_us": pct(90), "p99_us": pct(99),
        "mean_us": sum(lat) / len(lat) * 1e6 if lat else float("nan"),
        "max_us": lat[-1] * 1e6 if lat else float("nan"),
        "statuses": statuses,
        "client_cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
        "first": {str(k): v for k, v in first.items()},
    }


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    try:
        import uvloop

        result = uvloop.run(run(spec))
    except ImportError:  # pragma: no cover
        result = asyncio.run(run(spec))
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":
    main()
