"""What ``serve`` and ``gateway`` check before they start, at the command line rather than in every worker: the
files their options name, the settings given explicitly against the index's, and a bad setting's message."""
from __future__ import annotations

import click

from kv_preflight.config import Config


def run_checked(cfg: Config, run, workers: int) -> None:
    """``run(cfg, workers=...)`` once the hash seed, block size and entry format given explicitly are found to
    match the index's (predictor/settings.py); a mismatch is a one-line error (serve, gateway)."""
    import asyncio

    from kv_preflight.predictor.settings import SettingsMismatch, check_settings

    try:
        asyncio.run(check_settings(cfg))
    except SettingsMismatch as exc:
        raise click.ClickException(str(exc)) from None
    run(cfg, workers=workers)


def config_error(exc: ValueError) -> str:
    """A bad setting's message; a bad Valkey URL also says where it came from (flag, KVPF_VALKEY_URL, the
    running stack's env file)."""
    from kv_preflight.cli.stack_file import no_stack_hint

    return f"{exc}{no_stack_hint('valkey_url') if str(exc).startswith('valkey_url') else ''}"


def check_serve_files(cfg: Config) -> None:
    """Fail at the command line, not in every worker: tokenizer dirs, TTFT model, API keys."""
    from kv_preflight.predictor.http.auth import load_api_keys
    from kv_preflight.predictor.tokens.local import LocalTokenizer
    from kv_preflight.predictor.scoring.ttft import TtftModels

    for model, directory in cfg.tokenizers.items():
        LocalTokenizer.load(directory, name=model)
    TtftModels.load(cfg.ttft_model)
    load_api_keys(cfg.api_keys_file, cfg.api_keys)
    if cfg.register_allow:
        from kv_preflight.predictor.dynamo.wire import parse_allow

        parse_allow(cfg.register_allow)
