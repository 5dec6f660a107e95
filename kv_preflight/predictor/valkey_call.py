"""Every Valkey step of the read path runs bounded: ``valkey_call`` turns a timeout or any Valkey failure into
IndexUnavailable (a 503), never a hang or a 500."""
from __future__ import annotations

import asyncio

from kv_preflight.index.backend import VALKEY_ERRORS
from kv_preflight.predictor.errors import IndexUnavailable, clip


class valkey_call:
    """Bound a Valkey step and turn any of its failures into IndexUnavailable: ``async with valkey_call(s, what)``.
    (A class, not a generator-based context manager: a route takes several, and contextlib's cost per use shows.)"""

    __slots__ = ("timeout_s", "what", "_timeout")

    def __init__(self, timeout_s: float, what: str) -> None:
        self.timeout_s, self.what = timeout_s, what

    async def __aenter__(self) -> None:
        self._timeout = asyncio.timeout(self.timeout_s)
        await self._timeout.__aenter__()

    async def __aexit__(self, kind, exc, tb) -> bool | None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)  # the deadline passed: TimeoutError here
        except TimeoutError:
            raise IndexUnavailable(f"valkey did not answer {self.what} within {self.timeout_s}s") from None
        if kind is None:
            return None
        if issubclass(kind, TimeoutError):  # a timeout of the step's own, inside the bound
            raise IndexUnavailable(f"valkey did not answer {self.what} within {self.timeout_s}s") from None
        if issubclass(kind, VALKEY_ERRORS):
            raise IndexUnavailable(f"valkey unavailable ({self.what}): {kind.__name__}: {clip(str(exc))}") from None
        return None


__all__ = ["valkey_call"]
