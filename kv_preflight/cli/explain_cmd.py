"""``kv-preflight explain``: ask a running predictor why a prompt would miss, and print the answer for people.

The body is exactly ``POST /v1/cache/explain``'s (docs/explain.md), built from flags; the answer is
printed as a few readable lines (``--json``: as received). Every failure is one line and exit 1.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import httpx

from kv_preflight.cli.stack_file import engine_and_model, no_stack_hint


def _json_arg(spec: str, what: str) -> Any:
    """A JSON value, or ``@file`` holding one."""
    try:
        text = Path(spec[1:]).read_text() if spec.startswith("@") else spec
    except OSError as exc:
        raise click.BadParameter(f"{what} {spec}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"{what} is not JSON: {exc}") from None


def _text_arg(spec: str, what: str) -> str:
    if not spec.startswith("@"):
        return spec
    try:
        return Path(spec[1:]).read_text()
    except OSError as exc:
        raise click.BadParameter(f"{what} {spec}: {exc.strerror}") from None


def _input(prompt: str | None, messages: str | None, tokens: str | None, prefix: str) -> dict[str, Any]:
    given = {k: v for k, v in (("prompt", prompt), ("messages", messages), ("token_ids", tokens)) if v is not None}
    if len(given) > 1:
        raise click.UsageError(f"give only one of --{prefix}prompt, --{prefix}messages, --{prefix}tokens")
    if not given:
        return {}
    name, spec = next(iter(given.items()))
    if name == "prompt":
        return {"prompt": _text_arg(spec, f"--{prefix}prompt")}
    return {name: _json_arg(spec, f"--{prefix}{'tokens' if name == 'token_ids' else name}")}


def render(doc: dict[str, Any]) -> str:
    """The answer for people: the prediction, each pod's chain, the findings, the divergence."""
    lines = [f"model {doc.get('model')}: {doc['predicted_cached_tokens']} of {doc['total_prompt_tokens']} tokens "
             f"cached" + (f" on {doc['best_pod']}" if doc.get("best_pod") else " on no pod")
             + (" (lower bound: a Valkey shard did not answer)" if doc.get("partial") else "")]
    pods = doc.get("pods") or []
    if pods:
        lines.append("pods (where the cached chain stops):")
        for p in pods:
            lost = p["lost_tokens"]
            drops = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in lost.items() if v)
            lines.append(f"  {p['pod_id']}: stops at block {p['stop_block']} (token {p['stop_token']}), "
                         f"reuses {p['reused_tokens']}" + (f"; lost: {drops}" if drops else "")
                         + f" [engine block {p['engine_block_size']}]")
        if doc.get("pods_truncated"):
            lines.append("  ... more pods not shown")
    findings = doc.get("findings") or []
    if findings:
        lines.append("findings:")
        for f in findings:
            at = f" at token {f['token_index']}" if f.get("token_index") is not None else ""
            lines.append(f"  {f['kind']}{at}: {f['detail']}")
    else:
        lines.append("findings: none")
    div = doc.get("divergence")
    if div:
        cut = f", {div['tokens_cut']} token(s) cut" if div.get("tokens_cut") is not None else ""
        lines.append(f"divergence at token {div['token_index']} (block {div['block_index']}): {div['cause']}{cut}")
        for side, label in (("ours", "this prompt"), ("theirs", "comparison")):
            s = div[side]
            lines.append(f"  {label:>11}: {s['before']!r} [{s['token']!r}] {s['after']!r}")
    return "\n".join(lines)


@click.command("explain")
@click.option("--predictor-url", "--url", "url", default="http://127.0.0.1:8080", show_default=True, help="The predictor's base URL (default: the running `up` stack's, else this).  [env KVPF_PREDICTOR_URL]")
@click.option("--model", default=None, help="Model name as the engine serves it (the adapter name for LoRA; default: the running `up` stack's, else the one model the fleet serves).  [env KVPF_MODEL]")
@click.option("--prompt", default=None, help="The prompt text, or @file.")
@click.option("--messages", default=None, help="Chat messages as a JSON list, or @file.")
@click.option("--tokens", default=None, help="Token ids as a JSON list, or @file.")
@click.option("--compare-prompt", default=None, help="The earlier prompt expected to hit, or @file.")
@click.option("--compare-messages", default=None, help="The earlier chat messages (JSON list or @file).")
@click.option("--compare-tokens", default=None, help="The earlier token ids (JSON list or @file).")
@click.option("--pod", "pods", multiple=True, help="Only these candidate pods. Repeatable.")
@click.option("--api-key", default=None, help="Bearer key when the predictor requires one.  [env KVPF_API_KEY]")
@click.option("--timeout", default=30.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
def explain(url, model, prompt, messages, tokens, compare_prompt, compare_messages, compare_tokens, pods, api_key,
            timeout, as_json) -> None:
    """Why a prompt would miss the prefix cache (POST /v1/cache/explain on a running predictor)."""
    given = _input(prompt, messages, tokens, "")
    if not given:
        raise click.UsageError("give one of --prompt, --messages, --tokens")
    model, _ = engine_and_model(model, None, need_engine=False, predictor_url=url)
    body: dict[str, Any] = {"model": model, **given}
    compare = _input(compare_prompt, compare_messages, compare_tokens, "compare-")
    if compare:
        body["compare"] = compare
    if pods:
        body["pods"] = list(pods)
    doc = ask_predictor(url, "/v1/cache/explain", body, api_key, timeout)
    click.echo(json.dumps(doc, indent=2) if as_json else render(doc))


def ask_predictor(url: str, path: str, body: dict[str, Any], api_key: str | None, timeout: float) -> dict[str, Any]:
    """POST ``body`` to a running predictor's ``path``; its JSON answer, or one clear line (ClickException): it
    cannot be reached (and where its URL came from), answered no JSON, or answered an error."""
    key = api_key or os.environ.get("KVPF_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        resp = httpx.post(url.rstrip("/") + path, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the predictor at {url}: {type(exc).__name__}: {exc}"
                                   f"{no_stack_hint('url')}") from None
    try:
        doc = resp.json()
    except ValueError:
        raise click.ClickException(f"the predictor answered {resp.status_code} without JSON: {resp.text[:200]}") from None
    if resp.status_code != 200:
        raise click.ClickException(f"the predictor answered {resp.status_code}: {doc.get('error', doc)}")
    return doc
