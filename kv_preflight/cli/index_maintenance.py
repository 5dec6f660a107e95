"""``kv-preflight index export|import|rebuild|migrate``: move a pod's entries out and in, rebuild pods from their
engines' replay buffers, migrate an older layout."""
from __future__ import annotations

import json

import click
import httpx

from kv_preflight.cli.index_common import _config, _emit, _index, _open, _run, _unknown_pods, json_opt, valkey_opt
from kv_preflight.engines.hit_rules import FULL
from kv_preflight.events import topic_or_none
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.fleet_store import FleetStore
from kv_preflight.index.index import StoreBlock, parse_entry
from kv_preflight.index.layout import LAYOUT_KEY, LAYOUT_VERSION
from kv_preflight.index.migrate import migrate as migrate_layout
from kv_preflight.index.transfer import (export_blocks, groups_of_row, groups_row, import_blocks, pod_groups,
                                        restore_seqs)
@click.command("export")
@valkey_opt
@click.option("--pod", "pod_ids", multiple=True, help="Pod to export (repeatable; default all).")
@click.option("-o", "--output", type=click.File("w"), default="-", show_default=True)
def export_cmd(valkey_url, pod_ids, output) -> None:
    """Write pods' entries as JSON lines: one pod line (its model, block size, seqs, KV cache groups and LoRA
    adapters), then one line per engine block."""
    async def go():
        total = 0
        async with _open(valkey_url) as ix:
            known = await ix.meta.pod_ids()
            _unknown_pods(pod_ids, known)
            adapters = await ix.meta.adapters()
            for pod_id in pod_ids or sorted(known):
                info = await ix.meta.pod_info(pod_id)
                head = {"pod": pod_id, "model": info.model, "engine_block_size": info.engine_block_size,
                        "seqs": info.seqs}
                if adapters.get(pod_id):  # its LoRA adapters (kvpf:adapters): without them an adapter's model is unknown
                    head["adapters"] = sorted(adapters[pod_id])
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
        click.echo(f"exported {total} block(s)", err=True)

    _run(go())


@click.command("import")
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
        counts: dict[str, int] = {}
        async with _open(valkey_url) as ix:
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
                if meta.get("adapters"):
                    await ix.register_adapters({(pod, a): meta.get("model", "") for a in meta["adapters"]})
                if not exact:
                    await ix.meta.mark_incomplete(pod, "imported from an export: the engine may have changed since; "
                                                  "exact again at its next reset")
                counts[pod] = len(blocks)
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
                adapters = row.get("adapters", [])
                if not isinstance(adapters, list) or not all(isinstance(a, str) and a and "\t" not in a
                                                             for a in adapters):
                    raise ValueError("adapters must be a list of adapter names (non-empty, no tab)")
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


@click.command()
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
        report = []
        async with _open(valkey_url) as ix:
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
        return report

    def human(rows):
        for r in rows:
            cover = "full history" if r["covers_full_history"] else f"history from seq {r['first_seq']} only (pod marked incomplete)"
            click.echo(f"{r['pod_id']}: {r['batches']} batch(es), {cover}; {r['blocks']} block(s) indexed")

    _emit(as_json, _run(go()), human)


MIGRATE_HELP = f"""Move an index of layout 1 (kv-preflight 0.1), 2 or 3 to layout {LAYOUT_VERSION}, pod by pod.

    Stop every ingester of the index first: it refuses to run while one holds a live lease (--force runs it
    anyway). Request keys and engine keys do not change, so an llm-d scheduler on the same Valkey sees
    nothing happen. Safe to run again if interrupted; on an index already of layout {LAYOUT_VERSION} it does
    nothing.
    """


@click.command(help=MIGRATE_HELP)
@valkey_opt
@click.option("--force", is_flag=True, help="Run although ingesters hold live leases on the index (they would go on writing the old layout beside the new one).")
@json_opt
def migrate(valkey_url, force, as_json) -> None:
    async def go():
        async with _index(valkey_url) as ix:
            found = await ix.client.hget(LAYOUT_KEY, "version")
            version = found.decode() if isinstance(found, bytes) else found
            if version == LAYOUT_VERSION:
                return {"pods": 0, "blocks": 0, "keys": 0}, True
            live = await _live_ingesters(ix.fleet)
            if live and not force:
                raise click.ClickException(
                    f"{len(live)} ingester(s) hold a live lease on this index ({', '.join(live[:5])}"
                    f"{' ...' if len(live) > 5 else ''}): stop them first (they write layout {version or '1'}), "
                    "or give --force")

            def progress(pod: str, n: int) -> None:
                click.echo(f"  {pod}: {n} done", err=True)
            return await migrate_layout(ix.client, progress=progress), False

    done, already = _run(go())

    def human(d):
        if already:
            click.echo(f"this index is already of layout {LAYOUT_VERSION}: nothing to migrate")
            return
        click.echo(f"migrated {d['pods']} pod(s), {d['blocks']} block(s); presence for {d['keys']} request "
                   f"key(s): layout {LAYOUT_VERSION}")

    _emit(as_json, done, human)


async def _live_ingesters(store: FleetStore) -> list[str]:
    """The ingesters whose lease on the index has not expired; [] when the leases cannot be read (an old
    layout's records)."""
    try:
        view = await store.fleet_view()
    except Exception:  # a record of another layout's form: the layout check is the user's word then
        return []
    return sorted(i for i, lease in view.ingesters.items() if lease.expires_ms > view.now_ms)


__all__ = ["export_cmd", "import_cmd", "migrate", "rebuild"]
