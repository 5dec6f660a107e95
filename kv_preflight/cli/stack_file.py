"""Where the local stack ``kv-preflight up`` runs, for every other command: ``<data-dir>/env`` and its lock.

``up`` takes ``<data-dir>/up.lock`` (an exclusive ``flock``) before it starts anything, so two ``up``s never
share one data directory (two valkey-servers appending to one AOF), and writes ``<data-dir>/env`` once the
stack is ready: shell ``export`` lines for ``KVPF_VALKEY_URL``, ``KVPF_PREDICTOR_URL``, ``KVPF_MODEL`` (the
model its engines serve), ``KVPF_STACK_ENGINES`` (their URLs) and ``KVPF_STACK_ENGINE_<i>`` (each one's: sim-<i>'s
for a simulated engine, for a shell that sources the file). Every other command reads that file (the data directory is ``KVPF_DATA_DIR``, else ``./.data``, as for ``up``) and takes
its values as defaults below flags and the environment, so ``kv-preflight index stats``, ``predict`` or
``demo`` reach the stack with no flags. A command that needs an engine or a model and is given neither takes
them from there, else from the fleet records (``engine_and_model``). The file counts only while its ``up`` holds the lock: one left by a ``kill -9`` is
ignored, as the kernel dropped the lock with the process.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import click
from click.core import ParameterSource

from kv_preflight.config import ENV_PREFIX
from kv_preflight.fleet.records import FleetView

DATA_DIR = ".data"  # up's --data-dir default (relative to where it runs)
ENV_FILE = "env"
LOCK_FILE = "up.lock"
# what the file sets; each is also what the options that take it read (cli/env.py)
VALKEY_URL = ENV_PREFIX + "VALKEY_URL"
PREDICTOR_URL = ENV_PREFIX + "PREDICTOR_URL"
MODEL = ENV_PREFIX + "MODEL"  # every --model reads it (cli/env.py): the stack's served model
# Not an option's name: --engine-url is a bare URL for some commands and MODEL=URL for others (serve, diagnose),
# so the stack's engines are read only where a bare engine URL is wanted (engine_and_model).
STACK_ENGINES = ENV_PREFIX + "STACK_ENGINES"
DATA_DIR_VAR = ENV_PREFIX + "DATA_DIR"

# The env file apply_defaults looked for and took nothing from (None: it took values, or never ran): a
# command that then fails to connect on its built-in default says so, rather than "Error 111 ... 6379".
_looked_for: Path | None = None
# The variables apply_defaults set from a running stack's env file, and that file: a URL that fails is then
# said to be the stack's, not one the user exported.
_from_file: tuple[frozenset[str], Path | None] = (frozenset(), None)


def default_data_dir() -> Path:
    return Path(os.environ.get(DATA_DIR_VAR) or DATA_DIR)


def found_by_default(data_dir: Path) -> bool:
    """Whether a command run here, in this environment, reads ``data_dir``'s env file with no help."""
    return data_dir.resolve() == default_data_dir().resolve()


def banner_env_line(data_dir: Path, env_file: Path) -> str:
    """``up``'s banner line for its env file: who reads it without help, and the exact line for the others.
    Only commands whose data directory resolves to this one find it (KVPF_DATA_DIR, else ./.data), so with
    ``--data-dir`` elsewhere they need the export line; claiming they read it would send them to 6379."""
    export = f"export {DATA_DIR_VAR}={shlex.quote(str(data_dir.resolve()))}"
    if not found_by_default(data_dir):
        return (f"{env_file}   (not the default data directory: kv-preflight commands find this stack only "
                f"after\n               {export}   (or `source {env_file}`))")
    where = f"run from {Path.cwd()}" + (f" with {DATA_DIR_VAR} as now" if os.environ.get(DATA_DIR_VAR) else "")
    return f"{env_file}   (every kv-preflight command {where} reads it; elsewhere:\n               {export})"


class DataDirInUse(Exception):
    """Another ``up`` holds the data directory's lock."""


@dataclass
class DataDirLock:
    """``<data-dir>/up.lock``, held for ``up``'s life. The kernel drops it when the process ends, however it
    ends (kill -9 too), so it never needs cleaning up; the file holds the holder's pid and predictor, to
    name it."""

    data_dir: Path
    fd: int = -1

    def acquire(self, describe: str) -> "DataDirLock":
        path = self.data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise DataDirInUse(holder) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"kv-preflight up (pid {os.getpid()}, {describe})\n".encode())
        os.set_inheritable(fd, False)  # the children must not hold it after up is gone
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def held(data_dir: Path) -> bool:
    """Whether an ``up`` holds ``data_dir``'s lock now."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def write(data_dir: Path, values: dict[str, str]) -> Path:
    """``<data-dir>/env``: one ``export NAME=value`` line each, written whole (rename), so a reader never
    sees half of it. ``source`` it in a shell, or let kv-preflight read it."""
    path = data_dir / ENV_FILE
    tmp = path.with_suffix(".tmp")
    lines = [f"# written by kv-preflight up (pid {os.getpid()}) once ready; removed when it stops",
             "# sourced in a shell, another `kv-preflight up` there would use this Valkey (KVPF_VALKEY_URL) too",
             *(f"export {k}={shlex.quote(v)}" for k, v in values.items())]
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def remove(data_dir: Path) -> None:
    with contextlib.suppress(OSError):
        (data_dir / ENV_FILE).unlink()


def read(data_dir: Path) -> dict[str, str]:
    """The values of a running stack's file; empty when there is none, or its ``up`` is gone."""
    path = data_dir / ENV_FILE
    try:
        text = path.read_text()
    except OSError:
        return {}
    if not held(data_dir):
        return {}
    out: dict[str, str] = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            out[name] = value
    return out


def apply_defaults(environ: dict[str, str] | None = None) -> Path | None:
    """The running stack's values as environment defaults (a variable set and non-empty wins); the file's
    path when one was used."""
    global _looked_for, _from_file
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    data_dir = default_data_dir()
    values = read(data_dir)
    taken = []
    for name, value in values.items():
        if name.startswith(ENV_PREFIX) and not (environ.get(name) or "").strip():
            environ[name] = value
            taken.append(name)
    _looked_for = None if taken else data_dir / ENV_FILE
    _from_file = (frozenset(taken), data_dir / ENV_FILE if taken else None)
    return data_dir / ENV_FILE if taken else None


def no_stack_hint(param: str) -> str:
    """Where the address behind a failed connection came from, and the fix: appended to a command's
    connection or URL error. The built-in default (no running ``up`` stack's env file found, no flag, no
    variable): which file was looked for and how to point at a stack. A ``KVPF_...`` variable: its name
    (a URL that came from the environment read as if the command had invented it), or the running
    stack's env file that set it. Empty for a flag: the user typed that URL."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return ""
    opt = next((p for p in ctx.command.params if p.name == param), None)
    flag = opt.opts[0] if opt is not None else "the URL"
    source = ctx.get_parameter_source(param)
    if source is ParameterSource.ENVIRONMENT and isinstance(opt, click.Option):
        names = opt.envvar if isinstance(opt.envvar, (list, tuple)) else [opt.envvar] if opt.envvar else []
        name = next((n for n in names if (os.environ.get(n) or "").strip()), None)
        if name is None:
            return ""
        taken, env_file = _from_file
        if name in taken and env_file is not None:
            return (f" -- from {name}, as the running `kv-preflight up` stack's env file {env_file.resolve()} sets "
                    f"it; is that stack still up? give {flag} to use another")
        return f" -- from the environment variable {name}; correct or unset it, or give {flag}"
    if _looked_for is None or source is not ParameterSource.DEFAULT:
        return ""
    path = _looked_for.resolve()
    how = f"{DATA_DIR_VAR}" if os.environ.get(DATA_DIR_VAR) else f"./{DATA_DIR}, as {DATA_DIR_VAR} is unset"
    state = "is left by an `up` that has stopped" if path.exists() else "does not exist"
    return (f" -- the built-in default, as no running `kv-preflight up` stack was found: {path} ({how}) "
            f"{state}. Start one with scripts/up, or point at one: `export {DATA_DIR_VAR}=<its --data-dir>` "
            f"(or `source <its data dir>/env`), or give {flag}")


@dataclass(frozen=True)
class FleetEngine:
    engine_url: str
    models: tuple[str, ...]
    pod: str = ""


def fleet_engines(*, predictor_url: str | None = None, valkey_url: str | None = None,
                  timeout_s: float = 10.0) -> list[FleetEngine]:
    """The live pods' engines and models, as the fleet records say: asked of the predictor (``GET /stats``,
    its view of the records) when its URL is known, else read from Valkey. [] when neither answers."""
    import httpx

    if predictor_url:
        try:
            pods = httpx.get(predictor_url.rstrip("/") + "/stats", params={"pods_limit": 0},
                             timeout=timeout_s).json()["fleet"]["pods"]
            return [FleetEngine(r["engine_url"], tuple(r.get("models") or ()), p) for p, r in sorted(pods.items())
                    if r.get("state") == "live" and r.get("engine_url")]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            if not valkey_url:
                return []
    if not valkey_url:
        return []
    import asyncio

    async def read() -> list[FleetEngine]:
        view = await fleet_view_at(valkey_url, timeout_s)
        return [FleetEngine(r.engine_url, tuple(r.models), p) for p, r in sorted(view.pods.items())
                if r.state == "live" and r.engine_url]

    try:
        return asyncio.run(asyncio.wait_for(read(), timeout_s))
    except Exception:  # noqa: BLE001 - Valkey down or not ours: the caller says what to give instead
        return []


async def fleet_view_at(valkey_url: str, timeout_s: float = 1.0) -> FleetView:
    """The fleet records read once from ``valkey_url``, the index opened for it and closed: how the stack's
    commands see its engines."""
    from kv_preflight.index.index import Index

    async with Index.from_url(valkey_url, timeout_s=timeout_s) as ix:
        return await ix.fleet.fleet_view()


def engine_and_model(model: str | None, engine_url: str | None, *, need_engine: bool,
                     predictor_url: str | None = None, valkey_url: str | None = None) -> tuple[str, str | None]:
    """The model (and, ``need_engine``, an engine serving it) a command was given, else the running stack's
    (``KVPF_MODEL``, ``KVPF_STACK_ENGINES`` from its env file), else the fleet records' (a live pod serving
    the model; the model itself when the fleet serves exactly one). ``click.UsageError`` naming the flag
    when none says."""
    if model and (engine_url or not need_engine):
        return model, engine_url
    if need_engine and not engine_url and model and (os.environ.get(MODEL) or "") == model:
        engine_url = next((u.strip() for u in (os.environ.get(STACK_ENGINES) or "").split(",") if u.strip()), None)
        if engine_url:
            return model, engine_url
    fleet = fleet_engines(predictor_url=predictor_url, valkey_url=valkey_url)
    if not model:
        models = sorted({m for e in fleet for m in e.models})
        if len(models) != 1:
            raise click.UsageError("give --model: " + (
                f"the fleet serves {len(models)} models ({', '.join(models[:10])})" if models else
                "no running `kv-preflight up` stack was found and no fleet record names a live engine's model"))
        model = models[0]
    if need_engine and not engine_url:
        engine_url = next((e.engine_url for e in fleet if model in e.models), None)
        if engine_url is None:
            raise click.UsageError(f"give --engine-url: no running `kv-preflight up` stack was found and no live "
                                   f"pod's fleet record names an engine serving {model!r}")
    return model, engine_url
