"""Tokenize prompts and chat messages in-process, exactly as a vLLM engine does, from its files.

Why: an engine ``/tokenize`` round trip costs more than the whole prediction. But one
token of difference shifts every following canonical block, so every request key after
it misses: local tokenization is only worth having when it is token-for-token the
engine's. What vLLM 0.32 (with transformers 5) does, and this module repeats:

* ``prompt``: the fast tokenizer's ``encode`` with special tokens. When
  ``tokenizer_config.json`` sets ``add_bos_token``/``add_eos_token`` explicitly, the
  post-processor is rebuilt from those flags (BOS once, no matter what tokenizer.json
  said); otherwise tokenizer.json's own post-processor decides. A prompt that already
  starts with the BOS text gets a second BOS, as in the engine.
* ``messages``: the chat template rendered by a sandboxed Jinja2 environment with
  ``trim_blocks`` and ``lstrip_blocks`` (what Hugging Face templates are written for),
  ``add_generation_prompt=True``, the special tokens as variables; the rendered text is
  then encoded *without* special tokens, since templates write ``{{ bos_token }}``
  themselves. Text-part lists in ``content`` are joined with newlines unless the
  template iterates over the parts itself (vLLM's "string" vs "openai" content format).

``kv-preflight tokenizer check`` and the predictor's start-up check compare this with
the engine on real samples, and the predictor falls back to the engine when they differ.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, processors

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# A template that loops over a message's content expects OpenAI-style parts, not a string.
_ITERATES_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[['\"]content['\"]\]|\.content)\s*[-%|]")


class TokenizerLoadError(ValueError):
    """The directory lacks a usable tokenizer.json / tokenizer_config.json."""


class TemplateError(ValueError):
    """The chat template rejected the messages (``raise_exception``) or failed to render."""


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as an AddedToken-like dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Templates use tojson for tool schemas; Hugging Face's filter keeps non-ASCII as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_template_env() -> ImmutableSandboxedEnvironment:
    """The sandbox: templates come with model files and must not reach Python objects."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: Sequence[Mapping[str, Any]], *, content_as_parts: bool) -> list[dict[str, Any]]:
    """Messages as the engine hands them to the template: string content, or text parts kept as a list."""
    out = []
    for m in messages:
        msg = dict(m)
        content = msg.get("content")
        if isinstance(content, list) and not content_as_parts:
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif isinstance(content, list):
            msg["content"] = [p if isinstance(p, Mapping) else {"type": "text", "text": str(p)} for p in content]
        elif content is None and msg.get("role") == "assistant":
            msg["content"] = ""
        out.append(msg)
    return out


@dataclass
class LocalTokenizer:
    """One model's tokenizer and chat template, loaded once; ``encode_*`` are pure CPU work."""

    name: str
    directory: str
    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    special_tokens: dict[str, str]
    content_as_parts: bool = False
    template_source: str | None = None  # kept for predictor/explain/warnings.py (does it inject the date?)

    @classmethod
    def load(cls, directory: str | Path, name: str = "") -> "LocalTokenizer":
        d = Path(directory)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"{tok_file} not found (a Hugging Face fast tokenizer is needed)")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust loader raises a bare Exception
            raise TokenizerLoadError(f"{tok_file}: {exc}") from None
        config: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise TokenizerLoadError(f"{cfg_file}: {exc}") from None
        special = {n: t for n in SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n))) is not None}
        _apply_bos_eos_flags(tokenizer, config, special)
        source = _template_source(config, d)
        template = None
        if source is not None:
            try:
                template = make_template_env().from_string(source)
            except jinja2.TemplateError as exc:
                raise TokenizerLoadError(f"chat template of {d} does not compile: {exc}") from None
        return cls(
            name=name or d.name, directory=str(d), tokenizer=tokenizer, chat_template=template,
            special_tokens=special, content_as_parts=bool(source and _ITERATES_CONTENT.search(source)),
            template_source=source,
        )

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise TemplateError(f"{self.directory} has no chat template (tokenizer_config.json chat_template)")
        try:
            return self.chat_template.render(
                messages=normalize_messages(messages, content_as_parts=self.content_as_parts),
                add_generation_prompt=add_generation_prompt, tools=None, documents=None,
                **self.special_tokens,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as exc:
            raise TemplateError(f"chat template failed on these messages: {type(exc).__name__}: {exc}") from None

    def encode_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids

    def encode(self, *, prompt: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        return self.encode_messages(messages) if messages is not None else self.encode_prompt(prompt or "")

    def token_text(self, token_id: int) -> str:
        """One token for people: its decoded text, else its vocabulary string."""
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text if text else (self.tokenizer.id_to_token(token_id) or f"<id {token_id}>")


def _template_source(config: Mapping[str, Any], directory: Path) -> str | None:
    """tokenizer_config's ``chat_template`` (a string, or named templates with "default"), else chat_template.jinja."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str):
        return tpl
    jinja_file = directory / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def _apply_bos_eos_flags(tokenizer: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]) -> None:
    """Explicit ``add_bos_token``/``add_eos_token`` replace tokenizer.json's post-processor, as transformers 5 does."""
    if "add_bos_token" not in config and "add_eos_token" not in config:
        return

    def flagged(flag: str, name: str) -> tuple[str, int] | None:
        text = special.get(name)
        tid = tokenizer.token_to_id(text) if text else None
        return (text, tid) if config.get(flag) and text and tid is not None else None

    bos, eos = flagged("add_bos_token", "bos_token"), flagged("add_eos_token", "eos_token")

    def side(seq: str, type_id: int) -> list[str]:
        return ([f"{bos[0]}:{type_id}"] if bos else []) + [f"{seq}:{type_id}"] + ([f"{eos[0]}:{type_id}"] if eos else [])

    tokenizer.post_processor = processors.TemplateProcessing(
        single=side("$A", 0), pair=side("$A", 0) + side("$B", 1), special_tokens=[t for t in (bos, eos) if t],
    )
