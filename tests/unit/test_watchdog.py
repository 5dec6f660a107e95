"""The ingester's loop watchdog (ingester/watchdog.py): a stall is reported once, with the awaited stack
of the stuck task down to the await that does not return; a blocked loop with its thread's stack."""
from __future__ import annotations

import asyncio
import logging
import time

from kv_preflight.ingester.watchdog import Progress, Watchdog, awaited_stack


async def _innermost(event: asyncio.Event) -> None:
    await event.wait()


async def _middle(event: asyncio.Event) -> None:
    await _innermost(event)


def test_awaited_stack_walks_coroutines_and_tasks():
    async def main():
        event = asyncio.Event()
        inner = asyncio.ensure_future(_middle(event))
        inner.set_name("inner")

        async def outer():
            await inner

        task = asyncio.ensure_future(outer())
        await asyncio.sleep(0.01)
        lines = awaited_stack(task)
        event.set()
        await task
        return lines

    lines = asyncio.run(main())
    text = "\n".join(lines)
    # outer -> the task it awaits -> _middle -> _innermost -> Event.wait -> the future it waits on
    assert "in outer" in text and "task inner:" in text
    assert text.index("in _middle") < text.index("in _innermost") < text.index("in wait")
    assert lines[-1].startswith("  waiting on <Future pending")


def test_stall_reported_once_with_the_stuck_await(caplog):
    stalls = []

    async def main():
        progress = Progress()
        event = asyncio.Event()
        dog = Watchdog(progress, asyncio.current_task(), lambda: stalls.append(1), stall_s=0.3, check_s=0.05).start()
        try:
            try:
                await asyncio.wait_for(_middle(event), 1.0)  # no step marked meanwhile: a stall
            except TimeoutError:
                pass
            progress.mark("moving")
            await asyncio.sleep(0.2)
        finally:
            dog.stop()

    with caplog.at_level(logging.WARNING, logger="kvpf.ingester"):
        asyncio.run(main())
    assert stalls == [1]
    stalled = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalled) == 1
    assert "in _innermost" in stalled[0] and "last step 'starting'" in stalled[0]
    assert any("moving again" in r.getMessage() for r in caplog.records)


def test_blocked_loop_reported_with_its_thread_stack(caplog):
    stalls = []

    def blocking_call():
        time.sleep(1.0)

    async def main():
        progress = Progress()
        dog = Watchdog(progress, asyncio.current_task(), lambda: stalls.append(1), stall_s=0.2, check_s=0.05,
                       answer_s=0.2).start()
        try:
            progress.mark("about to block")
            blocking_call()
            await asyncio.sleep(0.05)
        finally:
            dog.stop()

    with caplog.at_level(logging.WARNING, logger="kvpf.ingester"):
        asyncio.run(main())
    assert stalls == [1]  # once, although the loop answers the watchdog late
    blocked = [r.getMessage() for r in caplog.records if "blocked" in r.getMessage()]
    assert blocked and "in blocking_call" in blocked[0] and "about to block" in blocked[0]


def test_a_round_that_overruns_its_deadline_is_reported_once(caplog):
    """A membership round marks each step, so one that crawls never looks stalled; its deadline says it
    overran (issue 26, finding 3: twenty attaches of 2 s each went unnoticed)."""
    async def main():
        progress = Progress()
        overruns = []
        dog = Watchdog(progress, asyncio.current_task(), lambda: None, on_overrun=lambda: overruns.append(1))
        progress.begin_round(2.0)
        start = progress.round_at
        progress.mark("attaching tcp://x")
        assert not dog.check(now=start + 1.0) and overruns == []
        dog.check(now=start + 2.5)
        dog.check(now=start + 3.5)
        assert overruns == [1]
        progress.end_round()
        progress.begin_round(2.0)
        dog.check(now=progress.round_at + 2.5)
        return overruns

    with caplog.at_level(logging.WARNING, logger="kvpf.ingester"):
        assert asyncio.run(main()) == [1, 1]
    assert "membership round overran" in caplog.text and "attaching tcp://x" in caplog.text
