"""``kv-preflight up``: the whole local stack in one command, stopped cleanly by Ctrl-C.

Starts a private valkey-server on loopback (AOF under ./.data), simulated engines unless real
ones are given, ingesters (each with its Prometheus /metrics), and the predictor. Each child is a real
``kv-preflight`` process with its log under .data/logs, so what runs here is what runs in production; a
simulated engine that dies is an engine failure the stack lives through, as production would
(``EngineFailures``), any other child's exit stops the stack.

Every child, Valkey included, ends when ``up`` dies, whatever kills it: on Linux the kernel sends it
SIGTERM (PR_SET_PDEATHSIG, armed between fork and exec; kv_preflight/parent_death.py says why that and not a
watcher); elsewhere a SIGKILLed ``up`` leaves them running. The data directory is checked before any
process starts (cli/stack_checks.py), and every wait has a deadline. The children and their readiness are
cli/stack_procs.py's.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx

from kv_preflight.cli import stack_file
from kv_preflight.cli.stack_checks import check_engines, check_port, fresh_start, prepare_data_dir
from kv_preflight.cli.stack_procs import EngineFailures, Stack, exited, start_sims, wait_http
from kv_preflight.cli.valkey_cluster import ValkeyCluster
from kv_preflight.config import Config, parse_model_urls
from kv_preflight.cli.valkey_server import ValkeyServer, free_port, reserve_port


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def scrape_targets(stack: Stack, predictor: str, engines: list[str], gateway: str | None = None) -> list[tuple[str, str]]:
    """(process, its /metrics URL) for every process of the stack that serves one: the predictor (and its series
    per pod, /metrics/pods), the gateway, each ingester, each engine (a simulated engine's, or a real vLLM's,
    vllm:* series)."""
    out = [("predictor", predictor + "/metrics"), ("predictor-pods", predictor + "/metrics/pods")]
    if gateway:
        out.append(("gateway", gateway + "/metrics"))
    out += [(c.name, c.url) for c in stack.children if c.name.startswith("ingester-") and c.url]
    sims = {c.url: c.name for c in stack.children if c.pod}
    out += [(sims.get(url, f"engine-{i}"), url.rstrip("/") + "/metrics") for i, url in enumerate(engines)]
    return out


def metrics_lines(targets: list[tuple[str, str]]) -> str:
    return "\n             ".join(f"{url}   ({name})" for name, url in targets)


def write_prometheus_config(data_dir: Path, targets: list[tuple[str, str]]) -> Path:
    """``<data-dir>/prometheus.yml``: a scrape config for every process of the stack, jobs named as the
    compose stack's (compose/observability/prometheus.yml), so its dashboard reads this stack too:
    ``prometheus --config.file <data-dir>/prometheus.yml``."""
    jobs: dict[str, list[tuple[str, str]]] = {}
    for name, url in targets:
        job = name if name.startswith(("predictor", "gateway")) else "ingester" if name.startswith("ingester-") \
            else "engine"
        jobs.setdefault(job, []).append((name, url))
    lines = ["# written by kv-preflight up for the stack it runs: prometheus --config.file THIS_FILE",
             "global:", "  scrape_interval: 5s", "scrape_configs:"]
    for job, members in jobs.items():
        lines += [f"  - job_name: {job}", "    static_configs:"]
        for name, url in members:
            u = httpx.URL(url)
            lines += [f"      - targets: ['{u.host}:{u.port}']", f"        labels: {{process: {name}}}"]
        lines.append(f"    metrics_path: {httpx.URL(members[0][1]).path}")
    path = data_dir / "prometheus.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def step(i: int, n: int, text: str) -> None:
    click.echo(click.style(f"[{i}/{n}] ", fg="cyan") + text)


@click.command("up")
@click.option("--engine", "engines", multiple=True, help="A real engine's HTTP URL (discovered via /kv_event_sources). Repeatable; default: simulated engines.")
@click.option("--engine-url", "engine_urls", multiple=True, help="MODEL=http://HOST:PORT used to tokenize prompts (default: the given or simulated engines).")
@click.option("--valkey-url", default=None, help="Use this Valkey (any node of a cluster) instead of starting one.")
@click.option("--cluster", "cluster", is_flag=True, help="Start a local Valkey Cluster (3 masters + 3 replicas, AOF) instead of one node.")
@click.option("--data-dir", default=".data", show_default=True, type=click.Path(file_okay=False, path_type=Path), help="Valkey data (AOF) and logs.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535), help="Predictor port.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1), help="Predictor worker processes on that port.")
@click.option("--gateway-port", default=None, type=click.IntRange(0, 65535), help="Port of the OpenAI-compatible gateway that routes by the index (default: --port + 1; 0: no gateway). docs/gateway.md")
@click.option("--ingesters", default=2, show_default=True, type=click.IntRange(min=1), help="Ingester processes sharing the engines by lease, each engine ingested by two of them (docs/fleet.md).")
@click.option("--sim-engines", default=2, show_default=True, type=click.IntRange(min=1), help="Simulated engines when no --engine is given.")
@click.option("--model", default="sim-model", show_default=True, help="Model name of the simulated engines.")
@click.option("--sim-block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Engine block size of the simulated engines.")
@click.option("--sim-blocks", default=512, show_default=True, type=click.IntRange(min=2), help="KV blocks per simulated engine.")
@click.option("--sim-max-model-len", default=4096, show_default=True, type=click.IntRange(min=2), help="Context length of the simulated engines, prompt and output (their tokenizer takes a token per byte: examples/workload.jsonl needs 1,515).")
@click.option("--demo", is_flag=True, help="Once up, send a short shared-prefix workload and print predicted vs actual.")
@click.option("--exit-after-demo", is_flag=True, help="With --demo: stop the stack when the demo ends (exit 1 on any mismatch).")
@click.option("--fresh", is_flag=True, help="Start from an empty index: remove the Valkey data (AOF) and logs an earlier up left in --data-dir.")
def up(engines, engine_urls, valkey_url, cluster, data_dir, port, workers, ingesters, sim_engines, model, sim_block_size,
       sim_blocks, demo, exit_after_demo, fresh=False, sim_max_model_len=4096, gateway_port=None,
       **serve_options) -> None:
    """Run Valkey, engines (simulated unless given), ingesters and the predictor together.

    Every process listens on 127.0.0.1; the banner lists each one's Prometheus /metrics, and
    <data-dir>/prometheus.yml scrapes them all. A simulated engine that dies (kill it to try an engine
    failure) leaves the stack up: its pod goes unreachable, then is retired (ingest --retire-after,
    KVPF_RETIRE_AFTER), each step printed. Once ready it writes <data-dir>/env (KVPF_VALKEY_URL, KVPF_PREDICTOR_URL) which every other command
    run from here reads (with the default --data-dir; else it prints the KVPF_DATA_DIR to export), and holds <data-dir>/up.lock so no second up shares the directory.
    """
    stack = Stack(data_dir)
    n = 5
    rc = 0
    try:
        Config.load(valkey_url=valkey_url, engines=engines,
                    engine_urls=parse_model_urls(engine_urls) if engine_urls else None)
    except ValueError as exc:  # checked here: a child would only fail with it once the stack is half up
        raise click.UsageError(str(exc)) from None
    if fresh and valkey_url:
        raise click.UsageError("--fresh empties the Valkey up starts, not one given with --valkey-url (clear that one "
                               "with `kv-preflight index clear --pod P`, or FLUSHALL it yourself)")
    prepare_data_dir(data_dir)
    # Before anything starts, in this order: the directory is ours, the ports are free, the engines answer.
    predictor = f"http://127.0.0.1:{port}"
    try:
        lock = stack_file.DataDirLock(data_dir).acquire(f"predictor {predictor}")
    except stack_file.DataDirInUse as exc:
        raise click.BadParameter(f"{data_dir} is in use by {exc}; stop it (Ctrl-C) or give another --data-dir",
                                 param_hint="'--data-dir'") from None
    check_port(port, "predictor", "--port")
    reserve_port(port)  # free now, and none of the ports drawn below for valkey or engines may be it
    gateway_port = port + 1 if gateway_port is None and port < 65535 else gateway_port or 0
    gateway = f"http://127.0.0.1:{gateway_port}" if gateway_port else None
    if gateway_port:
        check_port(gateway_port, "gateway", "--gateway-port")
        reserve_port(gateway_port)
    if engines:
        check_engines(list(engines))
    if fresh:
        gone = fresh_start(data_dir)
        click.echo(f"--fresh: removed {', '.join(str(p) for p in gone)}" if gone else
                   f"--fresh: nothing to remove in {data_dir}")
    # SIGHUP too: the terminal closed, and the children, in sessions of their own, would not hear of it
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        if valkey_url:
            step(1, n, f"using Valkey at {valkey_url.split('@')[-1]}")
        elif cluster:
            step(1, n, f"starting a Valkey Cluster on loopback: 3 masters + 3 replicas (AOF in {data_dir / 'valkey-cluster'}) ...")
            try:
                # the stack holds it before it starts: nodes up when the cluster fails to form are stopped too
                stack.valkey = ValkeyCluster(data_dir / "valkey-cluster", tied_to_parent=True)
                stack.valkey.start()
            except (OSError, RuntimeError, TimeoutError, subprocess.TimeoutExpired) as exc:
                raise click.ClickException(str(exc)) from None
            valkey_url = stack.valkey.url
            click.echo(f"      valkey: {valkey_url} (any node; the cluster's nodes are in "
                       f"{data_dir / 'valkey-cluster' / 'cluster.json'})")
        else:
            step(1, n, f"starting valkey-server on loopback (AOF in {data_dir / 'valkey'}) ...")
            try:
                stack.valkey = ValkeyServer(data_dir / "valkey", appendonly=True, tied_to_parent=True)
                stack.valkey.start()
            except (OSError, RuntimeError, TimeoutError) as exc:
                raise click.ClickException(str(exc)) from None
            valkey_url = stack.valkey.url
            click.echo(f"      valkey: {valkey_url}")
        engine_list = list(engines)
        if engine_list:
            step(2, n, f"using {len(engine_list)} engine(s): {', '.join(engine_list)}")
        else:
            step(2, n, f"starting {sim_engines} simulated engine(s) (model {model}, block {sim_block_size}, {sim_blocks} "
                       f"blocks, context {sim_max_model_len}) ...")
            engine_list = start_sims(stack, sim_engines, ["--model", model, "--block-size", str(sim_block_size),
                                                          "--blocks", str(sim_blocks),
                                                          "--max-model-len", str(sim_max_model_len)])
            for url in engine_list:
                click.echo(f"      engine: {url}")
        step(3, n, f"starting {ingesters} ingester(s) ...")
        for i in range(ingesters):
            # each with its Prometheus /metrics on loopback, as every process of the stack (their lag, events,
            # gaps and replays; the predictor's are on its own port)
            mport = free_port()
            args = ["ingest", "--valkey-url", valkey_url, "--ingester-id", f"up-ingester-{i}",
                    "--metrics-port", str(mport), "--metrics-host", "127.0.0.1"]
            for url in engine_list:
                args += ["--engine", url]
            stack.spawn(f"ingester-{i}", args, url=f"http://127.0.0.1:{mport}/metrics")
        urls = list(engine_urls)
        if not urls:
            models = _served_models(engine_list[0]) or [model]
            urls = [f"{m}={engine_list[0]}" for m in models]
        step(4, n, f"starting the predictor on 127.0.0.1:{port} with {workers} worker(s) ...")
        # The predictor is given the Valkey URL alone: the ingesters' fleet records tell it every pod, its
        # engine (for /tokenize) and its load (docs/fleet.md). --engine-url, when given, overrides.
        serve = ["serve", "--valkey-url", valkey_url, "--port", str(port), "--workers", str(workers)]
        for u in engine_urls:
            serve += ["--engine-url", u]
        serve += serve_args(serve_options)
        predictor_child = stack.spawn("predictor", serve)
        wait_http(predictor + "/ready", stack, "predictor", predictor_child)
        if gateway:  # the same routing options: the gateway decides as the predictor's /route does
            click.echo(f"      and the gateway on 127.0.0.1:{gateway_port} (OpenAI API, routed by the index) ...")
            gateway_child = stack.spawn("gateway", ["gateway", "--valkey-url", valkey_url, "--port", str(gateway_port),
                                                    *(a for u in engine_urls for a in ("--engine-url", u)),
                                                    *serve_args(serve_options)])
            wait_http(gateway + "/ready", stack, "gateway", gateway_child)
        if not engine_urls:
            _wait_fleet(valkey_url, engine_list, stack)
        served_model = urls[0].split("=", 1)[0]
        metrics = scrape_targets(stack, predictor, engine_list, gateway)
        prometheus_file = write_prometheus_config(data_dir, metrics)
        env_file = stack_file.write(data_dir, {stack_file.VALKEY_URL: valkey_url, stack_file.PREDICTOR_URL: predictor,
                                               stack_file.MODEL: served_model,
                                               stack_file.STACK_ENGINES: ",".join(engine_list),
                                               **{f"{stack_file.STACK_ENGINES[:-1]}_{i}": url
                                                  for i, url in enumerate(engine_list)}})
        step(5, n, click.style("ready", fg="green"))
        cli_path = Path(sys.executable).parent / "kv-preflight"
        gateway_line = f"  gateway    {gateway}   (POST /v1/completions, /v1/chat/completions: routed by the index)\n" \
            if gateway else ""
        cli_hint = str(cli_path) if cli_path.exists() else "kv-preflight"
        click.echo(f"""
  predictor  {predictor}   (GET /health, GET /ready, GET /stats, POST /v1/cache/predict)
{gateway_line}  valkey     {valkey_url.split('@')[-1]}
  engines    {' '.join(engine_list)}
  metrics    {metrics_lines(metrics)}
             (a Prometheus scrape config for them all: {prometheus_file}; a dashboard: compose/observability/)
  logs       {data_dir / 'logs'}/
  env        {stack_file.banner_env_line(data_dir, env_file)}

  export KVPF_VALKEY_URL={valkey_url} KVPF_PREDICTOR_URL={predictor}
  the CLI:   {cli_hint} index stats   (not on PATH unless you `source {Path(sys.executable).parent / 'activate'}`)

  try:
    curl -s {predictor}/v1/cache/predict -H 'content-type: application/json' \\
      -d '{{"model": "{served_model}", "prompt": "You are a helpful assistant. Summarize the following report."}}'
    curl -s {engine_list[0]}/v1/completions -H 'content-type: application/json' \\
      -d '{{"model": "{served_model}", "prompt": "You are a helpful assistant. Summarize the following report.", "max_tokens": 1}}'
    (run the first again: the prediction now counts the blocks the engine cached)
""")
        if demo:
            from kv_preflight.cli.demo import print_demo

            ok = print_demo(engine_list[0], predictor, served_model)
            if len(engine_list) > 1:  # round robin vs /route, and one explained miss (cli/affinity_demo.py)
                from kv_preflight.cli.affinity_demo import print_affinity_demo

                print_affinity_demo(engine_list, predictor, served_model)
            if exit_after_demo:
                rc = 0 if ok else 1
                return
        click.echo("Ctrl-C stops everything.")
        failures = EngineFailures(valkey_url, len(engine_list))
        while True:
            dead = stack.check()
            if dead is not None and dead.pod:  # an engine failed: the stack lives on, as production would
                stack.children.remove(dead)
                failures.lost(dead)
            elif dead is not None:
                click.echo(f"Error: {exited(dead)}. Stopping.", err=True)
                rc = 1
                return
            failures.follow()
            time.sleep(0.5)
    except KeyboardInterrupt:
        click.echo("\nstopping ...")
    finally:
        for sig in STOP_SIGNALS:  # a second Ctrl-C must not cut the stop short
            signal.signal(sig, signal.SIG_IGN)
        stack_file.remove(data_dir)  # first: no command reads a stack that is going
        stack.stop()
        lock.release()
        # The handlers stay ignored until the process exits: a Ctrl-C pressed just after the stop (a
        # terminal sends one per key press) would otherwise end it with a KeyboardInterrupt traceback.
        click.echo("stopped.")
        if rc:
            sys.exit(rc)


# The predictor's routing and tokenizer options, under serve's own names, handed to the predictor as given
# (tests/unit/test_up_options.py checks that each matches serve's option).
SERVE_OPTIONS = [
    click.Option(["--tokenizer", "tokenizers"], multiple=True, help="MODEL=DIR: the predictor tokenizes locally from DIR (as serve --tokenizer). Repeatable."),
    click.Option(["--tokenizer-check/--no-tokenizer-check"], default=None, help="As serve: compare local tokenizers with the engine at start-up."),
    click.Option(["--ttft-model"], default=None, type=click.Path(exists=True, dir_okay=False), help="As serve: prefill model JSON from `kv-preflight calibrate`, used by routing."),
    click.Option(["--pod-metrics", "pod_metrics"], multiple=True, help="POD=http://HOST:PORT: engine /metrics scraped for routing (as serve). Repeatable."),
    click.Option(["--metrics-interval", "metrics_interval_s"], default=None, type=click.FloatRange(min=0.05), help="As serve: seconds between engine metric scrapes."),
    click.Option(["--route-tier-weight", "tier_weights"], multiple=True, help="TIER=WEIGHT, as serve. Repeatable."),
    click.Option(["--route-waiting-weight"], default=None, type=float, help="As serve."),
    click.Option(["--route-overload-abs"], default=None, type=float, help="As serve."),
    click.Option(["--route-overload-rel"], default=None, type=float, help="As serve."),
    click.Option(["--route-max-kv-usage"], default=None, type=float, help="As serve."),
    click.Option(["--route-good-match"], default=None, type=float, help="As serve."),
    click.Option(["--route-stale", "route_stale_s"], default=None, type=float, help="As serve."),
    click.Option(["--route-placement-window", "route_placement_window_s"], default=None, type=click.FloatRange(min=0), help="As serve."),
    click.Option(["--route-pending", "route_pending_s"], default=None, type=click.FloatRange(min=0), help="As serve."),
    click.Option(["--group-spec", "group_specs"], multiple=True, help="MODEL:GROUP=KIND[/chunk=N]...: a hybrid model's KV cache group, as serve --group-spec. Repeatable."),
]
up.params.extend(SERVE_OPTIONS)


def serve_args(values: dict) -> list[str]:
    """The given SERVE_OPTIONS as serve's command-line arguments; options not given are left out."""
    out: list[str] = []
    for opt in SERVE_OPTIONS:
        value = values.get(opt.name)
        if value is None or value == ():
            continue
        if opt.is_flag:
            out.append(opt.opts[0] if value else opt.secondary_opts[0])
        else:
            for v in value if opt.multiple else (value,):
                out += [opt.opts[0], str(v)]
    return out


def _interrupt(*_) -> None:
    """Ctrl-C or SIGTERM: stop, once. Further signals are ignored from here, so a repeated Ctrl-C
    cannot interrupt the stop half-way (a traceback, children left running)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


def _wait_fleet(valkey_url: str, engine_list: list[str], stack, timeout_s: float = 30.0) -> None:
    """Until every engine has a live fleet record with its models (the ingesters write them within a few
    seconds), so the first request already finds its model; then one more second for the predictor's read."""
    import asyncio

    reported: set[str] = set()

    async def ready() -> bool:
        view = await stack_file.fleet_view_at(valkey_url)
        reported.update(r.engine_url for r in view.pods.values() if r.state == "live" and r.models)
        return set(engine_list) <= reported

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = stack.check()
        if dead:
            raise click.ClickException(exited(dead))
        try:  # each look bounded too: a Valkey that accepts and never answers must not hold up here
            if asyncio.run(asyncio.wait_for(ready(), timeout=max(0.5, deadline - time.monotonic()))):
                time.sleep(1.2)
                return
        except Exception:  # Valkey busy or not answering yet: asked again
            pass
        time.sleep(0.3)
    missing = sorted(set(engine_list) - reported)
    said = [ln for ln in _log_lines(stack.data_dir / "logs", "ingester-") if any(u in ln for u in missing)]
    raise click.ClickException(
        f"the ingesters did not report engine(s) {', '.join(missing) or '?'} within {timeout_s:.0f}s"
        + (f"; their log says: {said[-1]}" if said else "") + f" (logs: {stack.data_dir / 'logs'})")


def _log_lines(log_dir: Path, prefix: str) -> list[str]:
    lines: list[str] = []
    for log in sorted(log_dir.glob(prefix + "*.log")):
        with contextlib.suppress(OSError):
            lines += [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines


def _served_models(engine_url: str) -> list[str]:
    try:
        return [m["id"] for m in httpx.get(engine_url + "/v1/models", timeout=5).json()["data"]]
    except Exception:
        return []
