"""The prediction path, from a validated request to a Prediction, with its I/O bounded.

Per request: tokens (given, or from the engine), request keys (C, in-process), one
Valkey round trip for every pod's consecutive prefix, pod metadata from a ~1 s
cache, then pure scoring. Every Valkey call runs under a deadline, and any Valkey
failure becomes IndexUnavailable (503) rather than a hang or a 500.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from predictor.errors import BadRequest, IndexUnavailable, UnknownModel
from predictor.metadata import IndexMetadata
from predictor.request import KeyedRequest, PredictRequest, check_token_count
from predictor.score import Prediction, score
from predictor.stats import ProcessCounters, build_stats
from predictor.tokenize import EngineTokenizer
from shared.config import Config
from shared.index import Index
from shared.keys import request_keys


@asynccontextmanager
async def valkey_call(timeout_s: float, what: str) -> AsyncIterator[None]:
    """Bound a Valkey step and turn any of its failures into IndexUnavailable."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise IndexUnavailable(f"valkey did not answer {what} within {timeout_s}s") from None
    except (RedisError, OSError) as exc:
        raise IndexUnavailable(f"valkey unavailable ({what}): {type(exc).__name__}: {exc}") from None


@dataclass
class Predictor:
    cfg: Config
    index: Index
    tokenizer: EngineTokenizer
    metadata: IndexMetadata
    counters: ProcessCounters
    owns_index: bool = True

    @classmethod
    def create(cls, cfg: Config, index: Index | None = None) -> "Predictor":
        owns = index is None
        if index is None:
            index = Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format)
        return cls(
            cfg=cfg, index=index, tokenizer=EngineTokenizer(cfg.engine_urls, cfg.engine_timeout_s),
            metadata=IndexMetadata(index), counters=ProcessCounters(), owns_index=owns,
        )

    @property
    def valkey_deadline_s(self) -> float:
        # socket timeouts bound each read; this bounds the whole step (connect + script + reply)
        return 2 * self.cfg.valkey_timeout_s

    async def predict(self, req: PredictRequest) -> Prediction:
        model = req.model
        assert model  # parse_request guarantees it
        if req.token_ids is not None:
            await self._check_model(model, need_engine=False)
            tokens = req.token_ids
        else:
            await self._check_model(model, need_engine=True)
            tokens = await self.tokenizer.tokenize(model, prompt=req.prompt, messages=req.messages)
            if not tokens:
                raise BadRequest("the engine tokenized the input to no tokens")
            check_token_count(len(tokens), self.cfg.max_tokens)
        try:
            keys = request_keys(tokens, model=model, hash_seed=self.cfg.hash_seed, block_size=self.cfg.block_size)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return await self._predict_keys(model, keys, len(tokens), req.pods)

    async def predict_keyed(self, req: KeyedRequest) -> Prediction:
        """A token_ids request whose keys the request parser already computed (the fast path)."""
        await self._check_model(req.model, need_engine=False)
        return await self._predict_keys(req.model, req.keys, req.n_tokens, req.pods)

    async def _predict_keys(self, model: str, keys: list[int], prompt_len: int, pods: list[str] | None) -> Prediction:
        matches: list[Any] = []
        engine_blocks: dict[str, int | None] = {}
        incomplete: set[str] = set()
        # An empty pods filter means no candidate pod, hence nothing cached (not "every pod").
        if keys and (pods is None or pods):
            async with valkey_call(self.valkey_deadline_s, "prefix lookup"):
                matches = await self.index.lookup(keys, pods, mode=self.cfg.lookup)
                infos = await self.metadata.pod_infos(m.pod_id for m in matches)
            engine_blocks = {p: i.engine_block_size for p, i in infos.items()}
            incomplete = {p for p, i in infos.items() if i.incomplete}
        return score(
            matches, prompt_len=prompt_len, canonical_block=self.cfg.block_size,
            engine_blocks=engine_blocks, incomplete=incomplete, pods=pods,
        )

    async def _check_model(self, model: str, *, need_engine: bool) -> None:
        """Known = has an engine URL, or pods in the index serve it; prompts also need the engine."""
        if self.tokenizer.has_engine(model):
            return
        async with valkey_call(self.valkey_deadline_s, "model check"):
            known = model in await self.metadata.known_models(model)
        if not known:
            configured = ", ".join(sorted(self.tokenizer.engine_urls)) or "none"
            raise UnknownModel(
                f"unknown model {model!r}: no --engine-url for it (configured: {configured}) "
                "and no pod in the index serves it"
            )
        if need_engine:
            raise BadRequest(
                f"cannot tokenize for model {model!r}: no --engine-url configured for it; send token_ids instead"
            )

    async def healthy(self) -> tuple[bool, str]:
        try:
            async with valkey_call(self.valkey_deadline_s, "PING"):
                await self.index.ping()
        except IndexUnavailable as exc:
            return False, exc.message
        return True, ""

    async def stats(self) -> dict[str, Any]:
        async with valkey_call(self.valkey_deadline_s * 4, "stats"):
            key_count = await self.index.key_count()
            pods = await self.index.pods()
            index_counters = await self.index.counters()
        return build_stats(
            key_count=key_count, pods=pods, index_counters=index_counters, process=self.counters, now=time.time(),
        )

    async def aclose(self) -> None:
        await self.tokenizer.aclose()
        if self.owns_index:
            await self.index.close()
