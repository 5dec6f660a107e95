"""Run every benchmark row against real processes and print figures, targets and baseline ratios.

    python -m kv_preflight.cli.bench [--quick] [--only keys,ingest,memory,floor,outage,http,scaling,cluster,fleet,route,lora,dp,warnings,gateway,gateways] [--json] [--json-file out.json] [--html out.html]

It starts its own valkey-server on a free loopback port (no persistence), loads
the index, starts ``kv-preflight serve --workers 2`` and the baseline server
(cli/bench/baseline.py) one after the other, and drives them with the load
generator (cli/bench/loadgen.py) in a separate process. Everything it starts it
stops, by pid. docs/benchmarks.md explains each row;
cli/bench/run.py is the run, each row's module is named for it.
"""
from __future__ import annotations

import click


def main(argv: list[str] | None = None) -> None:
    """``python -m kv_preflight.cli.bench``: the same command as ``kv-preflight bench`` (cli/bench/command.py)."""
    from kv_preflight.cli.bench.command import bench
    from kv_preflight.cli.env import apply_env

    group = click.Group(commands=[bench])
    apply_env(group)  # KVPF_<NAME>, as under kv-preflight
    bench.main(args=argv, prog_name="kv-preflight bench")


if __name__ == "__main__":
    main()
