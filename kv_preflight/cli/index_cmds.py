"""``kv-preflight index ...``: look inside the Valkey index (stats, pods, ingesters, inspect) and clear a pod; export,
import, rebuild and migrate are in index_maintenance.py."""
from __future__ import annotations

import time
from typing import Any

import click
import httpx

from kv_preflight.cli.index_common import _config, _emit, _open, _run, _unknown_pods, json_opt, valkey_opt
from kv_preflight.cli.index_maintenance import export_cmd, import_cmd, migrate, rebuild
from kv_preflight.cli.stack_file import engine_and_model
from kv_preflight.engines.hit_rules import effective_groups, held_blocks, longest_hit, prefix_group
from kv_preflight.index.index import parse_entry


@click.group("index")
def index_group() -> None:
    """Inspect and maintain the Valkey index."""


def _pod_row(p, now: float) -> dict[str, Any]:
    """A pod as GET /stats shows it (kv_preflight.predictor.stats.pod_stats: one naming for both), plus ``seq``, the
    name this command used before (same value as ``last_seq``), kept for scripts that read it."""
    from kv_preflight.predictor.stats import pod_stats

    return {**pod_stats(p, now), "seq": dict(sorted(p.seqs.items())), "orphan_keys": p.orphan_keys}


# What `index stats` counts, said beside the figures (its JSON names them as GET /stats does: docs/api.md)
EVENTS_NOTE = ("Stored and removed count what a pod's events stored and removed since it was first indexed, so a "
               "block evicted and stored again counts twice. Stored minus removed can exceed blocks: a second copy "
               "of a held block counts as stored, and a clear or an engine restart drops blocks without counting "
               "them as removed.")
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
        async with _open(valkey_url) as ix:
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


POD_COLUMNS = ("block: the engine's KV block size in tokens; blocks: engine blocks held now; seq: last seq applied "
               "per rank; age s: since its last event; fleet: its record (live, unreachable, retired); index: ok "
               "(exact) or INCOMPLETE and why. " + EVENTS_NOTE + " " +
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
        async with _open(valkey_url) as ix:
            now = time.time()
            return _with_fleet([_pod_row(p, now) for p in await ix.meta.pods()], await ix.fleet.fleet_view())

    _emit(as_json, _run(go()), _pods_table)


@index_group.command()
@valkey_opt
@json_opt
def ingesters(valkey_url, as_json) -> None:
    """The ingesters sharing this index: lease, the engines each ingests, and how long since each pod's
    last applied batch (docs/fleet.md)."""
    async def go():
        async with _open(valkey_url) as ix:
            view = await ix.fleet.fleet_view()
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
        async with _open(valkey_url) as ix:
            fields = await ix.fields_per_key(keys, stop_at_gap=False) if keys else []
            pods = sorted({e.PodIdentifier for fl in fields for e in map(parse_entry, fl) if e is not None})
            return fields, {i.pod_id: i for i in await ix.meta.scoring_infos(pods)}

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
@click.option("--scan", is_flag=True,
              help="For a pod whose state log does not read (docs/operations.md): find its entries without the log, "
                   "by scanning every request key and engine key of the index (every primary of a cluster), in time "
                   "proportional to the whole index; remove its llm-d entries and presence bits, never another pod's; "
                   "then start its log anew, flagged as a clear leaves it. Progress on stderr. Refused for a pod "
                   "whose state log reads; safe to interrupt and run again.")
@json_opt
def clear(valkey_url, pod_id, forget, scan, as_json) -> None:
    """Remove every entry of one pod, in time proportional to its blocks.

    With --scan, of a pod whose state log does not read, in time proportional to the whole index."""
    if scan:
        _clear_by_scan(valkey_url, pod_id, forget, as_json)
        return

    async def go():
        async with _open(valkey_url) as ix:
            _unknown_pods([pod_id], await ix.meta.pod_ids())
            if forget:  # every ingester lets it go first, so no batch in flight brings it back unlisted
                from kv_preflight.index.lifecycle import forget_pods
                return (await forget_pods(ix, [pod_id], keep_refusing=False))[pod_id]
            # the engine still holds those blocks: say so until it resets; flagged first, so a clearing that fails
            # after its pod step ("try again": its changes left to another drain) leaves the pod flagged too
            await ix.meta.mark_incomplete(pod_id, "cleared by hand (index clear): the engine may still hold blocks "
                                             "the index no longer lists; exact again at its next reset")
            return await ix.clear_pod(pod_id)

    n = _run(go())
    _emit(as_json, {"pod_id": pod_id, "blocks_removed": n}, lambda d: click.echo(f"removed {n} block(s) of {pod_id}"))


def _clear_by_scan(valkey_url, pod_id: str, forget: bool, as_json: bool) -> None:
    """``index clear --scan``: kv_preflight/index/scan_clear.py, with its progress on stderr."""
    from kv_preflight.index.scan_clear import LogReads, Moved, ScanTally, clear_by_scan

    def progress(t: ScanTally) -> None:
        click.echo(f"{pod_id}: {t.request_keys_scanned} request key(s) scanned (of {t.keys_total} keys in the index), "
                   f"{t.engine_keys_scanned} engine key(s); {t.fields_removed} entry field(s) removed, "
                   f"{t.bits_cleared} bit(s) cleared so far", err=True)

    async def go():
        async with _open(valkey_url) as ix:
            _unknown_pods([pod_id], await ix.meta.pod_ids())
            try:
                tally = await clear_by_scan(ix, pod_id, progress=progress)
            except (LogReads, Moved) as exc:
                raise click.ClickException(str(exc)) from None
            if forget:  # its log reads now: forgotten as any pod is
                from kv_preflight.index.lifecycle import forget_pods
                await forget_pods(ix, [pod_id], keep_refusing=False)
            return tally

    t = _run(go())
    _emit(as_json, t.as_dict(), lambda d: click.echo(
        f"removed {t.fields_removed} entry field(s) and {t.bits_cleared} presence bit(s) of {pod_id} from "
        f"{t.keys_held} of {t.request_keys_scanned} request key(s) scanned; {t.engine_members_removed} request key(s) "
        f"pruned from {t.engine_keys_scanned} engine key(s) scanned; its state log started anew"
        + (", the pod forgotten" if forget else ", the pod flagged until its engine's next reset")))


for _command in (export_cmd, import_cmd, rebuild, migrate):
    index_group.add_command(_command)

__all__ = ["index_group"]
