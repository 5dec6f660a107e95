"""Waiting on an observable event in the integration tests, never on a sleep of a guessed length."""
from __future__ import annotations

import asyncio
import time


async def until(pred, what: str, timeout: float = 20.0):
    """``await pred()`` every 0.1 s until it answers something true (returned); AssertionError naming ``what``
    and the last answer after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = await pred()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
