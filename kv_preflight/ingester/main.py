"""``kv-preflight ingest`` entry point."""
from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError
from zmq.error import ZMQError

from kv_preflight.config import Config
from kv_preflight.logs import setup_logging


def run(cfg: Config) -> int:
    setup_logging(cfg.log_json)
    from kv_preflight.collector import tuned_collector
    from kv_preflight.ingester.ingester import run_ingester

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        with tuned_collector():
            asyncio.run(run_ingester(cfg))
    except KeyboardInterrupt:
        pass
    except (ValueError, RuntimeError, OSError, ZMQError, RedisError) as exc:
        # what the operator can fix (a flag, an endpoint, the index's settings or layout, an unreachable
        # server): one line that says it
        logging.getLogger("kvpf.ingester").error("ingester failed: %s", exc)
        return 1
    except Exception as exc:
        # anything else is a bug: its traceback is what a report needs
        logging.getLogger("kvpf.ingester").error("ingester failed: %s", exc, exc_info=True)
        return 1
    return 0
