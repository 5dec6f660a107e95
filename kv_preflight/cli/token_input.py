"""The ``--tokens`` value of ``keys`` and ``index inspect``: a JSON list of token ids, or ``@file`` holding one."""
from __future__ import annotations

import json
from pathlib import Path

import click


def read_tokens(spec: str) -> list[int]:
    """A JSON list, or ``@file`` holding one."""
    try:
        text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    except OSError as exc:
        raise click.BadParameter(f"--tokens {spec}: cannot read {exc.filename or spec[1:]}: {exc.strerror}") from None
    try:
        tokens = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"--tokens is not JSON: {exc}") from None
    if not isinstance(tokens, list):
        raise click.BadParameter("--tokens must be a JSON list of token ids")
    return tokens
