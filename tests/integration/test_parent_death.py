"""kv_preflight/parent_death.py with real processes: a child started through ``preexec`` ends when its starter is
killed with SIGKILL, and a process that arms ``end_with_parent`` after its parent already died ends too."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")]

# A starter that runs ``sleep`` as its child, as `up` runs its children, prints the child's pid and waits.
STARTER = """
import subprocess, sys, time
from kv_preflight import parent_death
child = subprocess.Popen(["sleep", "120"], start_new_session=True, preexec_fn=parent_death.preexec())
print(child.pid, flush=True)
time.sleep(120)
"""

# A starter that exits at once, leaving a child that arms end_with_parent only after that.
LATE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", '''
import os, sys, time
parent = int(sys.argv[1])
while os.getppid() == parent:  # until the starter is gone
    time.sleep(0.01)
from kv_preflight import parent_death
assert parent_death.end_with_parent(parent)
time.sleep(120)
''', str(__import__("os").getpid())], start_new_session=True)
print(child.pid, flush=True)
"""


def _gone(pid: int, within_s: float = 30) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # ended; its new parent has yet to reap it
            return True
        time.sleep(0.05)
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def test_a_child_ends_when_its_starter_is_killed():
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True)
    child = int(starter.stdout.readline())
    try:
        assert not _gone(child, within_s=0.5)  # running while its starter runs
        starter.kill()
        starter.wait()
        assert _gone(child), "the child outlived its SIGKILLed starter"
    finally:
        starter.kill()
        starter.wait()
        _kill(child)


def test_a_child_whose_parent_died_before_it_armed_ends_at_once():
    starter = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True, timeout=60)
    child = int(starter.stdout.split()[0])
    try:
        assert _gone(child), "the child went on although its parent was gone when it armed"
    finally:
        _kill(child)
