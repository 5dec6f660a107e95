"""``kv-preflight predict`` and ``kv-preflight route``: the API's two main calls from the command line.

The body is exactly ``POST /v1/cache/predict``'s or ``/v1/cache/route``'s (docs/api.md), built from flags: the
prompt as text, chat messages or token ids, an optional pods filter and cache salt. The answer is printed as a
few lines for people (``--json``: as received). With no flags they reach the running ``kv-preflight up``
stack and its model (cli/stack_file.py); every failure is one line and exit 1.
"""
from __future__ import annotations

import json
from typing import Any

import click

from kv_preflight.cli.explain_cmd import _input, ask_predictor
from kv_preflight.cli.stack_file import engine_and_model


def _pods(values: tuple[str, ...]) -> list[str]:
    return [p.strip() for v in values for p in v.split(",") if p.strip()]


def _freshness_lines(doc: dict[str, Any]) -> list[str]:
    f = doc.get("freshness") or {}
    if not f:
        return []
    pods = ", ".join(f"{p} {v['state']}" + (f" (staleness {v['staleness_ms']} ms)" if v.get("staleness_ms") is not None
                                             else "") for p, v in sorted((f.get("pods") or {}).items()))
    lines = [f"freshness: {f['state']}" + (f": {'; '.join(f['reasons'])}" if f.get("reasons") else "")
             + (f" [{pods}]" if pods else "")]
    return lines


def _warning_lines(doc: dict[str, Any]) -> list[str]:
    return [f"warning: {w.get('kind')}: {w.get('detail')}" for w in doc.get("warnings") or []]


def render_prediction(model: str, doc: dict[str, Any]) -> str:
    """A predict answer for people: the prediction, each pod's share, TTFT, freshness, warnings."""
    best = doc.get("best_pod")
    lines = [f"model {model}: {doc['predicted_cached_tokens']} of {doc['total_prompt_tokens']} tokens cached"
             + (f" on {best}" if best else " on no pod")
             + f" ({doc['blocks_cached']} of {doc['blocks_total']} blocks, hit ratio {doc['cache_hit_ratio']:.2f})"
             + (f", estimated TTFT {doc['estimated_ttft_ms']} ms" if doc.get("estimated_ttft_ms") is not None else "")
             + (" (lower bound: a Valkey shard did not answer)" if doc.get("partial") else "")]
    for a in doc.get("pod_affinities") or []:
        lines.append(f"  {a['pod_id']:<20} {a['cached_tokens']:>7} tokens {a['cached_blocks']:>5} blocks  "
                     f"{a.get('device_tier') or '-':<6}" + (f" TTFT {a['estimated_ttft_ms']} ms"
                                                          if a.get("estimated_ttft_ms") is not None else "")
                     + (" INCOMPLETE" if a.get("incomplete") else ""))
    return "\n".join(lines + _freshness_lines(doc) + _warning_lines(doc))


def render_route(doc: dict[str, Any]) -> str:
    """A route answer for people: the pod and why, then the candidates."""
    lines = [f"route to {doc.get('pod_id') or 'no pod'}: {doc['reason']}" + (f" ({doc['detail']})" if doc.get("detail") else ""),
             f"  {doc['cached_tokens']} of {doc['total_prompt_tokens']} tokens cached there"
             + (f", estimated TTFT {doc['estimated_ttft_ms']} ms" if doc.get("estimated_ttft_ms") is not None else "")
             + (f"; best overlap on {doc['best_overlap_pod']}" if doc.get("best_overlap_pod") else "")]
    cands = doc.get("candidates") or []
    if cands:
        lines.append(f"  {'candidate':<20} {'cached':>7} {'load':>6}  overloaded")
        for c in cands:
            load = c.get("load")
            lines.append(f"  {c['pod_id']:<20} {c['cached_tokens']:>7} {'-' if load is None else f'{load:g}':>6}  "
                         f"{'yes' if c.get('overloaded') else 'no'}")
    return "\n".join(lines + _freshness_lines(doc) + _warning_lines(doc))


def _common(f):
    for opt in reversed([
        click.option("--predictor-url", "--url", "url", default="http://127.0.0.1:8080", show_default=True, help="The predictor's base URL (default: the running `up` stack's, else this).  [env KVPF_PREDICTOR_URL]"),
        click.option("--model", default=None, help="Model name as the engine serves it (default: the running `up` stack's, else the one model the fleet serves).  [env KVPF_MODEL]"),
        click.option("--prompt", default=None, help="The prompt text, or @file (tokenized as the model's engine does)."),
        click.option("--messages", default=None, help="Chat messages as a JSON list, or @file (the chat template applied)."),
        click.option("--tokens", default=None, help="Token ids as a JSON list, or @file."),
        click.option("--pods", "pods", multiple=True, help="Only these candidate pods: POD[,POD...]. Repeatable."),
        click.option("--cache-salt", default=None, help="vLLM's cache_salt of the prompt (docs/llm-d.md)."),
        click.option("--api-key", default=None, help="Bearer key when the predictor requires one.  [env KVPF_API_KEY]"),
        click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds to wait."),
        click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON, as the API sends it."),
    ]):
        f = opt(f)
    return f


def _body(url: str, model: str | None, prompt, messages, tokens, pods, cache_salt) -> tuple[str, dict[str, Any]]:
    given = _input(prompt, messages, tokens, "")
    if not given:
        raise click.UsageError("give one of --prompt, --messages, --tokens")
    model, _ = engine_and_model(model, None, need_engine=False, predictor_url=url)
    body: dict[str, Any] = {"model": model, **given}
    if pods:
        body["pods"] = _pods(pods)
    if cache_salt:
        body["cache_salt"] = cache_salt
    return model, body


@click.command("predict")
@_common
def predict(url, model, prompt, messages, tokens, pods, cache_salt, api_key, timeout, as_json) -> None:
    """How many tokens of a prompt are cached, on which pod (POST /v1/cache/predict on a running predictor)."""
    model, body = _body(url, model, prompt, messages, tokens, pods, cache_salt)
    doc = ask_predictor(url, "/v1/cache/predict", body, api_key, timeout)
    click.echo(json.dumps(doc) if as_json else render_prediction(model, doc))


@click.command("route")
@_common
@click.option("--max-staleness-ms", default=None, type=click.IntRange(min=0), help="Route by load alone when the index of a pod holding the prompt may be older than this (reason stale_index).")
def route(url, model, prompt, messages, tokens, pods, cache_salt, api_key, timeout, as_json, max_staleness_ms) -> None:
    """The pod to send a prompt to, and why (POST /v1/cache/route on a running predictor)."""
    _, body = _body(url, model, prompt, messages, tokens, pods, cache_salt)
    if max_staleness_ms is not None:
        body["max_staleness_ms"] = max_staleness_ms
    doc = ask_predictor(url, "/v1/cache/route", body, api_key, timeout)
    click.echo(json.dumps(doc) if as_json else render_route(doc))
