"""The write path's retry (ingester/valkey_retry.py): what counts as Valkey failing, and since when."""
from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ResponseError

from kv_preflight.ingester import valkey_retry
from kv_preflight.ingester.valkey_retry import RECOVERED_S, ValkeyRetry, transient


def test_oom_misconf_and_connection_trouble_are_transient_a_wrong_type_is_not():
    assert transient(OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    assert transient(ResponseError("OOM command not allowed when used memory > 'maxmemory'. script: x"))
    assert transient(ResponseError("MISCONF Errors writing to the AOF file"))
    assert transient(RedisConnectionError("gone"))
    assert not transient(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))


def test_one_call_that_gets_through_does_not_end_the_failing(monkeypatch):
    """At maxmemory one write in a few passes: a success between failures must not restart the stall clock, nor
    end the failing; calls answering for RECOVERED_S do (or, with no call at all, RECOVERED_S after the last
    failure)."""
    clock = [100.0]
    monkeypatch.setattr(valkey_retry.time, "monotonic", lambda: clock[0])
    retry = ValkeyRetry(asyncio.Event(), on_error=lambda: None)
    assert retry.failing_for() is None
    retry.note_failure()
    clock[0] = 101.0
    retry.note_answer()  # one call got through
    clock[0] = 101.5
    assert retry.failing()
    retry.note_failure()
    clock[0] = 104.0
    assert retry.failing_for() is None  # no call since 101.5: over
    retry.note_failure()
    assert retry.failing_for() == pytest.approx(0.0)  # a new period
    clock[0] = 109.0
    retry.note_answer()  # the first answer after 5 s of a retry's sparse attempts
    clock[0] = 110.0
    assert retry.failing_for() == pytest.approx(6.0)  # since 104.0, through the answer
    clock[0] = 109.0 + RECOVERED_S
    assert not retry.failing()


@pytest.mark.anyio
async def test_a_call_retrying_keeps_valkey_failing_however_long_its_backoff(monkeypatch):
    async def no_sleep(attempt: int, cap_s: float = 5.0) -> None:
        await asyncio.sleep(0)

    monkeypatch.setattr(valkey_retry, "sleep_backoff", no_sleep)
    retry = ValkeyRetry(asyncio.Event(), on_error=lambda: None)
    seen = []
    outcomes = [OutOfMemoryError("x"), OutOfMemoryError("x"), "ok"]

    async def flaky():
        seen.append(retry._retrying)
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    assert await retry.call(flaky) == "ok"
    assert seen == [0, 1, 1] and retry._retrying == 0
    assert retry.failing()  # the last failure is younger than RECOVERED_S
    with pytest.raises(ResponseError):
        await retry.call(lambda: _raise(ResponseError("WRONGTYPE x")))
    assert retry._retrying == 0


async def _raise(exc: BaseException):
    raise exc


@pytest.fixture
def anyio_backend():
    return "asyncio"
