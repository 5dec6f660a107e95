"""The processes a test's ``kv-preflight up`` started, found without asking ``up``: a test that fails
half-way (an assertion, a timeout that SIGKILLs ``up``) must not leave its stack running.

``up`` starts its children in sessions of their own, so killing ``up``'s process group does not reach
them, and once ``up`` is gone they no longer sit below it. They are found instead by a mark ``up``'s
environment hands down (simulators, ingesters, the predictor and its uvicorn workers) and by their working
directory (valkey-server overwrites its environment for its process title, but chdirs into its data
directory, which a test keeps under its tmp_path). Linux (/proc); elsewhere nothing is found.
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

MARK = "KVPF_TEST_STACK"  # not a Config field: Config reads only the KVPF_ names it knows


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended; its parent has yet to reap it


def stack_pids(where: Path) -> list[int]:
    """Live processes marked with ``where`` or working under it, this process and its ancestors aside."""
    where = Path(where).resolve()
    mark = f"{MARK}={where}".encode()
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid in mine or not _alive(pid):
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            environ = []
        try:
            cwd = Path(os.readlink(entry / "cwd"))
        except OSError:
            cwd = None
        if mark in environ or (cwd is not None and (cwd == where or where in cwd.parents)):
            found.append(pid)
    return found


def still_running(where: Path, within_s: float = 10.0) -> list[int]:
    """The stack's processes still running after up to ``within_s`` (a process that exits on its pipe's end,
    such as multiprocessing's resource tracker, may outlive its parent by a moment)."""
    deadline = time.monotonic() + within_s
    while (left := stack_pids(where)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def reap(where: Path, grace_s: float = 10.0) -> list[int]:
    """SIGTERM every process of the stack (Valkey writes its AOF out), then SIGKILL what is left after
    ``grace_s``; returns the pids that were found running."""
    found = stack_pids(where)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        left = [p for p in found if _alive(p)]
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if _alive(p)]
        if not left:
            break
    return found


@contextmanager
def reaped(where: Path):
    """The environment to start ``up`` with; on leaving, whatever it left running is ended (the test's own
    assertions say whether something was left)."""
    env = dict(os.environ, **{MARK: str(Path(where).resolve())})
    try:
        yield env
    finally:
        reap(where)
