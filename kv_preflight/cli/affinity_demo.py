"""``up --demo`` with two or more engines: the same kind of workload round robin and through ``/v1/cache/route``,
both hit rates as the engines report them, then one ``explain`` of a round-robin miss.

Round robin sends a prefix family's repeats to whichever engine is next, so a repeat finds its prefix
only on the engine that ran it before; ``/route`` sends it where the index says it is cached. The
hit rates are the engines' own ``usage.prompt_tokens_details.cached_tokens`` over the prompt tokens,
not the predictor's estimate. Two workloads with the same shape and different tokens keep the
phases from helping each other. See docs/explain.md.
"""
from __future__ import annotations

import random

import click
import httpx

from kv_preflight.cli.accuracy import EventWatcher, _send, pod_of, wait_caught_up
from kv_preflight.cli.explain_cmd import render


WORDS = ("cache", "prefix", "block", "token", "engine", "router", "pod", "model", "prompt", "layer", "query",
         "answer", "report", "summary", "context", "window", "budget", "latency", "replica", "fleet")


def family_workload(seed: int, families: int = 3, repeats: int = 4, words: int = 60) -> list[dict]:
    """``families`` text prefixes, each sent ``repeats`` times with a short new question, interleaved
    (f0, f1, f2, f0, ...). Text, so the engine tokenizes it as it would a client's (BOS and all)."""
    rng = random.Random(seed)
    prefixes = [f"Document {seed}-{f}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for f in range(families)]
    return [{"prompt": f"{prefixes[f]}\nQuestion {r}: " + " ".join(rng.choice(WORDS) for _ in range(4)) + "?",
             "family": f} for r in range(repeats) for f in range(families)]


def _caught_up(predictor_url: str, watchers: list[EventWatcher | None]) -> None:
    for w in watchers:
        wait_caught_up(predictor_url, w)


def print_affinity_demo(engine_urls: list[str], predictor_url: str, model: str) -> dict:
    pods = {pod_of(u): u for u in engine_urls}
    watchers = [EventWatcher.for_engine(u) for u in engine_urls]
    n = len(engine_urls)
    click.echo(f"demo: prefix families over {n} engines, round robin and through /v1/cache/route\n")
    out: dict = {}
    try:
        with httpx.Client(timeout=30) as client:
            sent = cached = 0
            ran: dict[int, set[str]] = {}
            explained = None
            for i, req in enumerate(family_workload(seed=11)):
                url = engine_urls[i % n]
                held = ran.setdefault(req["family"], set())
                if explained is None and held and url not in held:
                    # a repeat about to land where its prefix is not: ask why, before it is sent
                    _caught_up(predictor_url, watchers)
                    explained = (next((p for p, u in pods.items() if u == url), url), client.post(
                        predictor_url.rstrip("/") + "/v1/cache/explain",
                        json={"model": model, "prompt": req["prompt"], "pods": sorted(pods)}).json())
                tokens, hit = _send(client, url, model, req)
                held.add(url)
                sent, cached = sent + tokens, cached + hit
            out["round_robin"] = cached / sent if sent else 0.0
            sent = cached = 0
            for req in family_workload(seed=12):
                _caught_up(predictor_url, watchers)
                d = client.post(predictor_url.rstrip("/") + "/v1/cache/route",
                                json={"model": model, "prompt": req["prompt"]}).json()
                url = pods.get(d.get("pod_id"), engine_urls[0])
                tokens, hit = _send(client, url, model, req)
                sent, cached = sent + tokens, cached + hit
            out["route"] = cached / sent if sent else 0.0
            click.echo(f"  round robin:       {out['round_robin']:.1%} of prompt tokens cached (engines' own count)")
            click.echo(f"  /v1/cache/route:   {out['route']:.1%}\n")
            if explained is not None:
                pod, doc = explained
                click.echo(f"  a round-robin repeat sent to {pod}, explained just before (kv-preflight explain):")
                click.echo("    " + render(doc).replace("\n", "\n    "))
                if not doc.get("findings") and doc.get("best_pod") and doc["best_pod"] != pod:
                    click.echo(f"    nothing wrong with the prompt: round robin sent it to {pod}, where its chain stops "
                               f"at block 0, while {doc['best_pod']} holds it; /v1/cache/route sends it there\n")
                out["explained_pod"], out["explain"] = pod, doc
    finally:
        for w in watchers:
            if w:
                w.close()
    return out
