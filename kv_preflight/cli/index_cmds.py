"""``kv-preflight index ...``: look inside the Valkey index, clear, rebuild, export and import it."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import click
import httpx

from kv_preflight.cli.stack_file import engine_and_model, no_stack_hint
from kv_preflight.config import Config
from kv_preflight.index.index import Index, StoreBlock, parse_entry
from kv_preflight.index.layout import LAYOUT_KEY, LAYOUT_VERSION
from kv_preflight.index.layout_version import LayoutError, check_layout
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.migrate import migrate as migrate_layout
from kv_preflight.index.transfer import (export_blocks, groups_of_row, groups_row, import_blocks, pod_groups,
                                        restore_seqs)
from kv_preflight.events import topic_or_none
from kv_preflight.engines.hit_rules import FULL, effective_groups, held_blocks, longest_hit, prefix_group


def _run(coro):
    try:
        return asyncio.run(coro)
    except BrokenPipeError:  # the reader left (`index export | head -2`): click stops quietly, as for any command
        raise
    except (OSError, ConnectionError) as exc:
        raise click.ClickException(f"cannot reach Valkey: {exc}{no_stack_hint('valkey_url')}") from None
    except LayoutError as exc:
        raise click.ClickException(str(exc)) from None
    except Exception as exc:  # redis errors and the like: one clear line, no traceback
        if exc.__class__.__module__.startswith("redis"):
            raise click.ClickException(f"Valkey error: {exc}{no_stack_hint('valkey_url')}") from None
        raise


def _unknown_pods(asked, known, where: str = "the index knows") -> None:
    """``--pod nope`` is an error naming it, not an empty success."""
    missing = sorted(set(asked) - set(known))
    if missing:
        names = ", ".join(sorted(known)[:10]) + (" ..." if len(known) > 10 else "")
        raise click.ClickException(f"unknown pod{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
                                   f"{where} {names or 'no pod'}")


def _emit(as_json: bool, data: Any, human) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def _config(**flags) -> Config:
    """Config.load with a bad value (flag or KVPF_*) as one clear line, naming the variable it came from."""
    try:
        return Config.load(**flags)
    except ValueError as exc:
        hint = no_stack_hint("valkey_url") if str(exc).startswith("valkey_url") else ""
        raise click.UsageError(f"{exc}{hint}") from None


def _index(valkey_url: str | None) -> Index:
    from kv_preflight.index.cluster import probe_cluster

    cfg = _config(valkey_url=valkey_url)
    timeout_s = max(cfg.valkey_timeout_s, 5.0)
    cluster = cfg.cluster_mode()
    if cluster is None:
        # asked here: a node that does not answer is taken for a single node without the service's warning,
        # and the first command then fails with the real cause (refused, auth) as the one error line
        cluster = bool(probe_cluster(cfg.valkey_url, timeout_s))
    return Index.from_url(cfg.valkey_url, timeout_s=timeout_s, entry_format=cfg.entry_format, cluster=cluster)


async def _open(valkey_url: str | None) -> Index:
    """The index, after checking it is of this kv-preflight's layout (else a clear error)."""
    ix = _index(valkey_url)
    try:
        await check_layout(ix.client)
    except BaseException:
        await ix.close()
        raise
    return ix


valkey_opt = click.option("--valkey-url", default=None, help="Valkey URL (any node of a cluster).  [env KVPF_VALKEY_URL]")
json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group("index")
def index_group() -> None:
    """Inspect and maintain the Valkey index."""


def _pod_row(p, now: float) -> dict[str, Any]:
    """A pod as GET /stats shows it (kv_preflight.predictor.stats.pod_stats: one naming for both), plus ``seq``, the
    name this command used before (same value as ``last_seq``), kept for scripts that read it."""
    from kv_preflight.predictor.stats import pod_stats

    return {**pod_stats(p, now), "seq": dict(sorted(p.seqs.items())), "orphan_keys": p.orphan_keys}


# What `index stats` counts, said beside the figures (its JSON names them as GET /stats does: docs/api.md)
EVENTS_NOTE = ("batches, stored, removed, cleared: what the engines' events did since each pod was first indexed "
               "(a block evicted and stored again is stored twice; a second copy of a held block counts too), so "
               "stored - removed exceeds blocks, the engine blocks held now, by the copies and what clears and "
               "restarts dropped")
INDEX_COUNTERS_NOTE = ("index-wide counters (kvpf:counters): events skipped or refused, never applied ones: "
                       "decode_errors, corrupt_batches, foreign_keys, apply_errors, frames_refused, "
                       "placeholder_events, data_losses")


def summary_of(rows: list[dict]) -> dict[str, Any]:
    """The /stats ``summary`` over pod rows: pods, incomplete pods, models, blocks, event counters."""
    from kv_preflight.predictor.stats import EVENT_COUNTERS

    indexed = [r for r in rows if r.get("last_seq") or r.get("blocks") or r.get("counters")]
    return {"pods": len(indexed), "incomplete_pods": sum(1 for r in indexed if r["incomplete"]),
            "models": len({r["model"] for r in indexed if r["model"]}),
            "blocks": sum(r["blocks"] for r in indexed),
            "counters": {c: sum((r.get("counters") or {}).get(c, 0) for r in indexed) for c in EVENT_COUNTERS}}


@index_group.command()
@valkey_opt
@click.option("--pod", "pod_id", default=None, help="Only this pod, as GET /stats?pod=NAME (an unknown pod is an error).")
@json_opt
def stats(valkey_url, pod_id, as_json) -> None:
    """Keys, memory, events applied and faults counted; per pod: blocks held, events applied, seq, last event
    age, fleet state, incomplete flag."""
    async def go():
        ix = await _open(valkey_url)
        try:
            now = time.time()
            keys, counters = await ix.key_count(), await ix.meta.counters()
            infos = await ix.meta.pods()
            view = await ix.fleet.fleet_view()
            if pod_id is not None:
                _unknown_pods([pod_id], {i.pod_id for i in infos} | set(view.pods))
            rows = _with_fleet([_pod_row(p, now) for p in infos], view)
            out = {"index_keys": keys, "used_memory_bytes": await ix.memory_usage(), "summary": summary_of(rows),
                   "pods": [r for r in rows if pod_id is None or r["pod_id"] == pod_id], "index_counters": counters,
                   "keys": keys, "counters": counters}  # /stats's names (index_keys, index_counters); keys and
            return out                                  # counters are the old aliases
        finally:
            await ix.close()

    def human(d):
        s = d["summary"]
        c = s["counters"]
        click.echo(f"keys: {d['keys']}   memory: {d['used_memory_bytes']} bytes   pods indexed: {s['pods']} "
                   f"({s['incomplete_pods']} incomplete)   blocks held: {s['blocks']}")
        click.echo(f"events applied, all pods: {c['batches']} batches, {c['stored']} blocks stored, {c['removed']} "
                   f"removed, {c['cleared']} cleared")
        counted = ", ".join(f"{k} {v}" for k, v in sorted(d["counters"].items()))
        click.echo(f"skipped or refused (index-wide): {counted or 'none'}")
        _pods_table(d["pods"])

    _emit(as_json, _run(go()), human)


POD_COLUMNS = ("block: the engine's KV block size in tokens; blocks: engine blocks held now; stored, removed: " +
               EVENTS_NOTE.split(": ", 1)[1] + "; seq: last seq applied per rank; age s: since its last event; "
               "fleet: its record (live, unreachable, retired); index: ok (exact) or INCOMPLETE and why. " +
               INDEX_COUNTERS_NOTE[0].upper() + INDEX_COUNTERS_NOTE[1:])


def _pods_table(pods: list[dict]) -> None:
    if not pods:
        click.echo("no pods in the index or the fleet records yet (an ingester reports its engines' pods within "
                   "seconds: `kv-preflight index ingesters`)")
        return
    click.echo(f"{'pod':<20} {'model':<24} {'block':>5} {'blocks':>8} {'stored':>8} {'removed':>8} {'seq':>10} "
               f"{'age s':>8}  {'fleet':<26} index")
    for p in pods:
        counted = p.get("counters") or {}
        seq = ",".join(f"{r}:{s}" for r, s in sorted(p["seq"].items())) or "-"
        state = "INCOMPLETE: " + p["incomplete_reason"] if p["incomplete"] else "ok"
        if p.get("orphan_keys") != 0:  # the lookup walks this pod rather than bisecting it
            state += f" (orphan keys: {'unknown' if p.get('orphan_keys') is None else p['orphan_keys']})"
        click.echo(f"{p['pod_id']:<20} {p['model'] or '-':<24} {p['engine_block_size'] or '-':>5} {p['blocks']:>8} "
                   f"{counted.get('stored', 0):>8} {counted.get('removed', 0):>8} {seq:>10} {p['last_event_age_s'] if p['last_event_age_s'] is not None else '-':>8}  "
                   f"{_fleet_cell(p.get('fleet')):<26} {state}")
    click.echo(f"\n({POD_COLUMNS})")


def _fleet_cell(fleet: dict | None) -> str:
    """live / unreachable since T / retired T ago, from the pod's fleet record (none: not discovered)."""
    if not fleet:
        return "-"
    if fleet["state"] == "live":
        return "live"
    return f"{fleet['state']} {fleet['for_s']:.0f} s"


def _with_fleet(rows: list[dict], view) -> list[dict]:
    """Pod rows with their fleet record: state, since when, why, engine, owning ingester. A pod with a record
    and nothing indexed yet (its engine has cached nothing) gets a row too: `up` reported two engines and
    `index pods` said "no pods in the index"."""
    have = {row["pod_id"] for row in rows}
    for pod, rec in sorted(view.pods.items()):
        if pod not in have:
            rows.append({"pod_id": pod, "model": (rec.models or [""])[0], "engine_block_size": rec.block_size or None,
                         "blocks": 0, "seq": {}, "last_seq": {}, "last_event_age_s": None, "incomplete": False,
                         "incomplete_reason": "", "orphan_keys": 0, "counters": {}})
    rows.sort(key=lambda r: r["pod_id"])
    for row in rows:
        rec = view.pods.get(row["pod_id"])
        row["fleet"] = None if rec is None else {
            "state": rec.state, "for_s": round(max(0, view.now_ms - rec.since_ms) / 1000, 1), "reason": rec.reason,
            "engine_url": rec.engine_url, "models": rec.models, "owner": rec.owner,
            "load_age_s": view.load_age_s(row["pod_id"])}
    return rows


@index_group.command()
@valkey_opt
@json_opt
def pods(valkey_url, as_json) -> None:
    """The pods the index knows."""
    async def go():
        ix = await _open(valkey_url)
        try:
            now = time.time()
            return _with_fleet([_pod_row(p, now) for p in await ix.meta.pods()], await ix.fleet.fleet_view())
        finally:
            await ix.close()

    _emit(as_json, _run(go()), _pods_table)


@index_group.command()
@valkey_opt
@json_opt
def ingesters(valkey_url, as_json) -> None:
    """The ingesters sharing this index: lease, the engines each ingests, and how long since each pod's
    last applied batch (docs/fleet.md)."""
    async def go():
        ix = await _open(valkey_url)
        try:
            view = await ix.fleet.fleet_view()
        finally:
            await ix.close()
        return [{"ingester": i, "live": lease.expires_ms > view.now_ms, "host": lease.host,
                 "up_s": round((view.now_ms - lease.started_ms) / 1000, 1) if lease.started_ms else None,
                 "lease_left_s": round((lease.expires_ms - view.now_ms) / 1000, 1), "engines": lease.engines,
                 "known_engines": len(lease.known), "lag_s": lease.lag_s, "private": lease.private}
                for i, lease in sorted(view.ingesters.items())]

    def human(rows):
        if not rows:
            click.echo("no ingester holds a lease on this index")
            return
        for r in rows:
            click.echo(f"{r['ingester']}  {'live' if r['live'] else 'EXPIRED'}  up {r['up_s']} s  lease "
                       f"{r['lease_left_s']} s  ingests {len(r['engines'])} of {r['known_engines']} known engine(s)"
                       + ("  (private: outside the fleet's sharing)" if r["private"] else ""))
            for url in r["engines"]:
                click.echo(f"    {url}")
            if r["lag_s"]:
                worst = sorted(r["lag_s"].items(), key=lambda kv: -kv[1])[:5]
                click.echo("    since last batch: " + ", ".join(f"{p} {s} s" for p, s in worst))

    _emit(as_json, _run(go()), human)


@index_group.command()
@valkey_opt
@click.option("--model", default=None, help="Model name as llm-d hashes it (default: the running `up` stack's, else the one model the fleet serves).  [env KVPF_MODEL]")
@click.option("--tokens", "tokens_spec", default=None, help="JSON list of token ids, or @file.")
@click.option("--prompt", default=None, help="Text, tokenized by --engine-url.")
@click.option("--engine-url", default=None, help="Engine to tokenize --prompt with (default: the running `up` stack's, else a live engine of the fleet serving --model).")
@click.option("--hash-seed", default=None)
@click.option("--block-size", default=None, type=click.IntRange(min=1))
@click.option("--group-spec", "group_specs", multiple=True, help="MODEL:GROUP=KIND[/chunk=N]...: a hybrid model's KV cache group the events do not describe (as serve --group-spec).")
@json_opt
def inspect(valkey_url, model, tokens_spec, prompt, engine_url, hash_seed, block_size, group_specs, as_json) -> None:
    """Per block of a prompt: its key, which pods, tiers and KV cache groups hold it, where each pod's chain
    breaks, and the tokens each pod's engine reuses (a hybrid model: every group's rule, as /predict)."""
    from kv_preflight.cli.token_input import read_tokens
    from kv_preflight.engines import DEFAULT, engine
    from kv_preflight.keys.chain import request_keys

    if (tokens_spec is None) == (prompt is None):
        raise click.UsageError("give exactly one of --tokens or --prompt")
    model, engine_url = engine_and_model(model, engine_url, need_engine=prompt is not None,
                                         valkey_url=_config(valkey_url=valkey_url).valkey_url)
    if prompt is not None:
        try:
            adapter = engine(DEFAULT)  # --engine-url names an engine of the default family
            r = httpx.post(engine_url.rstrip("/") + adapter.tokenize_path, json=adapter.tokenize_body(model, prompt=prompt),
                           timeout=10)
            r.raise_for_status()
            tokens = r.json()["tokens"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise click.ClickException(f"tokenizing with {engine_url} failed: {exc}") from None
    else:
        tokens = read_tokens(tokens_spec)
    from kv_preflight.config import parse_group_specs

    try:
        specs = parse_group_specs(group_specs) if group_specs else None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    cfg = _config(valkey_url=valkey_url, hash_seed=hash_seed, block_size=block_size, group_specs=specs)
    try:
        keys = request_keys(tokens, model=model, hash_seed=cfg.hash_seed, block_size=cfg.block_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None

    async def go():
        ix = await _open(valkey_url)
        try:
            fields = await ix.fields_per_key(keys, stop_at_gap=False) if keys else []
            pods = sorted({e.PodIdentifier for fl in fields for e in map(parse_entry, fl) if e is not None})
            return fields, {i.pod_id: i for i in await ix.meta.scoring_infos(pods)}
        finally:
            await ix.close()

    fields, infos = _run(go())
    declared = cfg.group_specs.get(model)
    hybrid = {p: g for p, i in infos.items() if (g := effective_groups(i.groups, declared))}
    held: dict[tuple[str, int], set[int]] = {}  # (pod, group) -> request keys held there (any tier)
    blocks, alive, breaks = [], None, {}
    for i, (key, fl) in enumerate(zip(keys, fields)):
        holders = [e for e in (parse_entry(f) for f in fl) if e is not None]
        for e in holders:
            if not e.Speculative:
                held.setdefault((e.PodIdentifier, e.GroupIdx), set()).add(i)
        # a hybrid pod's chain is its prefix group's (full attention); its other groups are read beside
        pods_here = {e.PodIdentifier for e in holders if not e.Speculative
                     and (e.PodIdentifier not in hybrid or e.GroupIdx == prefix_group(hybrid[e.PodIdentifier]))}
        if alive is None:
            alive = set(pods_here)
        for p in sorted(alive - pods_here):
            breaks[p] = i
        alive &= pods_here
        blocks.append({"block": i, "tokens": [i * cfg.block_size, (i + 1) * cfg.block_size], "key": str(key),
                       "holders": [{"pod_id": e.PodIdentifier, "tier": e.DeviceTier, "speculative": e.Speculative}
                                   | ({"group": e.GroupIdx} if e.HasGroup else {}) for e in holders]})
    for p in alive or ():
        breaks[p] = len(keys)
    reused = {}
    for p, n in breaks.items():
        ebs = (infos[p].engine_block_size if p in infos else None) or cfg.block_size
        groups = hybrid.get(p)
        if groups is None:  # one group: whole engine blocks of the chain, the last prompt token recomputed
            reused[p] = min(n * cfg.block_size // ebs * ebs, max(len(tokens) - 1, 0) // ebs * ebs)
            continue
        pg = prefix_group(groups)

        def has(g: int, k: int, p=p, n=n, pg=pg) -> bool:
            return k < n if g == pg else k in held.get((p, g), ())

        reused[p] = longest_hit(groups, held_blocks(groups, has, cfg.block_size, ebs), len(tokens), ebs)
    data = {"model": model, "tokens": len(tokens), "blocks": blocks,
            "prefix_blocks_per_pod": dict(sorted(breaks.items(), key=lambda kv: -kv[1])),
            "cached_tokens_per_pod": dict(sorted(reused.items(), key=lambda kv: -kv[1])),
            "groups_per_pod": {p: {str(g): s.kind for g, s in sorted(gs.items())} for p, gs in sorted(hybrid.items())}}

    def human(d):
        click.echo(f"{d['tokens']} tokens, {len(d['blocks'])} full blocks of {cfg.block_size}")
        for b in d["blocks"]:
            who = ", ".join(f"{h['pod_id']}@{h['tier']}" + ("[spec]" if h["speculative"] else "") for h in b["holders"]) or "-"
            click.echo(f"  #{b['block']:<5} {b['key']:>20}  {who}")
        for p, n in d["prefix_blocks_per_pod"].items():
            kinds = d["groups_per_pod"].get(p)
            click.echo(f"  {p}: chain holds {n} block(s)" + ("" if n == len(d["blocks"]) else f", breaks at block #{n}")
                       + f"; the engine reuses {d['cached_tokens_per_pod'][p]} tokens"
                       + (f" (KV cache groups {', '.join(f'{g}={k}' for g, k in kinds.items())})" if kinds else ""))

    _emit(as_json, data, human)


@index_group.command()
@valkey_opt
@click.option("--pod", "pod_id", required=True)
@click.option("--forget", is_flag=True, help="Also drop the pod's metadata (seq, counters).")
@json_opt
def clear(valkey_url, pod_id, forget, as_json) -> None:
    """Remove every entry of one pod, in time proportional to its blocks."""
    async def go():
        ix = await _open(valkey_url)
        try:
            _unknown_pods([pod_id], await ix.meta.pod_ids())
            if forget:  # every ingester lets it go first, so no batch in flight brings it back unlisted
                from kv_preflight.fleet.lifecycle import forget_pods
                return (await forget_pods(ix, [pod_id], keep_refusing=False))[pod_id]
            n = await ix.clear_pod(pod_id)
            if not forget:  # the engine still holds those blocks: say so until it resets
                await ix.meta.mark_incomplete(pod_id, "cleared by hand (index clear): the engine may still hold blocks "
                                                 "the index no longer lists; exact again at its next reset")
            return n
        finally:
            await ix.close()

    n = _run(go())
    _emit(as_json, {"pod_id": pod_id, "blocks_removed": n}, lambda d: click.echo(f"removed {n} block(s) of {pod_id}"))


@index_group.command("export")
@valkey_opt
@click.option("--pod", "pod_ids", multiple=True, help="Pod to export (repeatable; default all).")
@click.option("-o", "--output", type=click.File("w"), default="-", show_default=True)
def export_cmd(valkey_url, pod_ids, output) -> None:
    """Write pods' entries as JSON lines: one pod line (its model, block size, seqs and KV cache groups), then one
    line per engine block."""
    async def go():
        ix = await _open(valkey_url)
        total = 0
        try:
            known = await ix.meta.pod_ids()
            _unknown_pods(pod_ids, known)
            for pod_id in pod_ids or sorted(known):
                info = await ix.meta.pod_info(pod_id)
                head = {"pod": pod_id, "model": info.model, "engine_block_size": info.engine_block_size,
                        "seqs": info.seqs}
                groups = await pod_groups(ix.writer, pod_id)
                if any(s.kind != FULL for s in groups.values()) or len(groups) > 1:
                    head["groups"] = groups_row(groups)  # else plain: one full-attention group says nothing
                output.write(json.dumps(head) + "\n")
                async for s in export_blocks(ix.writer, pod_id):
                    row = {"pod": pod_id, "engine_key": str(s.engine_key), "tier": s.tier,
                           "entry": s.entry_field, "request_keys": [str(k) for k in s.request_keys]}
                    if s.group:
                        row["group"] = s.group
                    if s.parent is not None:  # the request key before the first ("" the chain root)
                        row["parent"] = "" if s.parent == CHAIN_ROOT else str(s.parent)
                    output.write(json.dumps(row) + "\n")
                    total += 1
                    if total % 10_000 == 0:
                        click.echo(f"exported {total} blocks ...", err=True)
        finally:
            await ix.close()
        click.echo(f"exported {total} block(s)", err=True)

    _run(go())


@index_group.command("import")
@valkey_opt
@click.option("-i", "--input", "source", type=click.File("r"), default="-", show_default=True)
@click.option("--replace", is_flag=True, help="Clear a pod's entries before importing it (else a pod that has entries is refused).")
@click.option("--exact", is_flag=True, help="Do not flag imported pods incomplete (only when the engines have not changed since the export).")
@json_opt
def import_cmd(valkey_url, source, replace, exact, as_json) -> None:
    """Load JSON lines written by ``index export``: every record is checked first, a pod that already
    has entries is refused (``--replace`` clears it first), the exported seqs are restored, and each
    pod is flagged incomplete (its engine may have moved on since the export) until its next reset."""
    rows = _read_export(source)

    async def go():
        ix = await _open(valkey_url)
        counts: dict[str, int] = {}
        try:
            for pod, (meta, blocks) in rows.items():
                held = (await ix.meta.pod_info(pod)).blocks
                if held and not replace:
                    raise click.ClickException(f"pod {pod} already has {held} block(s) in the index: importing over "
                                               "them would count copies twice; --replace clears them first")
                if held:
                    await ix.clear_pod(pod)
                for i in range(0, len(blocks), 500):
                    await import_blocks(ix, pod, meta.get("model", ""), meta.get("engine_block_size"), blocks[i:i + 500],
                                        groups_of_row(meta.get("groups")))
                await restore_seqs(ix.client, pod, meta.get("seqs") or {})
                if not exact:
                    await ix.meta.mark_incomplete(pod, "imported from an export: the engine may have changed since; "
                                                  "exact again at its next reset")
                counts[pod] = len(blocks)
        finally:
            await ix.close()
        return counts

    counts = _run(go())
    _emit(as_json, {"imported_blocks": counts},
          lambda d: click.echo("imported " + (", ".join(f"{p}: {n}" for p, n in counts.items()) or "nothing")))


def _read_export(source) -> dict[str, tuple[dict, list[StoreBlock]]]:
    """Every line of an export, checked before anything is written: pod -> (its header, its blocks)."""
    out: dict[str, tuple[dict, list[StoreBlock]]] = {}
    for n, line in enumerate(source, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pod = row["pod"]
            if not isinstance(pod, str) or not pod:
                raise ValueError("pod must be a non-empty string")
            meta, blocks = out.setdefault(pod, ({}, []))
            if "engine_key" not in row:
                seqs = row.get("seqs") or {}
                if not all(str(r).isdigit() and isinstance(v, int) and 0 <= v < 2**63 for r, v in seqs.items()):
                    raise ValueError("seqs must map dp ranks to non-negative integers")
                groups_of_row(row.get("groups"))  # checked here, before anything is written
                meta.update(row)
                continue
            entry = parse_entry(row["entry"])
            if entry is None or entry.PodIdentifier != pod:
                raise ValueError(f"entry {str(row['entry'])[:80]!r} is not a PodEntry of pod {pod!r}")
            keys = tuple(int(k) for k in row["request_keys"])
            ek = int(row["engine_key"])
            if not (0 <= ek < 2**64) or not all(0 <= k < 2**64 for k in keys) or not keys:
                raise ValueError("engine and request keys must be unsigned 64-bit integers, at least one request key")
            if not isinstance(row["tier"], str) or not row["tier"]:
                raise ValueError("tier must be a non-empty string")
            parent = row.get("parent")  # absent (an older export): the pod's orphan count is unknown
            if parent is not None and not (isinstance(parent, str) and (parent == "" or (parent.isdigit() and int(parent) < 2**64))):
                raise ValueError('parent must be a request key, or "" for the chain root')
            blocks.append(StoreBlock(ek, row["tier"], row["entry"], keys, int(row.get("group") or 0),
                                     parent=None if parent is None else int(parent) if parent else CHAIN_ROOT))
        except (ValueError, KeyError, TypeError) as exc:
            raise click.ClickException(f"line {n}: not an export row ({exc}); nothing was imported") from None
    return out


@index_group.command()
@valkey_opt
@click.option("--engine", "engines", multiple=True, required=True, help="Engine HTTP URL (its /kv_event_sources). Repeatable.")
@click.option("--pod", "only_pods", multiple=True, help="Rebuild only these pods (default: every pod the engines publish).")
@click.option("--hash-seed", default=None)
@click.option("--block-size", default=None, type=click.IntRange(min=1))
@json_opt
def rebuild(valkey_url, engines, only_pods, hash_seed, block_size, as_json) -> None:
    """Wipe pods and re-ingest them from the engines' replay buffers, from seq 0."""
    from kv_preflight.ingester.ingester import Ingester
    from kv_preflight.ingester.discovery import discover
    from kv_preflight.ingester.replay import fetch_replay

    cfg = _config(valkey_url=valkey_url, hash_seed=hash_seed, block_size=block_size, replay_timeout_s=5.0)

    async def go():
        ix = await _open(valkey_url)
        report = []
        try:
            ing = Ingester(cfg, ix, [])
            found = []  # every engine is asked first: a --pod no engine publishes wipes nothing
            for url in engines:
                try:
                    found += [(url, src) for src in await discover(url)]
                except httpx.HTTPError as exc:
                    raise click.ClickException(f"{url}/kv_event_sources: {exc}") from None
            def topic_of(src):
                return src.named_topic or topic_or_none(src.topic)  # SGLang: named by its server address

            _unknown_pods(only_pods, {t.pod_id for _, src in found if (t := topic_of(src)) is not None},
                          "the engines publish")
            for url, src in found:
                topic = topic_of(src)
                if not src.replay or topic is None:
                    click.echo(f"{url}: no replay endpoint, or no kv@POD@MODEL topic; skipped", err=True)
                    continue
                pod, model = topic.pod_id, topic.model
                if only_pods and pod not in only_pods:
                    continue
                click.echo(f"{pod}: fetching the replay buffer from {src.replay} ...", err=True)
                frames, complete = await fetch_replay(src.replay, 0, timeout_s=cfg.replay_timeout_s, source=src)
                frames = sorted((f for f in frames if f.batch is not None and f.seq is not None), key=lambda f: f.seq)
                await ix.clear_pod(pod, forget=True)
                for i, f in enumerate(frames, 1):
                    await ing.applier.apply(pod, model, f.seq, f.batch, allow_replay=False, decode_errors=len(f.errors))
                    if i % 1000 == 0:
                        click.echo(f"{pod}: applied {i}/{len(frames)} batches", err=True)
                info = await ix.meta.pod_info(pod)
                first = frames[0].seq if frames else None
                report.append({"pod_id": pod, "batches": len(frames), "first_seq": first,
                               "last_seq": frames[-1].seq if frames else None,
                               "covers_full_history": first == 0 and complete,
                               "blocks": info.blocks, "incomplete": info.incomplete})
        finally:
            await ix.close()
        return report

    def human(rows):
        for r in rows:
            cover = "full history" if r["covers_full_history"] else f"history from seq {r['first_seq']} only (pod marked incomplete)"
            click.echo(f"{r['pod_id']}: {r['batches']} batch(es), {cover}; {r['blocks']} block(s) indexed")

    _emit(as_json, _run(go()), human)


__all__ = ["index_group", "sys"]


MIGRATE_HELP = f"""Move an index of layout 1 (kv-preflight 0.1), 2 or 3 to layout {LAYOUT_VERSION}, pod by pod.

    Stop every ingester of the index first: it refuses to run while one holds a live lease (--force runs it
    anyway). Request keys and engine keys do not change, so an llm-d scheduler on the same Valkey sees
    nothing happen. Safe to run again if interrupted; on an index already of layout {LAYOUT_VERSION} it does
    nothing.
    """


@index_group.command(help=MIGRATE_HELP)
@valkey_opt
@click.option("--force", is_flag=True, help="Run although ingesters hold live leases on the index (they would go on writing the old layout beside the new one).")
@json_opt
def migrate(valkey_url, force, as_json) -> None:
    async def go():
        ix = _index(valkey_url)
        try:
            found = await ix.client.hget(LAYOUT_KEY, "version")
            version = found.decode() if isinstance(found, bytes) else found
            if version == LAYOUT_VERSION:
                return {"pods": 0, "blocks": 0, "keys": 0}, True
            live = await _live_ingesters(ix)
            if live and not force:
                raise click.ClickException(
                    f"{len(live)} ingester(s) hold a live lease on this index ({', '.join(live[:5])}"
                    f"{' ...' if len(live) > 5 else ''}): stop them first (they write layout {version or '1'}), "
                    "or give --force")

            def progress(pod: str, n: int) -> None:
                click.echo(f"  {pod}: {n} done", err=True)
            return await migrate_layout(ix.client, progress=progress), False
        finally:
            await ix.close()

    done, already = _run(go())

    def human(d):
        if already:
            click.echo(f"this index is already of layout {LAYOUT_VERSION}: nothing to migrate")
            return
        click.echo(f"migrated {d['pods']} pod(s), {d['blocks']} block(s); presence for {d['keys']} request "
                   f"key(s): layout {LAYOUT_VERSION}")

    _emit(as_json, done, human)


async def _live_ingesters(ix: Index) -> list[str]:
    """The ingesters whose lease on the index has not expired; [] when the leases cannot be read (an old
    layout's records)."""
    try:
        view = await ix.fleet.fleet_view()
    except Exception:  # a record of another layout's form: the layout check is the user's word then
        return []
    return sorted(i for i, lease in view.ingesters.items() if lease.expires_ms > view.now_ms)
