"""Compare local tokenization with the engine's ``/tokenize``, sample by sample, and say where they part.

A local tokenizer is only useful if it is the engine's, token for token (one differing
token changes every following request key), so both ``kv-preflight tokenizer check``
and the predictor's start-up check run the same samples through both and report the
first divergent position with both tokens decoded, plus a guess at the usual causes:
a duplicate or missing BOS, trailing whitespace merged differently, template drift.
The comparison and the diagnosis are pure; only ``check_parity`` does I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kv_preflight.predictor.errors import EngineRejected, EngineUnavailable
from kv_preflight.predictor.explain.rules import Cause, classify, first_divergence
from kv_preflight.predictor.tokens.local import LocalTokenizer, TemplateError
from kv_preflight.jsonl import read_json_lines


@dataclass(frozen=True)
class Sample:
    name: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None

    @property
    def kind(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    @property
    def text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "".join(str(m.get("content", "")) for m in self.messages or [])


def builtin_samples(local: LocalTokenizer | None = None) -> list[Sample]:
    """Inputs chosen to expose the usual drifts; special-token text comes from the tokenizer when known."""
    bos = local.special_tokens.get("bos_token", "<s>") if local else "<s>"
    eos = local.special_tokens.get("eos_token", "</s>") if local else "</s>"
    system = "You are a careful assistant. Answer briefly and cite sources. " * 3
    samples = [
        Sample("plain", prompt="The quick brown fox jumps over the lazy dog."),
        Sample("whitespace", prompt="   leading spaces, trailing spaces and blank lines   \n\n"),
        Sample("bos-in-text", prompt=f"{bos}Hello, the prompt already starts with the BOS text."),
        Sample("special-in-text", prompt=f"before {eos} after"),
        Sample("unicode", prompt="naïve café, Ωmega ≈ 3.14, 日本語のテキスト, emoji 🎉🚀, \u00a0nbsp"),
        Sample("code", prompt="def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))\r\n"),
        Sample("numbers", prompt="3.14159 1,000,000 2024-01-31T12:00:00Z 0x1F -42 1e-9"),
        Sample("long", prompt="lorem ipsum dolor sit amet, consectetur adipiscing elit " * 30),
        Sample("chat-user", messages=[{"role": "user", "content": "Hello"}]),
        Sample("chat-system", messages=[{"role": "system", "content": system},
                                        {"role": "user", "content": "What is a prefix cache?"}]),
        Sample("chat-multi-turn", messages=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Summarize: the cat sat on the mat."}]),
        Sample("chat-parts", messages=[{"role": "user", "content": [
            {"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}]),
        Sample("chat-whitespace", messages=[{"role": "user", "content": "  spaced out  \n\n"}]),
        Sample("chat-unicode", messages=[{"role": "user", "content": "Übersetze: 東京 🎌 — «quotes»"}]),
    ]
    return samples


def load_samples(path: Path) -> list[Sample]:
    """JSON lines, each ``{"prompt": ...}`` or ``{"messages": [...]}``, optionally with a ``name``."""
    out = []
    for n, obj in read_json_lines(path):
        if not isinstance(obj, dict) or ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f"{path}:{n}: needs exactly one of prompt, messages")
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise ValueError(f"{path}:{n}: prompt must be a string")
        if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"]):
            raise ValueError(f"{path}:{n}: messages must be a non-empty list")
        out.append(Sample(str(obj.get("name") or f"{path.name}:{n}"), prompt=obj.get("prompt"),
                          messages=obj.get("messages")))
    return out


# ---------------------------------------------------------------- pure comparison


def diagnose(local: Sequence[int], engine: Sequence[int], position: int, sample: Sample, bos_id: int | None) -> str:
    """A best guess at why, from the shape of the difference; the decoded tokens say the rest."""
    return cause_of(local, engine, position, sample, bos_id).detail


def cause_of(local: Sequence[int], engine: Sequence[int], position: int, sample: Sample, bos_id: int | None) -> Cause:
    """predictor/explain/rules.py's classifier, told both sides come from one input (so no content change, no window)."""
    return classify(local, engine, position, bos_id=bos_id, labels=("local", "engine"), same_input=True,
                    chat=sample.messages is not None, ours_text=sample.text, theirs_text=sample.text)


@dataclass
class SampleResult:
    sample: Sample
    local: list[int] | None
    engine: list[int] | None
    position: int | None = None  # first divergent index; None when equal
    local_token: str | None = None
    engine_token: str | None = None
    hint: str = ""
    cause: str = ""  # the hint's kind (predictor/explain/findings.py FINDING_KINDS)
    error: str = ""  # one side refused the input and the other did not

    @property
    def ok(self) -> bool:
        return self.position is None and not self.error

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sample": self.sample.name, "kind": self.sample.kind, "ok": self.ok,
                               "local_tokens": None if self.local is None else len(self.local),
                               "engine_tokens": None if self.engine is None else len(self.engine)}
        if self.position is not None:
            out.update(position=self.position, local_token=self.local_token, engine_token=self.engine_token,
                       hint=self.hint, cause=self.cause)
        if self.error:
            out["error"] = self.error
        return out


def compare(local_tok: LocalTokenizer, sample: Sample, local: list[int] | None, engine: list[int] | None,
            local_error: str = "", engine_error: str = "") -> SampleResult:
    if local_error or engine_error:
        if local_error and engine_error:  # both refuse the same input: they agree
            return SampleResult(sample, None, None)
        return SampleResult(sample, local, engine, error=f"local: {local_error or 'accepted'}; "
                                                         f"engine: {engine_error or 'accepted'}")
    assert local is not None and engine is not None
    pos = first_divergence(local, engine)
    if pos is None:
        return SampleResult(sample, local, engine)

    def show(tokens: list[int]) -> str:
        if pos >= len(tokens):
            return "(end)"
        return f"{tokens[pos]} {local_tok.token_text(tokens[pos])!r}"

    bos = local_tok.special_tokens.get("bos_token")
    bos_id = local_tok.tokenizer.token_to_id(bos) if bos else None
    cause = cause_of(local, engine, pos, sample, bos_id)
    return SampleResult(sample, local, engine, pos, show(local), show(engine), cause.detail, cause.kind)


@dataclass
class ParityReport:
    model: str
    results: list[SampleResult] = field(default_factory=list)
    error: str = ""  # the engine could not be asked at all

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.results) and all(r.ok for r in self.results)

    @property
    def failures(self) -> list[SampleResult]:
        return [r for r in self.results if not r.ok]

    def causes(self) -> list[str]:
        """The distinct causes of the divergent samples, first seen first."""
        return list(dict.fromkeys(r.cause for r in self.failures if r.cause))

    def summary(self) -> str:
        if self.error:
            return f"not checked: {self.error}"
        bad = self.failures
        if not bad:
            return f"{len(self.results)}/{len(self.results)} samples identical"
        first = bad[0]
        where = (f"first divergence in {first.sample.name!r} at token {first.position}: local {first.local_token}, "
                 f"engine {first.engine_token} ({first.hint})") if first.position is not None else \
            f"{first.sample.name!r}: {first.error}"
        return f"{len(self.results) - len(bad)}/{len(self.results)} samples identical; {where}"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "ok": self.ok, "summary": self.summary(), "error": self.error or None,
                "samples": [r.as_dict() for r in self.results]}


# ---------------------------------------------------------------- I/O


class EngineTokenize(Protocol):
    async def tokenize(self, model: str, *, prompt: str | None = None,
                       messages: list[Any] | None = None) -> list[int]: ...


async def check_parity(local: LocalTokenizer, engine: EngineTokenize, model: str,
                       samples: Sequence[Sample]) -> ParityReport:
    """Every sample through both; an unreachable engine ends the check with ``error`` set."""
    report = ParityReport(model)
    for sample in samples:
        local_ids: list[int] | None = None
        engine_ids: list[int] | None = None
        local_err = engine_err = ""
        try:
            local_ids = local.encode(prompt=sample.prompt, messages=sample.messages)
        except TemplateError as exc:
            local_err = str(exc)
        try:
            engine_ids = await engine.tokenize(model, prompt=sample.prompt, messages=sample.messages)
        except EngineRejected as exc:
            engine_err = exc.message
        except EngineUnavailable as exc:
            report.error = exc.message
            return report
        report.results.append(compare(local, sample, local_ids, engine_ids, local_err, engine_err))
    return report
