"""``kv-preflight gateway``: serve's options (the same routing policy, tokenizers, limits and API keys) and the
gateway's own, turned into the one Config and run (kv_preflight/predictor/gateway/).

Built from ``serve``'s own click options (``gateway_command(serve)``), so an option added to ``serve`` reaches
the gateway too; the Dynamo remote-indexer options stay ``serve``'s. A serve option fills the Config field of
its name, or of the name ``RENAMED`` gives, through its parser.
"""
from __future__ import annotations

import copy
import dataclasses

import click

from kv_preflight.cli.serve_checks import check_serve_files, run_checked
from kv_preflight.config import (Config, parse_group_specs, parse_model_urls, parse_pod_urls, parse_tier_weights,
                                 parse_tokenizer_dirs)

NOT_THE_GATEWAYS = frozenset({"dynamo_port", "register_allow", "max_registered_engines", "max_registered_per_model"})
PARSED = {"engine_urls": parse_model_urls, "tokenizers": parse_tokenizer_dirs, "pod_metrics": parse_pod_urls,
          "tier_weights": parse_tier_weights, "group_specs": parse_group_specs}
RENAMED = {"tier_weights": "route_tier_weights"}
_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))

GATEWAY_OPTIONS = [
    click.Option(["--engine", "engines"], multiple=True, help="An engine's HTTP URL to route to beside the pods the fleet records list; one that publishes no KV events is routed approximately, by what was sent to it (docs/gateway.md). Repeatable."),
    click.Option(["--max-body-bytes"], default=None, type=click.IntRange(min=1), help="Largest request body accepted (default 8 MiB); past it, 413."),
    click.Option(["--gateway-max-inflight"], default=None, type=click.IntRange(min=1), help="Upstream requests in flight at most (default 1024); past it, 503 with Retry-After."),
    click.Option(["--gateway-connect-timeout", "gateway_connect_timeout_s"], default=None, type=click.FloatRange(min=0.01), help="Seconds to connect to an engine (default 2); past it, the next candidate."),
    click.Option(["--gateway-read-timeout", "gateway_read_timeout_s"], default=None, type=click.FloatRange(min=0.01), help="Seconds an engine may stay silent, before its answer or between its bytes (default 600)."),
    click.Option(["--gateway-avoid", "gateway_avoid_s"], default=None, type=click.FloatRange(min=0), help="Seconds a pod that failed a request is left out of routes while another is left (default 10)."),
    click.Option(["--gateway-decode-tokens"], default=None, type=click.IntRange(min=0), help="Decode tokens booked for a request that names no max_tokens (default 256)."),
    click.Option(["--gateway-speculative-ttl", "gateway_speculative_ttl_s"], default=None, type=click.FloatRange(min=0), help="Seconds a routed prompt's blocks count on its pod for every gateway, until the engine's events confirm them (default 2; 0: none)."),
    click.Option(["--gateway-kv-capacity"], default=None, type=click.IntRange(min=0), help="KV capacity in tokens of an engine no ingester feeds, which its approximate index keeps (default 0: what the engine's metrics say, vllm:cache_config_info; else 131072)."),
    click.Option(["--gateway-booking-ttl", "gateway_booking_ttl_s"], default=None, type=click.FloatRange(min=0), help="Seconds a request's booking outlives a gateway that stopped renewing it (default 10; 0: no bookings, routes see only the engines' scraped load)."),
]


def gateway_command(serve: click.Command) -> click.Command:
    params = [copy.copy(p) for p in serve.params if p.name not in NOT_THE_GATEWAYS]
    for p in params:
        if p.name == "max_connections_per_client":
            p.help = ("Connections one client address may hold open (default 0: no limit, as a balancer in front is "
                      "one address); past it, 503 and close.")
        elif p.name == "port":
            p.help = "Listen port (default 8080)."

    def run(workers: int, **options) -> None:
        from kv_preflight.predictor.gateway.serve import serve as run_gateway

        try:
            cfg = Config.load(**config_values(options))
            check_serve_files(cfg)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        run_checked(cfg, run_gateway, workers)

    return click.Command(
        "gateway", callback=run, params=[*params, *(copy.copy(o) for o in GATEWAY_OPTIONS)],
        help="An OpenAI-compatible gateway: route each request by the index and forward it to the chosen engine.\n\n"
             "POST /v1/completions and /v1/chat/completions go to the pod /v1/cache/route would pick, answered byte "
             "for byte with x-kvpf-pod, x-kvpf-predicted-cached-tokens and x-kvpf-reason; GET /v1/models lists the "
             "fleet's models; the predictor's own routes are served too. With --valkey-url alone it routes to the "
             "pods the fleet records list (docs/gateway.md).")


def config_values(options: dict) -> dict:
    """The command's values as Config.load's overrides (None: not given, so the environment or the default)."""
    out = {}
    for name, value in options.items():
        if name in PARSED:
            value = PARSED[name](value) if value else None
        field = RENAMED.get(name, name)
        if field in _FIELDS:
            out[field] = value
    if out.get("max_connections_per_client") is None:
        out["max_connections_per_client"] = 0  # a balancer in front is one client address
    return out
