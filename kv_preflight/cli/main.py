"""The ``kv-preflight`` command: run, inspect and rebuild.

Sub-commands import their process lazily so ``kv-preflight keys`` stays instant.
"""
from __future__ import annotations

import json
import sys

import click

from kv_preflight.config import Config, parse_model_urls, parse_pod_urls, parse_tier_weights, parse_tokenizer_dirs
from kv_preflight.config import parse_group_specs, parse_lora_names
from kv_preflight.cli.serve_checks import check_serve_files, config_error, run_checked
from kv_preflight.cli.token_input import read_tokens
from kv_preflight.keys.chain import HAS_C_EXTENSION, HASH_ALGOS


# --version says whether setup.py built the C block-key routine (no compiler at install: the pure-Python path).
VERSION_MESSAGE = "%(prog)s, version %(version)s, C block-key routine: " + (
    "built" if HAS_C_EXTENSION else "not built (pure-Python fallback)")

# Commands that start what they use (up: its own Valkey; bench: its own stack) or use no Valkey: the running
# stack's <data-dir>/env is not theirs (up given another stack's Valkey would not start its own).
OWN_STACK = frozenset({"up", "bench", "simulate", "keys", "calibrate"})


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kv-preflight", message=VERSION_MESSAGE)
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Predict prefix-cache hits of LLM engines from their KV-cache events.

    Every command but up, bench, simulate, keys and calibrate reaches the stack a running `kv-preflight up`
    started with no flags: its Valkey and predictor URLs, its model and engines are read from <data-dir>/env
    (KVPF_DATA_DIR, else ./.data) below flags and KVPF_* variables; with no such stack, a command that needs
    a model or an engine takes them from the fleet records (docs/usage.md#the-local-stack-scriptsup).
    """
    if ctx.invoked_subcommand not in OWN_STACK and not ctx.resilient_parsing:
        from kv_preflight.cli.stack_file import apply_defaults

        apply_defaults()


@cli.command()
@click.option("--model", required=True, help="Model name as llm-d hashes it (the LoRA adapter name for adapters).")
@click.option("--hash-seed", default="", show_default=True, help="llm-d's hash seed (PYTHONHASHSEED of the engines).")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Canonical tokens per request key.")
@click.option("--parent", default=None, type=int, help="Continue the chain from this request key instead of the model root.")
@click.option("--tokens", "tokens_spec", required=True, help="JSON list of token ids, or @file.")
@click.option("--hash-algo", default="fnv64a", show_default=True, type=click.Choice(HASH_ALGOS), help="llm-d's request-key hash: fnv64a (cbor-fnv, its default) or xxh64 (llm-d-router hashAlgorithm: xxh64).")
@click.option("--cache-salt", default=None, help="vLLM cache_salt of the prompt: keys its first block as the engine does.")
def keys(model: str, hash_seed: str, block_size: int, parent: int | None, tokens_spec: str, hash_algo: str = "fnv64a",
         cache_salt: str | None = None) -> None:
    """Print llm-d request keys for TOKENS as a JSON list of decimal strings."""
    from kv_preflight.keys.chain import request_keys, salted_request_keys

    try:
        tokens = read_tokens(tokens_spec)
        if cache_salt and parent is None:
            out = salted_request_keys(tokens, model=model, hash_seed=hash_seed, block_size=block_size,
                                      cache_salt=cache_salt, hash_algo=hash_algo)
        else:
            out = request_keys(tokens, model=model, hash_seed=hash_seed, block_size=block_size, parent=parent,
                               hash_algo=hash_algo)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    click.echo(json.dumps([str(k) for k in out]))


@cli.command()
@click.option("--valkey-url", default=None, help="Valkey URL (redis://, rediss://, with password); any node of a cluster.  [env KVPF_VALKEY_URL]")
@click.option("--valkey-cluster", default=None, type=click.Choice(["auto", "yes", "no"]), help="Whether --valkey-url names a Valkey Cluster node (default auto: asked with INFO cluster).  [env KVPF_VALKEY_CLUSTER]")
@click.option("--source", "sources", multiple=True, help="Engine PUB endpoint to connect to: tcp://HOST:PORT[,replay=tcp://HOST:PORT][,pods=POD@POD...][,curve_server_key=Z85][,pod=P,model=M][,engine=vllm|sglang|trtllm]. pod= and model= name a publisher whose topic is empty or not kv@POD@MODEL. Repeatable.")
@click.option("--bind", "binds", multiple=True, help="Endpoint to bind for engines that connect: tcp://*:PORT[,pods=POD@POD...][,pod=P,model=M][,engine=...] (pod= only while one publisher connects). Repeatable.")
@click.option("--engine", "engines", multiple=True, help="Engine HTTP URL; its /kv_event_sources (vLLM) or /server_info (SGLang) gives PUB, replay and topic. Repeatable.")
@click.option("--hash-seed", default=None, help="llm-d hash seed (default \"\").")
@click.option("--block-size", default=None, type=click.IntRange(min=1), help="Canonical request-key block size (default 16).")
@click.option("--entry-format", default=None, type=click.Choice(["json", "v08"]), help="PodEntry form to write (default json, llm-d v0.9+).")
@click.option("--log-json", is_flag=True, default=None, help="Structured JSON logs.")
@click.option("--metrics-port", default=None, type=click.IntRange(0, 65535), help="Serve Prometheus /metrics on this port (default 0: off).")
@click.option("--metrics-host", default=None, help="Address for --metrics-port (default 127.0.0.1).")
@click.option("--max-pod-series", default=None, type=click.IntRange(min=1), help="Pods with series of their own per metric; the rest are summed under pod=\"_other\" (default 256).")
@click.option("--max-frame-bytes", default=None, type=click.IntRange(min=4096), help="Largest ZMQ frame accepted; a larger one drops its connection unread (default 32 MiB).")
@click.option("--max-queue-bytes", default=None, type=click.IntRange(min=4096), help="Bytes of frames one socket may queue, and one replay may return (default 256 MiB).")
@click.option("--curve-secret-key-file", default=None, type=click.Path(exists=True, dir_okay=False), help="The ingester's CURVE keypair (zmq.auth *.key_secret, or the z85 secret key alone): --bind sockets become CURVE servers.")
@click.option("--curve-allow", default=None, type=click.Path(exists=True), help="Publisher public keys a --bind socket admits: a directory of certificates, or a file of z85 keys, one per line.")
@click.option("--engines-from", "engines_from", multiple=True, help="Discover engines: dns://NAME:PORT (every A/AAAA record of NAME is an engine at http://ADDRESS:PORT, e.g. a Kubernetes headless Service) or file://PATH (JSON list of URLs or {\"url\", \"pod\"}, or URLs one a line); followed as it changes. Discovered engines are named by their address (HOST:PORT). Repeatable.")
@click.option("--copies", default=None, type=click.IntRange(min=1), help="Ingesters per engine, among the live ones sharing this Valkey (default 2).")
@click.option("--private", is_flag=True, default=None, help="Ingest exactly the engines given here, outside the fleet: its lease, marked private, says only how fresh its pods are, so other ingesters neither give it engines nor take its; no pod records, health or retirement; registered engines off unless --registered-engines (docs/fleet.md#a-private-ingester).")
@click.option("--ingester-id", default=None, help="This ingester's name in the fleet (default HOST:PID:RANDOM).")
@click.option("--lease-ttl", "lease_ttl_s", default=None, type=click.FloatRange(min=2), help="Seconds an ingester's lease lasts unrenewed; its engines are taken over after it (default 5).")
@click.option("--membership-hold", "membership_hold_s", default=None, type=click.FloatRange(min=0), help="Seconds an engine must stay discovered (or gone) before it is ingested (or retired) (default 3).")
@click.option("--retire-after", "retire_after_s", default=None, type=click.FloatRange(min=0), help="Seconds a pod may stay unreachable before it is retired: entries cleared, no longer offered (default 60).")
@click.option("--retired-retention", "retired_retention_s", default=None, type=click.FloatRange(min=0), help="Seconds a retired pod's registry row is kept (default 3600).")
@click.option("--health-failures", default=None, type=click.IntRange(min=1), help="Failed /health checks in a row that make a pod unreachable (default 3).")
@click.option("--registered-engines/--no-registered-engines", default=None, help="Also ingest engines registered at run time through the remote-indexer API (default on).")
@click.option("--lora-name", "lora_names", multiple=True, help="ID=NAME: key blocks of the engine's LoRA id ID under adapter NAME (SGLang, TensorRT-LLM send only the id). Repeatable.")
@click.option("--hash-algo", default=None, type=click.Choice(HASH_ALGOS), help="Request-key hash, as llm-d's tokenProcessorConfig.hashAlgorithm (default fnv64a = cbor-fnv; xxh64).")
@click.option("--pod-id", "pod_id", default=None, type=click.Choice(["topic", "endpoint"]), help="Pod id to index under: the topic's kv@POD@model (default), or endpoint: <pod IP>:<target port of the rank>, as llm-d v0.10 does. Every ingester of an index must agree (kvpf:settings).")
@click.option("--target-ports", default=None, help="With --pod-id endpoint: the InferencePool's targetPorts, P0,P1,... (rank r gets the r-th; default: the --engine URL's port + r).")
@click.option("--max-sources", default=None, type=click.IntRange(min=1), help="Engine sources this ingester subscribes at most (default 256, and what the open-file limit allows); an engine past it is refused, logged and counted.")
@click.option("--zmq-heartbeat", "zmq_heartbeat_s", default=None, type=click.FloatRange(min=0), help="Seconds between ZMTP heartbeat PINGs on every SUB and replay socket; an engine answers them by itself (default 2; 0: off). A connection silent past --zmq-heartbeat-timeout (a half-open connection, a partition) is closed and made again, and its pods replayed from their persisted seq.")
@click.option("--zmq-heartbeat-timeout", "zmq_heartbeat_timeout_s", default=None, type=click.FloatRange(min=0.1, max=6553), help="Seconds without any traffic after a PING before the connection is closed (default 6); also how long a ZMTP handshake may take.")
@click.option("--tcp-keepalive", "tcp_keepalive_s", default=None, type=click.FloatRange(min=0), help="Idle seconds before TCP keepalive probes on every event socket (3 probes, a third of that apart; default 30; 0: the OS default).")
@click.option("--silence-probe", "silence_probe_s", default=None, type=click.FloatRange(min=0), help="A source silent this long, and four times its usual gap, has its replay socket asked for the next seq: batches it never got prove its stream dead, which is then connected again and replayed (default 10; 0: off).")
@click.option("--kv-cache-report-mode", default=None, type=click.Choice(["incremental", "full"]), help="full: clients may ask vLLM for kv_cache_report_mode \"full\", so a parentless run of held blocks from a prompt's start is read as a re-announcement of reused blocks, not a second copy (default incremental, vLLM's default: such a run is a copy, as when concurrent requests compute one prefix at once). Every ingester of an index must agree.")
def ingest(valkey_url, valkey_cluster, sources, binds, engines, hash_seed, block_size, entry_format, log_json, metrics_port,
           metrics_host, max_pod_series, max_frame_bytes, max_queue_bytes, curve_secret_key_file, curve_allow,
           lora_names, engines_from, copies, ingester_id, lease_ttl_s, membership_hold_s, retire_after_s,
           retired_retention_s, health_failures, registered_engines, hash_algo=None, pod_id=None,
           target_ports=None, private=None, max_sources=None, kv_cache_report_mode=None, zmq_heartbeat_s=None,
           zmq_heartbeat_timeout_s=None, tcp_keepalive_s=None, silence_probe_s=None) -> None:
    """Subscribe to engines' KV events and keep the Valkey index in step."""
    from kv_preflight.ingester.main import run

    try:
        cfg = Config.load(valkey_url=valkey_url, valkey_cluster=valkey_cluster, sources=sources, binds=binds,
                          engines=engines, hash_seed=hash_seed,
                          block_size=block_size, entry_format=entry_format, log_json=log_json,
                          metrics_port=metrics_port, metrics_host=metrics_host, max_pod_series=max_pod_series,
                          max_frame_bytes=max_frame_bytes, max_queue_bytes=max_queue_bytes,
                          curve_secret_key_file=curve_secret_key_file, curve_allow=curve_allow,
                          engines_from=engines_from, copies=copies, ingester_id=ingester_id, lease_ttl_s=lease_ttl_s,
                          membership_hold_s=membership_hold_s, retire_after_s=retire_after_s,
                          retired_retention_s=retired_retention_s, health_failures=health_failures,
                          registered_engines=False if private and registered_engines is None else registered_engines,
                          private=private,
                          lora_names=parse_lora_names(lora_names) if lora_names else None, hash_algo=hash_algo,
                          pod_id=pod_id, max_sources=max_sources, kv_cache_report_mode=kv_cache_report_mode,
                          zmq_heartbeat_s=zmq_heartbeat_s, zmq_heartbeat_timeout_s=zmq_heartbeat_timeout_s,
                          tcp_keepalive_s=tcp_keepalive_s, silence_probe_s=silence_probe_s,
                          target_ports=tuple(p.strip() for p in target_ports.split(",") if p.strip()) if target_ports else None)
    except ValueError as exc:
        raise click.UsageError(config_error(exc)) from None
    if not (cfg.sources or cfg.binds or cfg.engines or cfg.engines_from or cfg.registered_engines):
        raise click.UsageError("give at least one --source, --bind, --engine or --engines-from")
    sys.exit(run(cfg))


@cli.command()
@click.option("--valkey-url", default=None, help="Valkey URL; any node of a cluster.  [env KVPF_VALKEY_URL]")
@click.option("--valkey-cluster", default=None, type=click.Choice(["auto", "yes", "no"]), help="Whether --valkey-url names a Valkey Cluster node (default auto).  [env KVPF_VALKEY_CLUSTER]")
@click.option("--engine-url", "engine_urls", multiple=True, help="MODEL=http://HOST:PORT, for tokenizing prompt/messages. Repeatable.")
@click.option("--host", default=None, help="Listen address (default 127.0.0.1).")
@click.option("--port", default=None, type=int, help="Listen port (default 8080).")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(min=1), help="Worker processes sharing the port.")
@click.option("--hash-seed", default=None, help="llm-d hash seed (default \"\").")
@click.option("--block-size", default=None, type=click.IntRange(min=1), help="Canonical request-key block size (default 16).")
@click.option("--max-tokens", default=None, type=click.IntRange(min=1), help="Largest prompt accepted, in tokens (default 262144).")
@click.option("--lookup", default=None, type=click.Choice(["script", "pipeline"]), help="Single node: script (one EVALSHA reads the chain's pod bitmaps) or pipeline (llm-d's own HKEYS per key). A cluster always reads the bitmaps, one request per shard.")
@click.option("--log-json", is_flag=True, default=None, help="Structured JSON logs.")
@click.option("--tokenizer", "tokenizers", multiple=True, help="MODEL=DIR: tokenize locally from DIR's tokenizer.json + tokenizer_config.json. Repeatable.")
@click.option("--tokenizer-check/--no-tokenizer-check", default=None, help="Compare local tokenizers with the engine at start-up; fall back to the engine on a mismatch (default on).")
@click.option("--ttft-model", default=None, type=click.Path(exists=True, dir_okay=False), help="Prefill model JSON from `kv-preflight calibrate` (default: docs/ttft.md defaults).")
@click.option("--pod-metrics", "pod_metrics", multiple=True, help="POD=http://HOST:PORT: scrape the engine's /metrics for routing. Repeatable; --engine-url engines are scraped too.")
@click.option("--metrics-interval", "metrics_interval_s", default=None, type=click.FloatRange(min=0.05), help="Seconds between engine metric scrapes (default 1).")
@click.option("--route-tier-weight", "tier_weights", multiple=True, help="TIER=WEIGHT for cached blocks on that tier (default gpu=1.0 cpu=0.8 cpu_pinned=0.8). Repeatable.")
@click.option("--route-waiting-weight", default=None, type=float, help="Load = running + this x waiting (default 2).")
@click.option("--route-overload-abs", default=None, type=float, help="Overloaded if load - the fleet's mean load >= this (default 6) ...")
@click.option("--route-overload-rel", default=None, type=float, help="... and load >= this x the fleet's mean load (default 1.5).")
@click.option("--route-max-kv-usage", default=None, type=float, help="Overloaded at or above this KV usage, 0-1 (default 0.95).")
@click.option("--route-good-match", default=None, type=float, help="A good match holds at least this fraction of the best overlap (default 0.5).")
@click.option("--route-stale", "route_stale_s", default=None, type=float, help="Engine load older than this many seconds is unknown (default 5).")
@click.option("--route-placement-window", "route_placement_window_s", default=None, type=click.FloatRange(min=0), help="A new prefix goes to the pod with the fewest blocks of prefixes routed there within this many seconds (default 60; 0: by load only).")
@click.option("--route-pending", "route_pending_s", default=None, type=click.FloatRange(min=0), help="A new prefix placed less than this many seconds ago, not indexed yet, goes to the same pod again (default 5).")
@click.option("--api-keys-file", default=None, type=click.Path(dir_okay=False), help="Require Authorization: Bearer with one of these keys (one per line). Also KVPF_API_KEYS=k1,k2.")
@click.option("--max-pods-filter", default=None, type=click.IntRange(min=1), help="Most entries a request's pods filter may hold (default 1024).")
@click.option("--request-read-timeout", "request_read_timeout_s", default=None, type=click.FloatRange(min=0.01), help="Seconds a client gets to send a request's headers, then as many for its body; 408 and close after (default 10).")
@click.option("--dynamo-port", default=None, type=click.IntRange(0, 65535), help="Also serve NVIDIA Dynamo's standalone KV indexer API on this port (default 0: off; Dynamo uses 8090). docs/dynamo.md")
@click.option("--hash-algo", default=None, type=click.Choice(HASH_ALGOS), help="Request-key hash, as llm-d's tokenProcessorConfig.hashAlgorithm (default fnv64a = cbor-fnv; xxh64).")
@click.option("--register-allow", "register_allow", multiple=True, help="Host, address or CIDR a Dynamo /register may name as an engine endpoint. Repeatable (default: loopback only).")
@click.option("--register-ipc-dir", "register_ipc_dirs", multiple=True, help="Folder a Dynamo /register may name an ipc:// engine socket in (its path normalized first). Repeatable (default /tmp).")
@click.option("--max-registered-engines", default=None, type=click.IntRange(min=1), help="Engines /register may add in all (default 1024); past it, 429.")
@click.option("--max-registered-per-model", default=None, type=click.IntRange(min=1), help="Engines /register may add per model (default 256); past it, 429.")
@click.option("--max-connections-per-client", default=None, type=click.IntRange(min=0), help="Connections one client address may hold open (default 64; 0: no limit); past it, 503 and close. Behind a load balancer or gateway every request comes from its few addresses: raise it to the gateway's connection pool or set 0 there.")
@click.option("--max-connections", default=None, type=click.IntRange(min=0), help="Connections all clients may hold open (default 0: the open-file limit less 64); past it, 503 and close.")
@click.option("--group-spec", "group_specs", multiple=True, help="MODEL:GROUP=KIND[/block=N][/window=N][/chunk=N][/eagle]: a hybrid model's KV cache group, for what its engine's events do not say (a chunked local attention group's chunk size). Repeatable. docs/engines.md")
def serve(valkey_url, valkey_cluster, engine_urls, host, port, workers, hash_seed, block_size, max_tokens, lookup, log_json,
          tokenizers, tokenizer_check, ttft_model, pod_metrics, metrics_interval_s, tier_weights,
          route_waiting_weight, route_overload_abs, route_overload_rel, route_max_kv_usage, route_good_match,
          route_stale_s, api_keys_file, max_pods_filter, request_read_timeout_s, dynamo_port=None,
          register_allow=(), hash_algo=None, route_placement_window_s=None, route_pending_s=None,
          max_registered_engines=None, max_registered_per_model=None, max_connections_per_client=None,
          max_connections=None, group_specs=(), register_ipc_dirs=()) -> None:
    """Serve predictions and routing over HTTP."""
    from kv_preflight.predictor.serve import serve as run_server

    try:
        urls = parse_model_urls(engine_urls) if engine_urls else None
        cfg = Config.load(
            valkey_url=valkey_url, valkey_cluster=valkey_cluster, engine_urls=urls, host=host, port=port, hash_seed=hash_seed,
            block_size=block_size, max_tokens=max_tokens, lookup=lookup, log_json=log_json,
            tokenizers=parse_tokenizer_dirs(tokenizers) if tokenizers else None, tokenizer_check=tokenizer_check,
            ttft_model=ttft_model, pod_metrics=parse_pod_urls(pod_metrics) if pod_metrics else None,
            metrics_interval_s=metrics_interval_s,
            route_tier_weights=parse_tier_weights(tier_weights) if tier_weights else None,
            route_waiting_weight=route_waiting_weight, route_overload_abs=route_overload_abs,
            route_overload_rel=route_overload_rel, route_max_kv_usage=route_max_kv_usage,
            route_good_match=route_good_match, route_stale_s=route_stale_s, api_keys_file=api_keys_file,
            max_pods_filter=max_pods_filter, request_read_timeout_s=request_read_timeout_s,
            dynamo_port=dynamo_port, register_allow=register_allow, register_ipc_dirs=register_ipc_dirs or None,
            hash_algo=hash_algo,
            route_placement_window_s=route_placement_window_s, route_pending_s=route_pending_s,
            max_registered_engines=max_registered_engines, max_registered_per_model=max_registered_per_model,
            max_connections_per_client=max_connections_per_client, max_connections=max_connections,
            group_specs=parse_group_specs(group_specs) if group_specs else None,
        )
        check_serve_files(cfg)
    except ValueError as exc:
        raise click.BadParameter(config_error(exc)) from None
    run_checked(cfg, run_server, workers)


def main() -> None:  # pragma: no cover
    cli()


from kv_preflight.cli.demo import accuracy, demo  # noqa: E402
from kv_preflight.cli.calibrate import calibrate  # noqa: E402
from kv_preflight.cli.index_cmds import index_group  # noqa: E402
from kv_preflight.cli.tokenizer_cmds import tokenizer_group  # noqa: E402
from kv_preflight.cli.up import up  # noqa: E402
from kv_preflight.cli.diagnose import diagnose_group  # noqa: E402
from kv_preflight.cli.explain_cmd import explain  # noqa: E402
from kv_preflight.cli.predict_cmd import predict, route  # noqa: E402

cli.add_command(index_group)
cli.add_command(tokenizer_group)
cli.add_command(calibrate)
cli.add_command(up)
cli.add_command(demo)
cli.add_command(accuracy)
cli.add_command(explain)
cli.add_command(predict)
cli.add_command(route)
cli.add_command(diagnose_group)


from kv_preflight.cli.bench.command import bench  # noqa: E402  (its run is imported when it starts)

cli.add_command(bench)


@cli.command()
@click.option("--pod", required=True, help="Pod name: the topic is kv@POD@MODEL.")
@click.option("--model", required=True, help="Served model name.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Listen address, HTTP and events alike: a wildcard --zmq or --replay endpoint (tcp://*:PORT) binds on it (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535), help="HTTP port.")
@click.option("--zmq", "zmq_endpoint", default="tcp://*:5557", show_default=True, help="KV-event PUB endpoint; binds when it holds '*' (on --host), connects otherwise (as vLLM).")
@click.option("--replay", "replay_endpoint", default="tcp://*:5558", show_default=True, help="Replay ROUTER endpoint (bound; '*' on --host); 'none' disables replay.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Tokens per engine KV block.")
@click.option("--blocks", default=256, show_default=True, type=click.IntRange(min=2), help="KV blocks in the pool, including vLLM's reserved null block.")
@click.option("--max-model-len", default=512, show_default=True, type=click.IntRange(min=2), help="Context length (prompt + output).")
@click.option("--step-ms", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Wall time per engine step.")
@click.option("--topic", default=None, help="PUB topic (default kv@POD@MODEL; '' is vLLM's default empty topic).")
@click.option("--sliding-window", type=click.IntRange(min=2), default=None, help="Simulate a hybrid model: a sliding-window layer with this window (tokens) beside a full-attention one, two KV cache groups as vLLM's hybrid KV cache manager runs them.")
@click.option("--dp-size", default=1, show_default=True, type=click.IntRange(1, 64), help="Data-parallel ranks (vLLM's --data-parallel-size): each its own prefix cache and publisher on the event and replay ports + rank; a request goes to the rank its X-data-parallel-rank header names, else the least loaded.")
@click.option("--lora", "adapters", multiple=True, help="Serve a LoRA adapter of this name beside the model (as vLLM's --lora-modules NAME=PATH): requests naming it cache their own blocks, published with lora_name as vLLM does. Repeatable.")
def simulate(pod, model, host, port, zmq_endpoint, replay_endpoint, block_size, blocks, max_model_len, step_ms,
             topic, sliding_window, dp_size, adapters) -> None:
    """Run a fake vLLM engine whose prefix cache and KV events behave like vLLM 0.32's."""
    from kv_preflight.simulator.config import SimulatorConfig
    from kv_preflight.simulator.main import run

    cfg = SimulatorConfig(pod=pod, model=model, host=host, port=port, zmq_endpoint=zmq_endpoint,
                          replay_endpoint=None if replay_endpoint.lower() == "none" else replay_endpoint,
                          block_size=block_size, num_blocks=blocks, max_model_len=max_model_len,
                          step_delay_s=step_ms / 1000, topic_override=topic, sliding_window=sliding_window,
                          dp_size=dp_size, adapters=tuple(adapters))
    try:
        cfg.validate()
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    run(cfg)


from kv_preflight.cli.gateway_cmd import gateway_command  # noqa: E402

cli.add_command(gateway_command(serve))  # serve's options and the gateway's own (cli/gateway_cmd.py)

from kv_preflight.cli.env import apply_env  # noqa: E402

apply_env(cli)  # last: every command above is defined; each option reads KVPF_<NAME> (cli/env.py)
