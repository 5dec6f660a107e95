"""predictor/index_gauges.py: the per-pod series' bound, the memory estimate, and readings behind the scrapes."""
from __future__ import annotations

import asyncio
import time

import pytest

from kv_preflight.predictor import index_gauges
from kv_preflight.predictor.index_gauges import IndexNumbers, IndexReadings, memory_share, pod_series

pytestmark = pytest.mark.anyio


def test_the_pods_holding_most_get_series_the_rest_are_summed():
    blocks = {f"p{i:03}": i for i in range(150)}
    shown = pod_series(blocks, limit=100)
    assert len(shown) == 101 and shown["_other"] == sum(range(50)) and "p149" in shown and "p049" not in shown
    assert pod_series({"a": 1}, limit=100) == {"a": 1}


def test_memory_is_shared_by_blocks_held():
    assert memory_share(1000, {"a": 3, "b": 1}) == {"a": 750.0, "b": 250.0}
    assert memory_share(None, {"a": 3}) == {} and memory_share(1000, {"a": 0}) == {}


NUMBERS = IndexNumbers(keys=1, pods=1, incomplete_pods=0, blocks=2, used_memory_bytes=10, pod_blocks={"a": 2})


async def test_a_scrape_never_waits_long_on_valkey_and_a_stale_reading_is_dropped(monkeypatch):
    """A liveness probe on /metrics must not fail while Valkey hangs: the scrape waits half a second at most,
    then gets the last reading; errors are counted; a reading older than KEEP_S is no longer shown."""
    now = [100.0]
    hang = asyncio.Event()
    calls, errors = [], []

    async def read():
        calls.append(1)
        if len(calls) > 1:
            await hang.wait()  # Valkey stops answering
        return NUMBERS

    readings = IndexReadings(read, timeout_s=30, on_error=lambda: errors.append(1), clock=lambda: now[0])
    assert await readings.latest() == NUMBERS
    now[0] += 5
    t = time.monotonic()
    assert await readings.latest() == NUMBERS  # the last one, within SCRAPE_WAITS_S
    assert time.monotonic() - t < index_gauges.SCRAPE_WAITS_S + 0.3
    assert await readings.latest() == NUMBERS and len(calls) == 2  # one reading at a time
    now[0] += index_gauges.KEEP_S
    assert await readings.latest() is None
    await readings.aclose()

    async def failing():
        raise ConnectionError("refused")

    broken = IndexReadings(failing, timeout_s=1, on_error=lambda: errors.append(1), clock=lambda: now[0])
    assert await broken.latest() is None and errors == [1]
