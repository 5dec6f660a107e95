"""``kv-preflight simulate``: a fake vLLM engine whose prefix cache and KV events behave like vLLM 0.32's.

Everything is built here and handed down, so no module holds global state:
config -> PrefixCache + EventPublisher -> EngineRunner -> HTTP app -> uvicorn.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from kv_preflight.simulator.app import SimulatorApp
from kv_preflight.simulator.cache import PrefixCache
from kv_preflight.simulator.config import SimulatorConfig
from kv_preflight.simulator.hybrid_cache import HybridPrefixCache
from kv_preflight.simulator.publisher import EventPublisher
from kv_preflight.simulator.runner import EngineRunner
from kv_preflight.simulator.tokenizer import OUTPUT_ALPHABET

log = logging.getLogger("kv_preflight.simulator")


def build_app(cfg: SimulatorConfig, *, open_sockets: bool = False) -> Starlette:
    """The ASGI app; its lifespan starts the ZMQ publishers (one per data-parallel rank; opening the sockets now
    if asked) and closes them."""
    cfg.validate()
    groups = cfg.kv_cache_groups
    runners = []
    for rank in range(cfg.dp_size):
        publisher = EventPublisher(cfg.rank_endpoint(cfg.zmq_endpoint, rank) or cfg.zmq_endpoint,
                                   cfg.rank_endpoint(cfg.replay_endpoint, rank), cfg.topic,
                                   buffer_steps=cfg.buffer_steps, data_parallel_rank=rank,
                                   # a wildcard endpoint binds on --host: `up`'s engines listen on loopback like
                                   # the rest of its stack
                                   bind_host=cfg.host)
        cache = (PrefixCache(cfg.num_blocks, cfg.block_size) if groups is None
                 else HybridPrefixCache(cfg.num_blocks, cfg.block_size, groups))
        runners.append(EngineRunner(cache, publisher, OUTPUT_ALPHABET, step_delay_s=cfg.step_delay_s))
    if open_sockets:
        opened = []
        try:
            for runner in runners:
                runner.publisher.open()
                opened.append(runner.publisher)
        except OSError:
            for publisher in opened:
                publisher._close_sockets()
            raise

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for runner in runners:
            runner.publisher.start()
        log.info("simulating %s: http://%s:%d events %s replay %s topic %s, %d blocks of %d tokens%s%s",
                 cfg.pod, cfg.host, cfg.port, cfg.zmq_endpoint, cfg.replay_endpoint, cfg.topic,
                 cfg.num_blocks, cfg.block_size,
                 "" if groups is None else f", hybrid: sliding window {cfg.sliding_window} + full attention",
                 "" if cfg.dp_size == 1 else f", {cfg.dp_size} data-parallel ranks (ports + rank)")
        try:
            yield
        finally:
            for runner in runners:
                await runner.publisher.close()

    return SimulatorApp(cfg, runners).starlette(lifespan=lifespan)


def run(cfg: SimulatorConfig | None = None, **fields: Any) -> None:
    """Serve until interrupted. Pass a config, or its fields (``run(pod="sim-0", model="tiny", ...)``)."""
    cfg = cfg if cfg is not None else SimulatorConfig(**fields)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_app(cfg, open_sockets=True)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kv-preflight simulate: {exc}") from None
    # The plain asyncio loop: pyzmq's asyncio sockets rely on add_reader, which it guarantees.
    uvicorn.run(app, host=cfg.host, port=cfg.port, loop="asyncio", log_level="warning", lifespan="on")
