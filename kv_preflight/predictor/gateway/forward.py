"""The gateway's one pooled HTTP client to the engines, and what counts as a failure worth another pod.

One ``httpx.AsyncClient`` per process, its pool as large as the requests allowed in flight (so a request never
waits for a connection another, slow one holds), connect bounded by ``--gateway-connect-timeout`` and each
read by ``--gateway-read-timeout`` (a generation may take minutes; a silent engine may not hold a request
forever). The request body goes up as the client sent it; the answer comes back as the engine's raw bytes
(``aiter_raw``: no decompression, no re-chunking), its headers less the hop-by-hop ones.

Retryable, before the first byte of an answer: the connection failed (refused, timed out, or closed by the
engine without an answer, as a kept-alive connection the engine dropped is) or the engine answered 5xx.
Anything after the first byte is the client's answer: a stream cut short is cut short for the client too.
"""
from __future__ import annotations

from collections.abc import Iterable

import httpx

from kv_preflight.config import Config

# RFC 9110 7.6.1 hop-by-hop headers, and what httpx sets itself from the body it is given.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "transfer-encoding", "upgrade", "host", "content-length"})
DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's header that pins a request to a data-parallel rank


class UpstreamFailed(Exception):
    """The engine gave no answer worth passing on; ``connect``: it could not be reached at all."""

    def __init__(self, kind: str, detail: str, *, connect: bool):
        super().__init__(detail)
        self.kind, self.detail, self.connect = kind, detail, connect


class Upstream:
    def __init__(self, cfg: Config):
        timeout = httpx.Timeout(connect=cfg.gateway_connect_timeout_s, read=cfg.gateway_read_timeout_s,
                                write=cfg.gateway_read_timeout_s, pool=cfg.gateway_connect_timeout_s)
        limits = httpx.Limits(max_connections=cfg.gateway_max_inflight,
                              max_keepalive_connections=min(cfg.gateway_max_inflight, 512), keepalive_expiry=30.0)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)

    async def open(self, url: str, body: bytes, headers: Iterable[tuple[bytes, bytes]],
                   dp_rank: int | None = None) -> httpx.Response:
        """The engine's answer, its status and headers read, its body not yet: the caller streams and closes it.
        UpstreamFailed when the engine gave nothing worth passing on (see the module's docstring)."""
        sent = [(k, v) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]
        if dp_rank is not None:
            sent.append((DP_RANK_HEADER.encode(), str(dp_rank).encode()))
        request = self.client.build_request("POST", url, content=body, headers=sent)
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise UpstreamFailed("connect", f"cannot connect: {exc or type(exc).__name__}", connect=True) from None
        except httpx.PoolTimeout as exc:  # our own pool, not the engine: never the engine's fault
            raise UpstreamFailed("pool", f"no connection free in the gateway's pool: {exc}", connect=False) from None
        except httpx.RemoteProtocolError as exc:
            raise UpstreamFailed("protocol", f"closed without an answer: {exc}", connect=False) from None
        except httpx.TimeoutException as exc:
            raise UpstreamFailed("timeout", f"no answer within the read timeout: {exc or type(exc).__name__}",
                                 connect=False) from None
        if response.status_code >= 500:
            try:
                text = (await response.aread())[:300].decode("utf-8", "replace")
            except httpx.HTTPError:
                text = ""
            finally:
                await response.aclose()
            raise UpstreamFailed("5xx", f"answered {response.status_code}: {text}", connect=False)
        return response

    async def aclose(self) -> None:
        await self.client.aclose()


def answer_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    """The engine's response headers to pass on: all but hop-by-hop (content-length stays: the body is passed
    on as the engine sent it, byte for byte)."""
    return [(k, v) for k, v in response.headers.raw
            if (name := k.decode("latin-1").lower()) == "content-length" or name not in HOP_BY_HOP]
