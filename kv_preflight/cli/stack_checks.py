"""What ``kv-preflight up`` (cli/up.py) checks and clears before any process starts: the data directory, the
ports, the engines given, and with ``--fresh`` the index an earlier up kept. Each refusal is one line naming
the flag."""
from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
from pathlib import Path

import click
import httpx


def prepare_data_dir(data_dir: Path) -> None:
    """The data directory and its logs/, made or refused in one line before any process starts: a path
    below a file, or one that cannot be written, failed only once Valkey was up (a traceback)."""
    try:
        (data_dir / "logs").mkdir(parents=True, exist_ok=True)
        if not os.access(data_dir, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable")
    except OSError as exc:
        raise click.BadParameter(f"{data_dir}: {exc.strerror or exc}", param_hint="'--data-dir'") from None


def check_port(port: int, what: str, flag: str) -> None:
    """Refused before anything starts (a busy predictor port was found only once Valkey, engines and
    ingesters were up, ~10 s later): bound and let go at once, as the child will bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # as uvicorn binds: a port whose last connections linger in TIME_WAIT (up run again at once) is free
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise click.BadParameter(f"port {port} for the {what} is not free on 127.0.0.1 ({exc.strerror}); stop "
                                     f"what holds it or choose another", param_hint=f"'{flag}'") from None


def check_engines(urls: list[str], timeout_s: float = 5.0) -> None:
    """Each --engine asked for its KV-event publishers, as the ingesters will ask it, before anything starts:
    one that cannot answer is named with the cause in one line (it used to cost 30 s and a message that named
    neither the engine nor why)."""
    from kv_preflight.ingester.discovery import DISCOVERABLE, discover

    async def ask(url: str) -> str:
        try:
            await discover(url, timeout_s=timeout_s)
        except httpx.ConnectError as exc:
            return f"cannot connect ({exc or 'connection refused'}): is the engine running, and is this its HTTP port?"
        except httpx.TimeoutException:
            return f"no answer within {timeout_s:g}s"
        except httpx.HTTPStatusError as exc:
            return (f"{exc.request.url.path} answered {exc.response.status_code}: not an engine kv-preflight can read "
                    f"its KV-event publishers from (vLLM: {DISCOVERABLE[0].discovery_path}; docs/engines.md)")
        except (httpx.HTTPError, OSError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    async def ask_all() -> list[str]:
        return list(await asyncio.gather(*(ask(u) for u in urls)))

    problems = [f"engine {u}: {why}" for u, why in zip(urls, asyncio.run(ask_all())) if why]
    if problems:
        raise click.BadParameter("; ".join(problems), param_hint="'--engine'")


def fresh_start(data_dir: Path) -> list[Path]:
    """``--fresh``: the index up's Valkey kept (single node and cluster AOF, cluster config) removed, logs too;
    nothing else in the data directory is touched. Returns what was removed."""
    gone = []
    for name in ("valkey", "valkey-cluster", "logs"):
        path = data_dir / name
        if path.exists():
            shutil.rmtree(path)
            gone.append(path)
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    return gone
