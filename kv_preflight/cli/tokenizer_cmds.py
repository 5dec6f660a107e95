"""``kv-preflight tokenizer check``: is the local tokenizer token-for-token the engine's?"""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import click
import httpx

from kv_preflight.predictor.tokens.local import LocalTokenizer, TokenizerLoadError
from kv_preflight.predictor.tokens.engine import EngineTokenizer
from kv_preflight.predictor.tokens.parity import ParityReport, Sample, builtin_samples, check_parity, load_samples


def model_root(engine_url: str, model: str, timeout_s: float = 5.0) -> str | None:
    """The engine's local model directory from ``/v1/models`` (vLLM's ``root``), when this host can read it.
    An engine that cannot be reached raises httpx.HTTPError: that, not the directory, is the problem to report."""
    try:
        data = httpx.get(engine_url.rstrip("/") + "/v1/models", timeout=timeout_s).json().get("data", [])
    except (ValueError, AttributeError):
        return None
    for m in data:
        if isinstance(m, dict) and m.get("id") == model:
            root = m.get("root") or ""
            return root if (Path(root) / "tokenizer.json").is_file() else None
    return None


async def _check(local: LocalTokenizer, engine_url: str, model: str, samples: list[Sample],
                 timeout_s: float) -> ParityReport:
    engine = EngineTokenizer({model: engine_url.rstrip("/")}, timeout_s)
    try:
        return await check_parity(local, engine, model, samples)
    finally:
        await engine.aclose()


def print_report(report: ParityReport) -> None:
    for r in report.results:
        if r.ok:
            click.echo(f"  ok        {r.sample.name:<24} {len(r.local or [])} tokens")
        elif r.error:
            click.echo(f"  DIFFERENT {r.sample.name:<24} {r.error}")
        else:
            click.echo(f"  DIFFERENT {r.sample.name:<24} at token {r.position} "
                       f"(local {len(r.local or [])}, engine {len(r.engine or [])} tokens)")
            click.echo(f"            local:  {r.local_token}")
            click.echo(f"            engine: {r.engine_token}")
            click.echo(f"            likely: {r.hint}")
    click.echo(f"\n{report.model}: {report.summary()}")


@click.group("tokenizer")
def tokenizer_group() -> None:
    """Local tokenizers: check them against the engine."""


@tokenizer_group.command("check")
@click.option("--model", default=None, help="Model name as the engine serves it (default: the running `up` stack's, else the one model the fleet serves).  [env KVPF_MODEL]")
@click.option("--engine-url", default=None, help="The engine: http://HOST:PORT (its /tokenize is the reference; default: the running `up` stack's, else a live engine of the fleet serving --model).")
@click.option("--tokenizer-dir", default=None, type=click.Path(exists=True, file_okay=False),
              help="Directory with tokenizer.json + tokenizer_config.json (default: the engine's model root, if local).")
@click.option("--samples", "samples_path", default=None, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON lines of {\"prompt\": ...} or {\"messages\": [...]}, checked after the built-in samples.")
@click.option("--no-builtin", is_flag=True, help="Only the --samples file.")
@click.option("--timeout", default=10.0, show_default=True, type=float, help="Seconds per engine call.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
def check(model, engine_url, tokenizer_dir, samples_path, no_builtin, timeout, as_json) -> None:
    """Tokenize samples locally and with the engine; print the first divergent token of each that differs.

    Exit status: 0 identical, 1 some sample differs, 2 the engine could not be asked.
    """
    from kv_preflight.cli.stack_file import engine_and_model

    model, engine_url = engine_and_model(model, engine_url, need_engine=True,
                                         predictor_url=os.environ.get("KVPF_PREDICTOR_URL"),
                                         valkey_url=os.environ.get("KVPF_VALKEY_URL"))
    if not engine_url.startswith(("http://", "https://")):
        raise click.BadParameter(f"--engine-url {engine_url!r} needs a scheme: http://HOST:PORT")
    try:
        directory = tokenizer_dir or model_root(engine_url, model)
    except httpx.HTTPError as exc:
        click.echo(f"Error: the engine at {engine_url} is unreachable ({exc or type(exc).__name__}); "
                   "it is the reference, start it or fix --engine-url", err=True)
        raise SystemExit(2) from None
    if not directory:
        raise click.UsageError(f"--tokenizer-dir not given and the engine's root for {model!r} is not a local "
                               "directory with tokenizer.json")
    try:
        local = LocalTokenizer.load(directory, name=model)
        samples = [] if no_builtin else builtin_samples(local)
        if samples_path:
            samples += load_samples(samples_path)
    except (TokenizerLoadError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from None
    if not samples:
        raise click.UsageError("no samples: drop --no-builtin or give --samples")
    report = asyncio.run(_check(local, engine_url, model, samples, timeout))
    if as_json:
        click.echo(json.dumps({"tokenizer_dir": directory, **report.as_dict()}, indent=2, ensure_ascii=False))
    else:
        click.echo(f"{model}: local tokenizer {directory} vs {engine_url}/tokenize, {len(samples)} samples\n")
        print_report(report)
    raise SystemExit(0 if report.ok else 2 if report.error else 1)
