"""Every Valkey step of the read path runs bounded: ``valkey_call`` turns a timeout or any Valkey failure into
IndexUnavailable (a 503), never a hang or a 500."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.predictor.errors import IndexUnavailable, clip


@asynccontextmanager
async def valkey_call(timeout_s: float, what: str) -> AsyncIterator[None]:
    """Bound a Valkey step and turn any of its failures into IndexUnavailable."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise IndexUnavailable(f"valkey did not answer {what} within {timeout_s}s") from None
    except VALKEY_ERRORS as exc:
        raise IndexUnavailable(f"valkey unavailable ({what}): {type(exc).__name__}: {clip(str(exc))}") from None


__all__ = ["valkey_call"]
