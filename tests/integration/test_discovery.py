"""Engines that are down when an ingester starts: it starts anyway, ingests the others, logs the
down one by URL, and picks it up once it answers (real processes: simulated engines, ingester,
Valkey). One unreachable --engine used to end the whole ingester with "All connection attempts
failed", naming no URL."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_log
from tests.integration.sim import sim_engine

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


def complete(url: str, tokens: list[int]) -> None:
    httpx.post(url + "/v1/completions", json={"model": "sim", "prompt": tokens, "max_tokens": 1},
               timeout=10).raise_for_status()


async def blocks_of(ix: Index, pod: str, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = await ix.meta.pod_info(pod)
        if info.blocks:
            return info.blocks
        await asyncio.sleep(0.1)
    raise AssertionError(f"{pod} never got blocks in the index")


async def test_an_engine_down_at_start_is_picked_up_later(valkey_url, tmp_path):
    up, down = sim_engine("sim-up", tmp_path), sim_engine("sim-late", tmp_path)
    up.start()
    ix = Index.from_url(valkey_url)
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", up.url, "--engine", down.url],
                str(tmp_path / "ing.log"))
    try:
        # Alive after it found the late engine unreachable (the process says so), not merely after a while.
        wait_log(str(tmp_path / "ing.log"), "retrying in the background", ing)
        assert ing.poll() is None, (tmp_path / "ing.log").read_text()[-2000:]
        complete(up.url, list(range(100, 164)))
        assert await blocks_of(ix, "sim-up") > 0
        log = (tmp_path / "ing.log").read_text()
        assert down.url in log and "retrying in the background" in log
        # The late engine comes up and serves a request: its blocks arrive without a restart.
        down.start()
        complete(down.url, list(range(300, 364)))
        assert await blocks_of(ix, "sim-late", timeout=30.0) > 0
        assert ing.poll() is None
    finally:
        stop(ing)
        up.stop()
        down.stop()
        await ix.close()
