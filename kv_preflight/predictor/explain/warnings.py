"""The ``warnings`` every predict and route answer carries: cache-breaking problems known without a lookup.

Two sources, both cheap enough for the hot path (a dict hit and a look at two token ids, measured
in docs/benchmarks.md): BOS problems visible in the first tokens (a doubled BOS, or none where the
model's tokenizer always adds one), and template drift the start-up tokenizer check found (or a chat
template that renders the current date, so yesterday's cached chats miss today). What a model's BOS is
comes from its local tokenizer (``--tokenizer``), or from ``POST /v1/cache/explain``, which asks the
engine once; a model nothing is known of gets no BOS warning. The rules are predictor/explain/rules.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from kv_preflight.predictor.explain.rules import bos_findings
from kv_preflight.predictor.explain.findings import TEMPLATE_DRIFT, Finding
from kv_preflight.predictor.tokens.local import LocalTokenizer
from kv_preflight.predictor.request import KeyedRequest
from kv_preflight.predictor.tokens.source import Tokenization

# strftime_now is the Hugging Face template global for "today"; Llama 3.x templates render date_string.
_DATED_TEMPLATE = re.compile(r"strftime_now|date_string|current_date")


@dataclass(frozen=True)
class ModelHints:
    bos_id: int | None
    adds_bos: bool  # the tokenizer starts every prompt with BOS
    template: tuple[Finding, ...] = ()  # what is wrong with the chat template itself


def hints_from_local(local: LocalTokenizer) -> ModelHints:
    bos = local.special_tokens.get("bos_token")
    bos_id = local.tokenizer.token_to_id(bos) if bos else None
    adds = bos_id is not None and local.encode_prompt("a")[:1] == [bos_id]
    template: tuple[Finding, ...] = ()
    if local.template_source and _DATED_TEMPLATE.search(local.template_source):
        template = (Finding(TEMPLATE_DRIFT, None, "the chat template renders the current date: the same messages "
                                                  "are other tokens from one day to the next, so cached chats miss "
                                                  "after midnight"),)
    return ModelHints(bos_id, adds, template)


def hints_from_probe(a: list[int], b: list[int]) -> ModelHints:
    """From the engine's tokens of two one-character prompts: a shared first token of a two-token answer is BOS."""
    if len(a) == 2 and len(b) == 2 and a[0] == b[0] and a[1] != b[1]:
        return ModelHints(a[0], True)
    return ModelHints(None, False)


@dataclass
class PromptWarnings:
    tokenization: Tokenization
    hints: dict[str, ModelHints] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for model, m in self.tokenization.models.items():
            if m.local is not None:
                self.hints[model] = hints_from_local(m.local)

    def check_keyed(self, req: KeyedRequest) -> list[Finding]:
        """The fast path's check: the first ids are read from the raw JSON only for a model with hints
        (every model with a local tokenizer has them), so other models pay two dict misses."""
        if req.model not in self.hints:
            return []
        return self.check(req.model, req.head)

    def check(self, model: str, head: tuple[int, ...] | list[int], *, chat: bool = True) -> list[Finding]:
        """Warnings for a request of ``model`` whose tokens start with ``head`` (two ids are enough)."""
        h = self.hints.get(model)
        out = bos_findings(head, h.bos_id, h.adds_bos) if h is not None else []
        if chat:
            m = self.tokenization.models.get(model)
            if m is not None and TEMPLATE_DRIFT in m.causes:
                out.append(Finding(TEMPLATE_DRIFT, None, "the start-up check found this model's local chat "
                                                         f"template rendering differently from the engine's "
                                                         f"({m.detail}); token ids made with it miss"))
            if h is not None and h.template:
                out.extend(h.template)
        return out
