"""``kv-preflight demo`` and ``kv-preflight accuracy``: predicted vs actual cached tokens, as a table."""
from __future__ import annotations

import json
from pathlib import Path

import click
import httpx

from kv_preflight.cli.stack_file import engine_and_model
from kv_preflight.cli.accuracy import Outcome, WorkloadError, load_workload, run_workload, shared_prefix_workload, summarize


def _run_workload(*args, **kwargs) -> list[Outcome]:
    """run_workload, with a refused request or an unreachable engine/predictor as one clear line."""
    try:
        return run_workload(*args, **kwargs)
    except WorkloadError as exc:
        raise click.ClickException(str(exc)) from None
    except httpx.HTTPError as exc:
        try:
            where = str(exc.request.url)
        except RuntimeError:  # no request attached
            where = "the engine or the predictor"
        raise click.ClickException(f"cannot reach {where}: {exc or type(exc).__name__}") from None
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None


def _row(r: Outcome) -> None:
    mark = click.style("ok", fg="green") if r.exact else click.style("MISMATCH", fg="red")
    click.echo(f"  {r.index:>3} {r.prompt_tokens:>8} {r.predicted:>10} {r.actual:>8}  {r.best_pod or '-':<12} {mark}")


def print_demo(engine_url: str, predictor_url: str, model: str, requests: list[dict] | None = None) -> bool:
    click.echo(f"demo: shared-prefix workload against {engine_url}, predicting just before each request\n")
    click.echo(f"  {'#':>3} {'prompt':>8} {'predicted':>10} {'actual':>8}  {'best pod':<12}")
    results = _run_workload(engine_url, predictor_url, model, requests or shared_prefix_workload(), on_result=_row)
    s = summarize(results)
    click.echo(f"\n  {s['exact']}/{s['requests']} predictions exact; {s['requests_with_hits']} requests hit the cache\n")
    return s["exact"] == s["requests"]


ENGINE_HELP = "Engine to send the workload to (default: the running `up` stack's, else a live engine of the fleet serving --model)."
PREDICTOR_HELP = "The predictor's base URL (default: the running `up` stack's, else this).  [env KVPF_PREDICTOR_URL]"
MODEL_HELP = "Model name as the engine serves it (default: the running `up` stack's, else the one model the fleet serves).  [env KVPF_MODEL]"


@click.command("demo")
@click.option("--engine-url", default=None, help=ENGINE_HELP)
@click.option("--predictor-url", default="http://127.0.0.1:8080", show_default=True, help=PREDICTOR_HELP)
@click.option("--model", default=None, help=MODEL_HELP)
def demo(engine_url, predictor_url, model) -> None:
    """Send a short shared-prefix workload; print predicted vs actual cached tokens per request."""
    model, engine_url = engine_and_model(model, engine_url, need_engine=True, predictor_url=predictor_url)
    if not print_demo(engine_url, predictor_url, model):
        raise SystemExit(1)


@click.command("accuracy")
@click.option("--engine-url", default=None, help=ENGINE_HELP)
@click.option("--predictor-url", default="http://127.0.0.1:8080", show_default=True, help=PREDICTOR_HELP)
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--workload", "workload_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON lines, each with one of token_ids, prompt, messages.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary and every request as JSON.")
def accuracy(engine_url, predictor_url, model, workload_path, as_json) -> None:
    """Measure prediction accuracy: exact-match rate and error in tokens over a workload."""
    model, engine_url = engine_and_model(model, engine_url, need_engine=True, predictor_url=predictor_url)
    try:
        reqs = load_workload(workload_path)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if as_json:
        results = _run_workload(engine_url, predictor_url, model, reqs)
        click.echo(json.dumps({"summary": summarize(results), "requests": [r.__dict__ for r in results]}, indent=2))
        return
    click.echo(f"  {'#':>3} {'prompt':>8} {'predicted':>10} {'actual':>8}  {'best pod':<12}")
    s = summarize(_run_workload(engine_url, predictor_url, model, reqs, on_result=_row))
    click.echo(f"\n  exact: {s['exact']}/{s['requests']} ({s['exact_rate']:.1%}); mean |error| "
               f"{s['mean_abs_error_tokens']} tokens, max {s['max_abs_error_tokens']}")
