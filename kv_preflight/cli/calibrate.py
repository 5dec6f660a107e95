"""``kv-preflight calibrate``: fit the per-model prefill (TTFT) model from observed requests."""
from __future__ import annotations

import json
from pathlib import Path

import click

from kv_preflight.predictor.scoring.ttft import fit_by_model, merge_into, parse_observations


@click.command("calibrate")
@click.option("--input", "input_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="JSON lines of observed requests: prompt_tokens, cached_tokens, ttft_ms (optional model).")
@click.option("--model", default=None, help="Fit this model only (its rows and rows without a model); "
              "default: one fit per model in the input, rows without one as '*' (every other model).")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Write (or update) this model file, for `serve --ttft-model`.")
@click.option("--quadratic/--no-quadratic", default=True, show_default=True,
              help="Allow the attention term (kept only if non-negative and it lowers the error).")
@click.option("--robust/--no-robust", default=True, show_default=True,
              help="Refit without slow outliers (queueing, hiccups): residual > 3 robust sigmas, at most 25%.")
def calibrate(input_path: Path, model: str | None, output: Path | None, quadratic: bool, robust: bool) -> None:
    """Least-squares fit of ttft = overhead + uncached/throughput (+ attention); prints the fit error."""
    try:
        data = parse_observations(input_path.read_text().splitlines(), str(input_path))
        fits = fit_by_model(data, model, quadratic=quadratic, robust=robust)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if model is not None and (other := sum(o.model not in (None, model) for o in data)):
        click.echo(f"{len(data)} observations read; {other} of other models ignored (--model {model})")
    for name, fit in fits.items():
        m = fit.model
        # "35 observations" for a 40-row file read as 5 lost rows: say what was read and what was left out
        left_out = f", {fit.outliers} slow outlier(s) left out (--no-robust keeps them)" if fit.outliers else ""
        click.echo(f"{name}: {fit.n + fit.outliers} observations{left_out}, fitted on {fit.n}; "
                   f"terms {'+'.join(fit.terms)}")
        click.echo(f"  overhead_ms            {m.overhead_ms:.3f}")
        click.echo(f"  prefill_tokens_per_s   {m.prefill_tokens_per_s:.1f}")
        click.echo(f"  attention_ms_per_mpair {m.attention_ms_per_mpair:.4f}")
        click.echo(f"  fit error: MAE {fit.mae_ms:.2f} ms, p90 relative error {fit.p90_rel_error:.1%}"
                   + (f" ({fit.outliers} slow outlier(s) left out; with them: MAE {fit.all_mae_ms:.2f} ms, "
                      f"p90 relative error {fit.all_p90_rel_error:.1%})" if fit.outliers else ""))
    if output:
        existing = None
        if output.exists():
            try:
                existing = json.loads(output.read_text())
            except json.JSONDecodeError as exc:
                raise click.ClickException(f"{output} exists and is not JSON ({exc}); not overwriting") from None
        output.write_text(json.dumps(merge_into(existing, fits), indent=2) + "\n")
        click.echo(f"wrote {output}")
