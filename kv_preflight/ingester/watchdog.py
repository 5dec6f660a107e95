"""Notices an ingester loop that stopped making progress, and says what it is waiting for.

An await that never returns leaves the event loop idle in epoll: nothing fails, so nothing is
logged, and the ingester silently ingests nothing. The loop and the membership round mark each
step they reach (``Progress.mark``); a watchdog looks every second, and when no step was reached
for ``stall_s`` it logs one warning with the awaited stack of the stuck task (coroutine by
coroutine down to the future it waits on, then into the task that future is, if it is one) and
the other pending tasks, and counts a stall (``loop_stalls``).

The watchdog is a thread, not a task: a task would share the fate of what it watches (a loop
whose timers no longer fire, or one blocked in a call that never yields, would never run it).
The thread asks the loop for the task stacks (``call_soon_threadsafe`` wakes even an idle loop);
a loop that does not run that within ``answer_s`` is blocked, and the thread logs the Python
stack of the loop's thread instead.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvpf.ingester")

STALL_S = 5.0  # no step reached for this long is a stall (the loop reaches one at least every second)
CHECK_S = 1.0
ANSWER_S = 2.0  # a loop that does not run a callback within this is blocked, not idle
MAX_DEPTH = 60  # lines of one awaited stack
MAX_OTHER_TASKS = 20


@dataclass
class Progress:
    """The last step the loop (or a membership round) reached, and when (monotonic)."""

    step: str = "starting"
    at: float = field(default_factory=time.monotonic)
    # the membership round under way: when it started and how long it may take. A round marks each of its
    # steps, so a round that crawls (twenty attaches of two seconds each) never looks stalled: its own
    # deadline is what says it overran.
    round_at: float | None = None
    round_deadline_s: float = 0.0

    def mark(self, step: str) -> None:
        self.step = step
        self.at = time.monotonic()

    def begin_round(self, deadline_s: float) -> None:
        self.round_at, self.round_deadline_s = time.monotonic(), deadline_s

    def end_round(self) -> None:
        self.round_at = None


def _frame_line(frame) -> str:
    code = frame.f_code
    return f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'


def awaited_stack(task: asyncio.Future, depth: int = MAX_DEPTH) -> list[str]:
    """Where a pending task is suspended: each coroutine it awaits (``cr_await``), innermost last, then
    the future the task waits on (``_fut_waiter``); a future that is itself a task is followed into.
    (``Task.get_stack`` gives only the outermost frame of a suspended coroutine.)"""
    lines: list[str] = []
    seen: set[int] = set()
    while isinstance(task, asyncio.Task) and id(task) not in seen and len(lines) < depth:
        seen.add(id(task))
        lines.append(f"task {task.get_name()}:")
        obj = task.get_coro()
        while obj is not None and len(lines) < depth:
            frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
            if frame is None:  # a Future's __await__ iterator (the future is the task's _fut_waiter), or done
                break
            lines.append(_frame_line(frame))
            obj = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None) or getattr(obj, "ag_await", None)
        waiter = getattr(task, "_fut_waiter", None)
        if waiter is None:
            break
        lines.append(f"  waiting on {waiter!r}"[:400])
        task = waiter
    return lines


def tasks_report(stuck: asyncio.Task) -> str:
    """The stuck task's awaited stack and the other pending tasks' (run on the loop's thread)."""
    others = [t for t in asyncio.all_tasks() if t is not stuck and not t.done()]
    text = ["awaited stack of the stuck task:", *awaited_stack(stuck), f"other pending tasks ({len(others)}):"]
    for t in sorted(others, key=lambda t: t.get_name())[:MAX_OTHER_TASKS]:
        text.extend(awaited_stack(t, depth=12))
    return "\n".join(text)


class Watchdog:
    """Watches ``progress`` from a thread of its own; on a stall logs where ``task`` waits and calls
    ``on_stall`` (on the loop's thread when the loop answers, else on the watchdog's)."""

    def __init__(self, progress: Progress, task: asyncio.Task, on_stall: Callable[[], None],
                 stall_s: float = STALL_S, check_s: float = CHECK_S, answer_s: float = ANSWER_S,
                 on_overrun: Callable[[], None] | None = None) -> None:
        self.progress = progress
        self.on_overrun = on_overrun
        self.overrun_at: float | None = None  # the start of the round already reported as overrunning
        self.task = task
        self.loop = task.get_loop()
        self.on_stall = on_stall
        self.stall_s = stall_s
        self.check_s = check_s
        self.answer_s = answer_s
        self.stalled_at: float | None = None  # the progress time of the stall already reported
        self.loop_thread = threading.get_ident()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="kvpf-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.check_s):
            self.check()

    def _check_round(self, now: float) -> None:
        """A membership round past its deadline: logged once per round, with the step it is at."""
        started, deadline = self.progress.round_at, self.progress.round_deadline_s
        if started is None or deadline <= 0 or now - started < deadline or self.overrun_at == started:
            return
        self.overrun_at = started
        if self.on_overrun is not None:
            self.on_overrun()
        log.warning("membership round overran: %.1f s since it started (deadline %.1f s), now at %r; the lease is "
                    "renewed beside it, but engines wait for it", now - started, deadline, self.progress.step)

    def check(self, now: float | None = None) -> bool:
        """One look (from any thread); True if a stall was reported now."""
        now = time.monotonic() if now is None else now
        self._check_round(now)
        at, step = self.progress.at, self.progress.step
        if self.stalled_at is not None and at != self.stalled_at:
            log.warning("ingester loop moving again (%s), %.1f s after its stall", step, at - self.stalled_at)
            self.stalled_at = None
        if now - at < self.stall_s or self.stalled_at is not None or self.task.done():
            return False
        self.stalled_at = at
        answered = threading.Event()
        blocked = threading.Event()  # reported as blocked already: a late answer is not a second stall

        def report() -> None:  # on the loop's thread: the tasks can be read safely there
            answered.set()
            if not blocked.is_set():
                self.on_stall()
            log.warning("ingester loop stalled: no progress for %.1f s, last step %r\n%s",
                        time.monotonic() - at, step, tasks_report(self.task))

        if threading.get_ident() == self.loop_thread:
            report()
            return True
        try:
            self.loop.call_soon_threadsafe(report)
        except RuntimeError:  # the loop is closed: nothing left to watch
            return False
        if not answered.wait(self.answer_s):
            blocked.set()
            self.on_stall()
            frame = sys._current_frames().get(self.loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)"
            log.warning("ingester loop blocked: no progress for %.1f s, last step %r, and its event loop does not "
                        "run callbacks (a blocking call, or CPU starvation); its thread is in:\n%s",
                        time.monotonic() - at, step, stack)
        return True
