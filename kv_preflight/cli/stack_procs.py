"""The processes ``kv-preflight up`` runs (cli/up.py): each child a real ``kv-preflight`` process in a session of
its own with its log under <data-dir>/logs, its readiness (the child itself answering, not whatever held its
port), why it stopped, the simulated engines started side by side, and an engine's failure followed as the
fleet records show it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
import httpx

from kv_preflight import parent_death
from kv_preflight.cli.valkey_cluster import ValkeyCluster
from kv_preflight.cli.valkey_server import ValkeyServer, free_port


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    pod: str = ""  # a simulated engine's pod: its exit is an engine failure the stack lives through
    url: str = ""  # its HTTP URL (a simulated engine), or its /metrics (an ingester)


@dataclass
class Stack:
    data_dir: Path
    children: list[Child] = field(default_factory=list)
    valkey: ValkeyServer | ValkeyCluster | None = None
    stopping: bool = False

    def spawn(self, name: str, args: list[str], *, pod: str = "", url: str = "") -> Child:
        log_dir = self.data_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = log_dir / f"{name}.log"
        # A session of its own: Ctrl-C reaches `up` alone, which stops the children in order. Sharing the
        # terminal's process group, they exited on the same SIGINT, and up took one for a crash. Being out of
        # that group, nothing else would end them if `up` died: the kernel sends them SIGTERM then (Linux).
        with open(log, "a") as fh:  # the child writes through its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", "kv_preflight", *args], stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
                                    preexec_fn=parent_death.preexec())
        child = Child(name, proc, log, pod, url)
        self.children.append(child)
        return child

    def check(self) -> Child | None:
        """A child that exited on its own; None once we are stopping them (their exits are ours)."""
        if self.stopping:
            return None
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        self.stopping = True
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in reversed(self.children):
            try:
                c.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):  # gone before up says "stopped."
                    c.proc.wait(timeout=10)
        if self.valkey:
            self.valkey.stop()


def last_error(log: Path) -> str:
    """The line of a child's log that says why it stopped: its last error line, else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    # case-sensitive: "INFO uvicorn.error: Application shutdown complete" is not the reason
    errors = [ln for ln in lines if re.search(r"\bERROR\b|\bError\b|\[Errno|Exception|refused|denied|in use", ln)]
    return (errors or lines or ["(its log is empty)"])[-1]


def exited(child: Child) -> str:
    """Why a child stopped: the signal that killed it (its log's last error is then no cause: a start-up line,
    at best), else its exit status and its log's last error line."""
    rc = child.proc.returncode
    if rc is not None and rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"{child.name} was killed by {name}  (log: {child.log})"
    return f"{child.name} exited ({rc}): {last_error(child.log)}  (log: {child.log})"


def descendants(pid: int) -> set[int]:
    """pid and every process below it, from /proc (Linux)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {pid}, True
    while grew:
        grew = False
        for p, ppid in parents.items():
            if ppid in tree and p not in tree:
                tree.add(p)
                grew = True
    return tree


def listens_on(pid: int, port: int) -> bool | None:
    """Whether ``pid`` or a process below it holds the socket listening on ``port``: the server that
    answers is the child we started, not whatever already had the port. None where /proc cannot tell."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not Path("/proc/net/tcp").exists():
        return None
    for p in descendants(pid):
        try:
            fds = list(Path(f"/proc/{p}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def wait_http(url: str, stack: Stack, what: str, child: Child | None = None, timeout_s: float = 60) -> None:
    """Until ``url`` answers 200 from ``child`` (when given): a server already on that port answering in
    its place is not readiness; the child then exits with its own error, which is what we show."""
    port = httpx.URL(url).port
    deadline = time.monotonic() + timeout_s
    foreign = False
    while time.monotonic() < deadline:
        dead = stack.check()
        if dead:
            raise click.ClickException(exited(dead))
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                if child is None or port is None or listens_on(child.proc.pid, port) is not False:
                    return
                foreign = True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    if foreign:
        raise click.ClickException(f"another server answers at {url}, not the {what} up started (its log: "
                                   f"{child.log}); choose a free port")
    raise click.ClickException(f"{what} did not become ready at {url} within {timeout_s}s")


PORT_TAKEN = "address already in use"  # ZMQ's words, and uvicorn's (lower case)


SIM_ATTEMPTS = 3


def start_sims(stack: Stack, count: int, args: list[str], draw=free_port) -> list[str]:
    """Simulated engines side by side, each on three ports free when drawn (HTTP, ZMQ, replay): their URLs,
    once each answers. One whose port another process took before it bound it (``free_port`` can only say
    "free now") is started again on others, up to ``SIM_ATTEMPTS`` times: a port race is no reason for `up`
    to fail (it did, in CI, beside other tests drawing ports)."""
    def spawn(i: int) -> tuple[Child, str]:
        http, zp, rp = draw(), draw(), draw()
        url = f"http://127.0.0.1:{http}"
        child = stack.spawn(f"engine-sim-{i}", ["simulate", "--pod", f"sim-{i}", "--port", str(http),
                                                "--zmq", f"tcp://*:{zp}", "--replay", f"tcp://*:{rp}", *args],
                            pod=f"sim-{i}", url=url)
        return child, url

    sims = [spawn(i) for i in range(count)]
    tries = [1] * count
    i = 0
    while i < count:
        child, url = sims[i]
        try:
            wait_http(url + "/v1/models", stack, "simulated engine", child)
            i += 1
            continue
        except click.ClickException:
            dead = stack.check()
            j = next((k for k, (c, _) in enumerate(sims) if c is dead), None)
            if j is None or tries[j] >= SIM_ATTEMPTS or PORT_TAKEN not in last_error(dead.log).lower():
                raise
        stack.children.remove(dead)
        dead.log.rename(dead.log.with_name(f"{dead.log.stem}.port-taken-{tries[j]}.log"))  # the next try's own
        tries[j] += 1
        click.echo(f"      engine-sim-{j}: a port was taken before it could bind it; starting it on others")
        sims[j] = spawn(j)
        i = min(i, j)
    return [url for _, url in sims]


def say_event(text: str) -> None:
    """A line of what happens to the fleet after start-up, after the local time (HH:MM:SS): without it the wait
    between "unreachable" and "retired" (``--retire-after``, 60 s) could not be seen in the output."""
    click.echo(f"{time.strftime('%H:%M:%S')} {text}")


class EngineFailures:
    """A simulated engine that exits under ``up`` is an engine failure, not the stack's: said at once, then the
    fleet followed as production follows it (ingesters find the engine unreachable after their failed health
    checks and stop offering it; past ``ingest --retire-after`` its pod is retired, its entries cleared), each
    step printed as the fleet records show it, after the time it was seen (``say_event``)."""

    def __init__(self, valkey_url: str, engines: int, every_s: float = 1.0):
        self.valkey_url = valkey_url
        self.left = engines
        self.every_s = every_s
        self.watching: dict[str, str] = {}  # pod -> the state last printed
        self._next = 0.0

    def lost(self, child: Child) -> None:
        self.left -= 1
        retire = os.environ.get("KVPF_RETIRE_AFTER") or os.environ.get("KVPF_RETIRE_AFTER_S") or "60"
        say_event(click.style("engine failure: ", fg="yellow") + f"{exited(child)}. The stack stays up "
                  f"({self.left} engine(s) left): the ingesters will find {child.url} unreachable after "
                  f"{os.environ.get('KVPF_HEALTH_FAILURES') or 3} failed health checks, stop routing to pod "
                  f"{child.pod}, and retire it after {retire} s (its entries cleared; KVPF_RETIRE_AFTER sets that). "
                  f"`kv-preflight index pods` shows it.")
        self.watching[child.pod] = "live"

    def follow(self) -> None:
        """Print each watched pod's new fleet state (at most once a second; Valkey busy: asked again later)."""
        if not self.watching or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.every_s
        try:
            records = asyncio.run(asyncio.wait_for(self._records(), timeout=5))
        except Exception:
            return
        for pod, was in list(self.watching.items()):
            rec = records.get(pod)
            state = rec.state if rec is not None else "gone"
            if state == was:
                continue
            self.watching[pod] = state
            why = f" ({rec.reason})" if rec is not None and rec.reason else ""
            if state == "unreachable":
                say_event(f"{pod}: unreachable{why}: not routed to, its blocks still listed until it is retired")
            elif state in ("retired", "gone"):
                say_event(f"{pod}: retired{why}: its entries are cleared and it is no longer offered")
                del self.watching[pod]
            elif state == "live":
                say_event(f"{pod}: live again")

    async def _records(self) -> dict:
        from kv_preflight.cli.stack_file import fleet_view_at

        return (await fleet_view_at(self.valkey_url)).pods
