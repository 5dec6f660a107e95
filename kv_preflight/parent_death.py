"""Child processes that end when the process that started them dies, whatever kills it (Linux).

``kv-preflight up`` starts Valkey, simulators, ingesters and the predictor in sessions of their own (a
terminal's Ctrl-C reaches ``up`` alone, which stops them in order). When ``up`` itself was killed with
SIGKILL, or crashed, nothing stopped them: a whole stack was found running hours later with parent 1.

Why the kernel's ``PR_SET_PDEATHSIG`` rather than a parent-watch in each child (as predictor/serve.py's
Dynamo child polls ``getppid``) or a guardian process:
- the kernel sends the signal: no code of ours has to run in the child, so it also covers valkey-server,
  which is not ours, and a child whose loop is stuck;
- no thread and no polling in every process, and it fires at once, not within a poll interval;
- a guardian process can be killed with the rest (``kill -9`` of a process group took both).

Its rules, and how they are met here:
- it fires when the *thread* that forked the child ends, not the process: ``up`` and uvicorn's supervisor
  start their children from their main thread, which lasts as long as the process;
- it survives ``execve``, except of a set-user-ID or set-group-ID program (or one with file
  capabilities): python and valkey-server are neither;
- a child's own children do not inherit it: each generation arms its own (``serve --workers N``'s uvicorn
  workers do, predictor/serve.py);
- the signal is SIGTERM, so each child runs its ordinary shutdown: Valkey writes out its AOF and exits
  cleanly, the Python processes close their connections. What is lost is the order: all get it at once,
  where ``up``'s own stop ends Valkey after its clients;
- a parent that died between ``fork`` and ``prctl`` is noticed by comparing ``getppid`` with its pid.

Linux only; elsewhere nothing is armed (``preexec`` returns None, ``end_with_parent`` False), and a
SIGKILLed ``up`` leaves its children running (README, ``kv-preflight up``).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def supported() -> bool:
    return sys.platform.startswith("linux")


def _prctl() -> Callable[..., int]:
    return ctypes.CDLL(None, use_errno=True).prctl


def preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies; None where
    that cannot be had. libc is looked up here, in the parent, so the child between fork and exec only
    calls it (``preexec_fn`` is safe only while the parent runs no other thread, which ``up`` does not
    when it starts children)."""
    if not supported():
        return None
    prctl, parent = _prctl(), os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)  # on failure the child runs as it would have before
        if os.getppid() != parent:  # the parent died before the call: nobody will send sig
            os._exit(1)

    return arm


def end_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """For a Python process started by ``parent_pid``: receive ``sig`` when it dies (sent at once if it
    died already). Whether that could be arranged."""
    if not supported() or _prctl()(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True
