"""Run the predictor under uvicorn, in one process or several sharing the port.

With ``workers > 1`` uvicorn starts fresh processes that import the app by name,
so the Config travels to them as JSON in an environment variable and
``app_from_env`` rebuilds the app there; each worker gets its own Valkey and
engine clients and caches. uvloop and httptools are used when importable, each HTTP
protocol with a deadline on request headers (predictor/http/protocols.py).
Their Prometheus metrics are summed across workers through a fresh multiprocess
directory (kv_preflight/metrics.py), so any scrape sees the whole server.
"""
from __future__ import annotations

import importlib.util
import inspect
import os
from collections.abc import Callable

import msgspec
import uvicorn
from starlette.applications import Starlette

from kv_preflight.predictor.http.app import create_app
from kv_preflight.predictor.http.protocols import connection_cap, protocol_factory
from kv_preflight import parent_death
from kv_preflight.config import Config
from kv_preflight.logs import setup_logging
from kv_preflight.metrics import remove_multiprocess_dir, use_multiprocess_dir

CONFIG_ENV = "KVPF_SERVE_CONFIG_JSON"
APP_FACTORY = "kv_preflight.predictor.serve:app_from_env"


def encode_config(cfg: Config) -> str:
    return msgspec.json.encode(cfg).decode()


def decode_config(raw: str) -> Config:
    cfg = msgspec.json.decode(raw, type=Config)
    cfg.validate()
    return cfg


def app_from_env(create: Callable[[Config], Starlette] = create_app) -> Starlette:
    """uvicorn factory for worker processes: the parent's exact Config, else the ``KVPF_*`` env (``create``: the
    app to build from it, the gateway's for ``kv-preflight gateway``)."""
    import multiprocessing

    supervisor = multiprocessing.parent_process()
    if supervisor is not None:  # a worker ends with `serve`, even one killed by SIGKILL (kv_preflight/parent_death.py)
        parent_death.end_with_parent(supervisor.pid)
    raw = os.environ.get(CONFIG_ENV)
    cfg = decode_config(raw) if raw else Config.load()
    setup_logging(cfg.log_json)  # a fresh worker process has no handlers yet
    return create(cfg)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _takes(option: str) -> bool:
    """Whether this uvicorn has ``option`` (the project allows versions from before some options)."""
    return option in inspect.signature(uvicorn.run).parameters


# How long uvicorn's supervisor waits for a worker to answer its ping before it kills and restarts it. Its default,
# 5 s, counts the worker's start-up: a spawned worker imports everything first, and on a loaded node (two cores
# shared with an engine, a container's CPU limit) that took longer, so every worker was killed while importing and
# restarted, forever, and the server never answered (compose under load: "Child process [..] died" every 6 s).
WORKER_PING_TIMEOUT_S = 60


def uvicorn_options(cfg: Config, workers: int) -> dict:
    ping = ({"timeout_worker_healthcheck": WORKER_PING_TIMEOUT_S}
            if workers > 1 and _takes("timeout_worker_healthcheck") else {})
    return ping | {
        "host": cfg.host,
        "port": cfg.port,
        "loop": "uvloop" if _has("uvloop") else "asyncio",
        "http": protocol_factory("httptools" if _has("httptools") else "h11", cfg.request_read_timeout_s,
                                 cfg.max_connections_per_client, connection_cap(cfg.max_connections)),
        "lifespan": "on",
        "access_log": False,  # per-request log lines would cost more than a prediction
        "log_level": "info",
        "log_config": None,  # keep our handlers (plain or JSON lines)
        "workers": workers if workers > 1 else None,
    }


def run_dynamo_api(raw_config: str, parent_pid: int) -> None:
    """The remote-indexer port's process (``serve --dynamo-port``, predictor/dynamo/api.py)."""
    from kv_preflight.predictor.dynamo.api import create_dynamo_app

    _exit_with_parent(parent_pid)
    cfg = decode_config(raw_config)
    setup_logging(cfg.log_json)
    options = uvicorn_options(cfg, 1) | {"port": cfg.dynamo_port}
    uvicorn.run(create_dynamo_app(cfg), **options)


def _exit_with_parent(parent_pid: int) -> None:
    """uvicorn re-raises the SIGTERM it handled once the server is down, so the parent may die before its
    ``finally`` stops this child: the child watches for that itself and leaves no process behind."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def start_dynamo_api(cfg: Config):
    """A child process for the Dynamo API, whatever ``--workers`` is: its port is independent of the
    predictor's, and a daemon child ends with this process."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=run_dynamo_api, args=(encode_config(cfg), os.getpid()),
                                                        name="kvpf-dynamo-api", daemon=True)
    proc.start()
    return proc


def serve(cfg: Config, workers: int = 1) -> None:
    setup_logging(cfg.log_json)
    options = uvicorn_options(cfg, workers)
    dynamo = start_dynamo_api(cfg) if cfg.dynamo_port else None
    try:
        run(cfg, workers, options)
    finally:
        if dynamo is not None:
            dynamo.terminate()
            dynamo.join(5)


def run(cfg: Config, workers: int, options: dict, create: Callable[[Config], Starlette] = create_app,
        factory: str = APP_FACTORY) -> None:
    """``create(cfg)`` under uvicorn; with ``workers > 1``, ``factory`` (an importable ``app_from_env``) in each."""
    if workers > 1:
        os.environ[CONFIG_ENV] = encode_config(cfg)
        metrics_dir = use_multiprocess_dir()  # before any worker imports prometheus_client
        try:
            uvicorn.run(factory, factory=True, **options)
        finally:
            remove_multiprocess_dir(metrics_dir)
    else:
        uvicorn.run(create(cfg), **options)
