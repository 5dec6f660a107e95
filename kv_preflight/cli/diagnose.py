"""``kv-preflight diagnose sessions|fleet``: why a workload or a fleet misses the prefix cache.

``sessions`` reads a JSON-lines log of conversation turns, tokenizes them as the predictor does (a
local tokenizer, else the engine's ``/tokenize``) and reports per session (predictor/diagnosis/sessions.py).
``fleet`` reads the index, the engines' prefix-cache counters and the predictor's traffic totals, twice
``--window`` seconds apart, and weighs the observed hit rate against affinity and round robin
(predictor/diagnosis/fleet.py); the summary is stored in Valkey for ``/stats``, ``--html`` writes a page.
The analyses are pure; this module does the reading and the printing. Errors are one line, exit 1.
"""
from __future__ import annotations

import asyncio
import html
from pathlib import Path
from typing import Any

import click
import httpx

from kv_preflight.cli.stack_file import no_stack_hint
import msgspec

from kv_preflight.config import parse_model_urls, parse_pod_urls, parse_tokenizer_dirs


@click.group("diagnose")
def diagnose_group() -> None:
    """Diagnose cache misses in a session log or across the fleet."""


# ---------------------------------------------------------------- sessions


def read_turns(path: Path) -> list[dict[str, Any]]:
    """The log's records, checked: ``{"session", "turn", "model", "messages" | "token_ids"}`` per line."""
    from kv_preflight.jsonl import read_json_lines

    out = []
    try:
        for n, obj in read_json_lines(path):
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object")
            missing = [k for k in ("session", "turn", "model") if k not in obj]
            if missing:
                raise ValueError(f"{path}:{n}: missing {', '.join(missing)}")
            if ("messages" in obj) == ("token_ids" in obj):
                raise ValueError(f"{path}:{n}: needs exactly one of messages, token_ids")
            if not isinstance(obj["turn"], int) or not isinstance(obj["model"], str):
                raise ValueError(f"{path}:{n}: turn must be an integer and model a string")
            if "token_ids" in obj and not (isinstance(obj["token_ids"], list) and obj["token_ids"]
                                           and all(isinstance(t, int) and t >= 0 for t in obj["token_ids"])):
                raise ValueError(f"{path}:{n}: token_ids must be a non-empty list of token ids")
            if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"]):
                raise ValueError(f"{path}:{n}: messages must be a non-empty list")
            out.append({**obj, "session": str(obj["session"]), "line": n})
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not out:
        raise ValueError(f"{path}: no records")
    return out


async def tokenize_turns(rows: list[dict[str, Any]], tokenizers: dict[str, str],
                         engine_urls: dict[str, tuple[str, ...]],
                         timeout_s: float) -> list[Any]:
    from kv_preflight.predictor.errors import PredictorError
    from kv_preflight.predictor.diagnosis.sessions import TurnRecord
    from kv_preflight.predictor.tokens.source import Tokenization
    from kv_preflight.predictor.tokens.engine import EngineTokenizer

    engine = EngineTokenizer(engine_urls, timeout_s)
    tok = Tokenization.load(engine, tokenizers, check=False)
    out = []
    try:
        for r in rows:
            if "token_ids" in r:
                tokens = r["token_ids"]
            else:
                if not tok.can_tokenize(r["model"]):
                    raise ValueError(f"line {r['line']}: no --tokenizer or --engine-url for model {r['model']!r} "
                                     "(or log token_ids)")
                try:
                    tokens, _ = await tok.tokenize(r["model"], messages=r["messages"])
                except PredictorError as exc:
                    raise ValueError(f"line {r['line']}: {exc.message}") from None
            out.append(TurnRecord(r["session"], r["turn"], r["model"], list(tokens)))
    finally:
        await engine.aclose()
    return out


def render_sessions(reports: list[Any]) -> str:
    lines = []
    for s in reports:
        window = f"window cuts from turn {s.window_from_turn}" if s.window_from_turn is not None else "no window cut"
        lines.append(f"session {s.session} ({s.model}): {len(s.turns)} turns, {window}; kept prefix {s.kept_prefix} "
                     f"tokens; prefilled {s.tokens_prefilled} tokens, {s.tokens_prefilled_if_stable} with a stable "
                     f"history; reuse {s.reuse:.0%}")
        for t in s.turns:
            cut = f", window cut {t.window_cut}" if t.window_cut else ""
            lines.append(f"  turn {t.turn}: {t.tokens} tokens, shares {t.shared_prefix} with the previous, "
                         f"prefills {t.prefilled} (stable: {t.stable_prefilled}){cut}")
        for a in s.advice:
            lines.append(f"  -> {a}")
    return "\n".join(lines)


@diagnose_group.command("sessions")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--tokenizer", "tokenizers", multiple=True, help="MODEL=DIR: tokenize that model's messages locally.")
@click.option("--engine-url", "engine_urls", multiple=True, help="MODEL=http://HOST:PORT: tokenize with the engine.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="Request-key block size.")
@click.option("--timeout", default=10.0, show_default=True, type=click.FloatRange(min=0.1), help="Engine timeout (s).")
@click.option("--json", "as_json", is_flag=True, help="Print the reports as JSON.")
def sessions(file: Path, tokenizers, engine_urls, block_size, timeout, as_json) -> None:
    """Per session in FILE.jsonl: shared prefix per turn, where a sliding window cuts, what to change."""
    from kv_preflight.predictor.tokens.local import TokenizerLoadError
    from kv_preflight.predictor.diagnosis.sessions import diagnose_sessions

    try:
        rows = read_turns(file)
        records = asyncio.run(tokenize_turns(rows, parse_tokenizer_dirs(tokenizers) if tokenizers else {},
                                             parse_model_urls(engine_urls) if engine_urls else {}, timeout))
    except (ValueError, TokenizerLoadError) as exc:
        raise click.ClickException(str(exc)) from None
    reports = diagnose_sessions(records, block_size=block_size)
    if as_json:
        click.echo(msgspec.json.encode(reports).decode())
    else:
        click.echo(render_sessions(reports))


# ---------------------------------------------------------------- fleet


async def read_engines(urls: dict[str, str], client: httpx.AsyncClient) -> tuple[dict[str, Any], dict[str, str]]:
    """Each pod's prefix-cache counters from ``<url>/metrics``; errors by pod."""
    from kv_preflight.engines import DEFAULT, engine
    from kv_preflight.predictor.diagnosis.fleet import parse_prefix_counters

    names = engine(DEFAULT).prefix_cache_metrics  # the engines read are of the default family
    assert names is not None

    out: dict[str, Any] = {}
    errors: dict[str, str] = {}

    async def one(pod: str, url: str) -> None:
        try:
            resp = await client.get(url.rstrip("/").removesuffix("/metrics") + "/metrics")
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            errors[pod] = f"{url}: {type(exc).__name__}: {exc}"
            return
        counters = parse_prefix_counters(resp.text, names)
        if counters is None:
            errors[pod] = f"{url}/metrics has no {names.queries.removesuffix('_total')}/hits counters"
        else:
            out[pod] = counters

    await asyncio.gather(*(one(p, u) for p, u in urls.items()))
    return out, errors


async def read_traffic(predictor_url: str | None, client: httpx.AsyncClient, api_key: str | None,
                       warn=None) -> dict | None:
    """The predictor's traffic totals; None (with a warning) when it cannot be read: the engines' numbers
    still stand, only p and the families are then unknown."""
    if not predictor_url:
        return None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(predictor_url.rstrip("/") + "/stats", params={"pods_limit": 0}, headers=headers)
        resp.raise_for_status()
        return resp.json().get("traffic")
    except (httpx.HTTPError, ValueError) as exc:
        if warn:
            warn(f"warning: cannot read the predictor's /stats at {predictor_url} ({type(exc).__name__}: {exc}): "
                 "p and the prefix families are unknown (--predictor-url; '' skips it)")
        return None


async def metrics_urls(index: Any, pod_metrics: dict[str, str], engine_urls: dict[str, tuple[str, ...]],
                       client: httpx.AsyncClient) -> dict[str, str]:
    """Pod -> engine URL: the fleet registry's (kvpf:fleet) where it has one, else --pod-metrics, else the
    --engine-url engines, whose pod id their discovery answer's topic gives."""
    from kv_preflight.predictor.load import _discover_pod

    urls = {pod: url for pod, url in pod_metrics.items()}
    for url in dict.fromkeys(u for urls_of_model in engine_urls.values() for u in urls_of_model):
        if url.rstrip("/") in {u.rstrip("/") for u in urls.values()}:
            continue
        pod = await _discover_pod(client, url.rstrip("/"))
        if pod is not None:
            urls.setdefault(pod, url)
    view = await index.fleet.fleet_view()
    for pod, rec in view.pods.items():
        if rec.engine_url and rec.state != "retired":
            urls[pod] = rec.engine_url
    return urls


async def run_fleet(*, valkey_url: str, cluster: bool | None, predictor_url: str | None, api_key: str | None,
                    pod_metrics: dict[str, str], engine_urls: dict[str, tuple[str, ...]], window_s: float,
                    progress=None) -> Any:
    from kv_preflight.predictor.diagnosis.fleet import bounded, diagnose_fleet
    from kv_preflight.index.entries import parse_entry
    from kv_preflight.index.index import Index

    index = Index.from_url(valkey_url, timeout_s=5.0, cluster=cluster)
    said: set[str] = set()

    def once(message: str) -> None:  # the same predictor failing at both readings is one warning
        if progress and message not in said:
            said.add(message)
            progress(message)

    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            urls = await metrics_urls(index, pod_metrics, engine_urls, client)
            before_e: dict[str, Any] = {}
            before_t = None
            if window_s > 0:
                if progress:  # said before the wait, not after: 60 s of silence looked like a hang
                    progress(f"sampling the engines' and the predictor's counters for {window_s:g}s (--window; "
                             "--window 0 reads the totals since they started, at once) ...")
                before_e, _ = await read_engines(urls, client)
                before_t = await read_traffic(predictor_url, client, api_key, once)
                await asyncio.sleep(window_s)
            after_e, errors = await read_engines(urls, client)
            after_t = await read_traffic(predictor_url, client, api_key, once)
        pods = {p.pod_id: (p.model, p.blocks) for p in await index.meta.pods()}
        keys = [int(f["first_key"]) for f in (after_t or {}).get("families", [])]
        holders: dict[str, list[str]] = {}
        if keys:
            for key, fields in zip(keys, await index.fields_per_key(keys, stop_at_gap=False)):
                entries = (parse_entry(f) for f in fields)
                holders[str(key)] = sorted({e.PodIdentifier for e in entries if e is not None})
        at_ms = await index.fleet.now_ms()
        result = diagnose_fleet(pods=pods, engines_before=before_e, engines_after=after_e, engine_errors=errors,
                                traffic_before=before_t, traffic_after=after_t, holders=holders, window_s=window_s,
                                at_ms=at_ms)
        await index.fleet.put_fleet_diagnosis(msgspec.json.encode(bounded(result)))
        return result
    finally:
        await index.close()


def render_fleet(d: Any) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    span = f"over {d.window_s:g}s" if d.window_s else "since the counters started"
    lines = [f"fleet of {d.n_pods} pod(s), {span}: {d.predictions} prediction(s)",
             f"  observed hit rate {pct(d.observed_hit_rate)}; affinity ceiling p {pct(d.p)}; round-robin bound p/N "
             f"{pct(d.round_robin_bound)}; gap p(1-1/N) {pct(d.fragmentation_gap)}; duplication "
             f"{'n/a' if d.duplication_factor is None else f'{d.duplication_factor:g}'}",
             "pods:"]
    for p in d.pods:
        if p.error:
            lines.append(f"  {p.pod_id}: {p.blocks} blocks; metrics: {p.error}")
        else:
            lines.append(f"  {p.pod_id}: {p.blocks} blocks, hit rate {pct(p.hit_rate)} ({p.hits:g} of {p.queries:g} "
                         "prompt tokens)")
    if d.families:
        lines.append("prefix families (busiest first):")
        for f in d.families[:10]:
            lines.append(f"  {f.first_key} ({f.model}): {f.predictions} prediction(s), on {f.duplication} pod(s) "
                         f"{', '.join(f.pods)}")
    lines.append(f"verdict: {d.verdict}: {d.detail}")
    return "\n".join(lines)


def render_html(d: Any) -> str:
    """One self-contained page (inline CSS, no script, no link): pods x families, hit rate against the bounds."""
    esc = html.escape
    pods = [p.pod_id for p in d.pods]
    bars = []
    for label, value in (("observed", d.observed_hit_rate), ("affinity ceiling p", d.p),
                         ("round-robin bound p/N", d.round_robin_bound)):
        width = 0 if value is None else max(0.0, min(1.0, value)) * 100
        bars.append(f'<tr><th>{esc(label)}</th><td><div class="bar" style="width:{width:.1f}%"></div></td>'
                    f'<td>{"n/a" if value is None else f"{value:.1%}"}</td></tr>')
    head = "".join(f"<th>{esc(p)}</th>" for p in pods)
    rows = []
    for f in d.families:
        cells = "".join('<td class="on">&#9632;</td>' if p in f.pods else "<td></td>" for p in pods)
        rows.append(f"<tr><th title=\"{esc(f.first_key)}\">{esc(f.first_key[:12])}&hellip; ({f.predictions})</th>"
                    f"{cells}<td>{f.duplication}</td></tr>")
    pod_rows = "".join(
        f"<tr><th>{esc(p.pod_id)}</th><td>{p.blocks}</td><td>{'n/a' if p.hit_rate is None else f'{p.hit_rate:.1%}'}"
        f"</td><td>{esc(p.error)}</td></tr>" for p in d.pods)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kv-preflight fleet diagnosis</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;margin:1em 0}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left}} .bar{{background:#3a7;height:1em}}
td:has(.bar){{width:20em}} .on{{color:#3a7;text-align:center}} .verdict{{font-weight:bold}}
</style></head><body>
<h1>Fleet diagnosis</h1>
<p class="verdict">{esc(d.verdict)}: {esc(d.detail)}</p>
<h2>Hit rate against the bounds</h2><table>{''.join(bars)}</table>
<h2>Pods</h2><table><tr><th>pod</th><th>blocks</th><th>hit rate</th><th>error</th></tr>{pod_rows}</table>
<h2>Prefix families &times; pods</h2>
<table><tr><th>family (predictions)</th>{head}<th>pods</th></tr>{''.join(rows)}</table>
<p>{d.predictions} prediction(s); window {d.window_s:g}s (0: since the counters started); {d.n_pods} pod(s).</p>
</body></html>
"""


@diagnose_group.command("fleet")
@click.option("--valkey-url", default=None, help="Valkey URL (any node of a cluster).  [env KVPF_VALKEY_URL]")
@click.option("--valkey-cluster", default=None, type=click.Choice(["auto", "yes", "no"]), help="Whether --valkey-url names a cluster node (default auto).")
@click.option("--predictor-url", default="http://127.0.0.1:8080", show_default=True, help="The predictor whose predictions give p ('' to skip; default: the running `up` stack's, else this).  [env KVPF_PREDICTOR_URL]")
@click.option("--api-key", default=None, help="Bearer key for the predictor.  [env KVPF_API_KEY]")
@click.option("--engine-url", "engine_urls", multiple=True, help="MODEL=http://HOST:PORT: an engine to read metrics from (pod id from its /kv_event_sources). Repeatable.")
@click.option("--pod-metrics", "pod_metrics", multiple=True, help="POD=http://HOST:PORT: that pod's engine. Repeatable.")
@click.option("--window", "window_s", default=60.0, show_default=True, type=click.FloatRange(min=0), help="Seconds between the two readings; 0: the totals since the counters started.")
@click.option("--html", "html_file", default=None, type=click.Path(dir_okay=False, path_type=Path), help="Write a self-contained HTML page here.")
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as JSON.")
def fleet(valkey_url, valkey_cluster, predictor_url, api_key, engine_urls, pod_metrics, window_s, html_file,
          as_json) -> None:
    """Per-pod hit rates, prefix families and their duplication, observed hit rate vs the round-robin bound."""
    import os

    from kv_preflight.config import Config
    from kv_preflight.index.index import VALKEY_ERRORS

    try:
        cfg = Config.load(valkey_url=valkey_url, valkey_cluster=valkey_cluster)
        result = asyncio.run(run_fleet(
            valkey_url=cfg.valkey_url, cluster=cfg.cluster_mode(), predictor_url=predictor_url or None,
            api_key=api_key or os.environ.get("KVPF_API_KEY"),
            pod_metrics=parse_pod_urls(pod_metrics) if pod_metrics else {},
            engine_urls=parse_model_urls(engine_urls) if engine_urls else {}, window_s=window_s,
            progress=lambda m: click.echo(m, err=True)))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except VALKEY_ERRORS as exc:
        raise click.ClickException(f"valkey: {type(exc).__name__}: {exc}{no_stack_hint('valkey_url')}") from None
    if html_file is not None:
        try:
            html_file.write_text(render_html(result))
        except OSError as exc:
            raise click.ClickException(f"cannot write {html_file}: {exc.strerror}") from None
    click.echo(msgspec.json.encode(result).decode() if as_json else render_fleet(result))

