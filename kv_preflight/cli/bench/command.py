"""``kv-preflight bench``'s options, on click like every other command (did-you-mean, KVPF_<NAME> by the one
rule of cli/env.py); the run itself (cli/bench/run.py) is imported only when it starts.

``--json`` is a flag, as everywhere (``KVPF_JSON=1`` prints JSON): it once took a file, so that variable
made ``bench`` write a file named ``1``. The file is ``--json-file``.
"""
from __future__ import annotations

import difflib
from pathlib import Path

import click

ROWS = ("keys", "ingest", "memory", "floor", "outage", "http", "scaling", "cluster", "fleet", "route", "lora", "dp",
        "warnings", "gateway", "gateways")
DEFAULT_ROWS = "keys,ingest,floor,http,scaling,cluster,fleet,warnings"


def parse_rows(ctx: click.Context | None, param: click.Parameter | None, value: str) -> set[str]:
    """``--only``'s comma list, each name checked, with a did-you-mean for a near one."""
    only = {name.strip() for name in value.split(",") if name.strip()}
    if not only:
        raise click.BadParameter(f"an empty list; valid names: {', '.join(ROWS)}")
    problems = []
    for name in sorted(only - set(ROWS)):
        near = difflib.get_close_matches(name, ROWS, n=1)
        problems.append(f"unknown row {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    if problems:
        raise click.BadParameter(f"{'; '.join(problems)}; valid names: {', '.join(ROWS)}")
    return only


def dated_in(path: Path, started: float | None = None) -> Path:
    """``--json-file``'s file: the path itself, or for a directory a file per run in it named for the run's
    start in UTC (``2026-12-02T09-56-08Z.json``), so kept runs sort by date and never overwrite each other."""
    import time

    return path / time.strftime("%Y-%m-%dT%H-%M-%SZ.json", time.gmtime(started)) if path.is_dir() else path


@click.command("bench")
@click.option("--quick", is_flag=True, help="Fewer requests and blocks: a smoke run, figures are noisier.")
@click.option("--only", default=DEFAULT_ROWS, show_default=True, callback=parse_rows,
              help=f"Comma list of rows: {', '.join(ROWS)} (memory: the ingest rows' memory figures alone).")
@click.option("--json", "as_json", is_flag=True, help="Print every figure as JSON after the table.")
@click.option("--json-file", default=None, type=click.Path(path_type=Path),
              help="Write every figure, percentile, CPU split and check to this JSON file; given a directory "
                   "(benchmarks/), to a file per run in it named for the run's start in UTC.")
@click.option("--html", "html_file", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the rows as a self-contained HTML page with charts (speed-up over the baseline, "
                   "time per operation both ways), as diagnose fleet --html does.")
def bench(quick: bool, only: set[str], as_json: bool, json_file: Path | None, html_file: Path | None = None) -> None:
    """Benchmark every hot path against a straightforward baseline (docs/benchmarks.md).

    Starts its own valkey-server on a free loopback port, predictors and an ingester, and stops them.
    """
    import os

    from kv_preflight.cli.bench.run import run

    if json_file is not None:  # refused now, not after minutes of benchmarking
        json_file = dated_in(json_file)
        parent = json_file.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"{json_file}: {parent} is not a directory this process can write to",
                                     param_hint="'--json-file'")

    if html_file is not None:
        parent = html_file.resolve().parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise click.BadParameter(f"{html_file}: {parent} is not a directory this process can write to",
                                     param_hint="'--html'")

    run(quick=quick, only=only, as_json=as_json, json_file=json_file, html_file=html_file)
