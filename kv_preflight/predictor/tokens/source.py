"""Per model, where prompt and messages get their tokens: the local tokenizer, or the engine.

A model given ``--tokenizer MODEL=DIR`` is tokenized in-process, but only while the
local tokenizer is known not to disagree with the engine: at start-up (and, if the
engine cannot be asked yet, every ``RECHECK_S`` until it can) the samples of
``kv_preflight.predictor.tokens.parity`` go through both. A model whose check fails falls back to
the engine's ``/tokenize``, and ``/stats`` says which source each model uses and why.
Without an engine URL the local tokenizer is used unchecked (the operator's call).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_preflight.predictor.errors import BadRequest, clip
from kv_preflight.predictor.tokens.local import LocalTokenizer, TemplateError
from kv_preflight.predictor.tokens.engine import EngineTokenizer
from kv_preflight.predictor.tokens.parity import builtin_samples, check_parity

log = logging.getLogger("kvpf.predictor")

RECHECK_S = 10.0
# Above this many characters, tokenizing moves off the event loop so other requests keep flowing.
INLINE_CHARS = 16_384

LOCAL, ENGINE = "local", "engine"


@dataclass
class ModelTokenization:
    model: str
    local: LocalTokenizer | None
    source: str  # LOCAL or ENGINE
    check: str  # passed | failed | pending | unchecked | disabled
    detail: str = ""
    causes: tuple[str, ...] = ()  # kinds of the check's divergences (predictor/explain/rules.py), for warnings

    def as_dict(self) -> dict[str, Any]:
        out = {"source": self.source, "check": self.check, "detail": self.detail}
        if self.local is not None:
            out["tokenizer_dir"] = self.local.directory
        return out


class Tokenization:
    def __init__(self, engine: EngineTokenizer, locals_: Mapping[str, LocalTokenizer], *, check: bool = True):
        self.engine = engine
        self.models: dict[str, ModelTokenization] = {}
        for model, tok in locals_.items():
            if not engine.has_engine(model):
                self.models[model] = ModelTokenization(model, tok, LOCAL, "unchecked",
                                                       "no --engine-url for this model to compare with")
            elif not check:
                self.models[model] = ModelTokenization(model, tok, LOCAL, "disabled", "--no-tokenizer-check")
            else:
                self.models[model] = ModelTokenization(model, tok, LOCAL, "pending", "check not run yet")

    @classmethod
    def load(cls, engine: EngineTokenizer, dirs: Mapping[str, str], *, check: bool = True) -> "Tokenization":
        return cls(engine, {m: LocalTokenizer.load(d, name=m) for m, d in dirs.items()}, check=check)

    def can_tokenize(self, model: str) -> bool:
        return model in self.models or self.engine.has_engine(model)

    def source(self, model: str) -> str:
        m = self.models.get(model)
        return m.source if m is not None else ENGINE

    async def tokenize(self, model: str, *, prompt: str | None = None,
                       messages: list[Any] | None = None) -> tuple[list[int], str]:
        """Tokens and the source that produced them."""
        m = self.models.get(model)
        if m is None or m.source != LOCAL or m.local is None:
            return await self.engine.tokenize(model, prompt=prompt, messages=messages), ENGINE
        size = len(prompt) if prompt is not None else sum(len(str(x.get("content", ""))) for x in messages or [])
        try:
            if size <= INLINE_CHARS:
                return m.local.encode(prompt=prompt, messages=messages), LOCAL
            return await asyncio.to_thread(m.local.encode, prompt=prompt, messages=messages), LOCAL
        except TemplateError as exc:
            raise BadRequest(clip(str(exc))) from None

    async def run_checks(self) -> None:
        """Check every pending model once; an engine that cannot be asked leaves it pending."""
        for m in self.models.values():
            if m.check != "pending" or m.local is None:
                continue
            report = await check_parity(m.local, self.engine, m.model, builtin_samples(m.local))
            if report.error:
                m.detail = f"engine not reachable yet, using the local tokenizer meanwhile: {report.error}"
                log.warning("tokenizer check for %s postponed: %s", m.model, report.error)
            elif report.ok:
                m.check, m.detail = "passed", report.summary()
                log.info("tokenizer check for %s passed: %s; tokenizing locally", m.model, report.summary())
            else:
                m.check, m.source, m.detail = "failed", ENGINE, report.summary()
                m.causes = tuple(report.causes())
                log.warning("tokenizer check for %s failed, falling back to the engine's /tokenize: %s",
                            m.model, report.summary())

    def pending(self) -> bool:
        return any(m.check == "pending" for m in self.models.values())

    async def keep_checking(self) -> None:
        """Until no model is pending (engines that were down at start-up), retry every RECHECK_S."""
        while self.pending():
            await asyncio.sleep(RECHECK_S)
            await self.run_checks()

    def status(self) -> dict[str, Any]:
        out = {m: t.as_dict() for m, t in sorted(self.models.items())}
        for model in sorted(self.engine.engine_urls):
            out.setdefault(model, {"source": ENGINE, "check": "none", "detail": "no local tokenizer configured"})
        return out
