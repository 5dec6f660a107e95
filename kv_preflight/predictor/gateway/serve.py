"""Run the gateway under uvicorn, in one process or ``--workers`` sharing the port, as ``serve`` runs the predictor
(kv_preflight/predictor/serve.py: the Config travels to workers as JSON, metrics are summed across them).

uvicorn's own ``server`` and ``date`` headers are off: the engine's answer carries its own, passed on as sent.
"""
from __future__ import annotations

from starlette.applications import Starlette

from kv_preflight.config import Config
from kv_preflight.logs import setup_logging
from kv_preflight.predictor import serve as predictor_serve
from kv_preflight.predictor.gateway.app import create_gateway_app

APP_FACTORY = "kv_preflight.predictor.gateway.serve:app_from_env"


def app_from_env() -> Starlette:
    """uvicorn factory for worker processes."""
    return predictor_serve.app_from_env(create_gateway_app)


def serve(cfg: Config, workers: int = 1) -> None:
    setup_logging(cfg.log_json)
    options = predictor_serve.uvicorn_options(cfg, workers) | {"server_header": False, "date_header": False}
    predictor_serve.run(cfg, workers, options, create_gateway_app, APP_FACTORY)
