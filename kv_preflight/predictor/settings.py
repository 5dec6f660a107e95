"""A predictor's hash seed, block size and entry format, reconciled with the index's (``kvpf:settings``).

Request keys are only found when the predictor hashes prompts exactly as the index's writers did, so
a predictor that guesses (defaults) adopts the index's settings, and one told otherwise (a flag or
``KVPF_<NAME>``, which ``Config.load`` records in ``Config.given``) refuses to start rather than answer
"nothing cached" for every prompt. An index with no settings (written before they were recorded) is
read with the predictor's own. ``reconcile`` is pure; ``read_index_settings`` is the one Valkey read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from kv_preflight.config import Config
from kv_preflight.fleet.records import IndexSettings
from kv_preflight.index.fleet_store import FleetStore
from kv_preflight.index.index import VALKEY_ERRORS, Index

log = logging.getLogger("kvpf.predictor")

ADOPTABLE = ("hash_seed", "block_size", "entry_format")
HASH_ALGO = "fnv64a"  # kv_preflight/keys/chain.py: the only request-key hash this predictor computes


class SettingsMismatch(RuntimeError):
    """The index was written with settings this predictor was explicitly told not to use."""


def reconcile(cfg: Config, found: IndexSettings | None) -> tuple[Config, list[str], list[str]]:
    """(config to serve with, settings adopted from the index, disagreements); refuse when the last is not empty."""
    if found is None:
        return cfg, [], []
    adopt: dict[str, object] = {}
    problems: list[str] = []
    for name in ADOPTABLE:
        ours, theirs = getattr(cfg, name), getattr(found, name)
        if ours == theirs:
            continue
        if name in cfg.given:
            problems.append(f"{name}: given {ours!r} (--{name.replace('_', '-')} or KVPF_{name.upper()}), "
                            f"the index has {theirs!r}")
        else:
            adopt[name] = theirs
    if found.hash_algo != HASH_ALGO:
        problems.append(f"hash_algo: this predictor computes {HASH_ALGO!r}, the index has {found.hash_algo!r}")
    if problems:
        return cfg, [], problems
    new = dataclasses.replace(cfg, **adopt) if adopt else cfg
    try:
        new.validate()
    except ValueError as exc:
        return cfg, [], [f"the index's settings are not usable: {exc}"]
    return new, [f"{n}={adopt[n]!r}" for n in adopt], []


def refusal(problems: list[str]) -> str:
    """The one line a refusing predictor prints."""
    return ("this predictor's settings disagree with the index's (kvpf:settings): " + "; ".join(problems)
            + ". Drop those flags/env vars to adopt the index's settings, or point --valkey-url at the index "
            "written with yours")


async def read_index_settings(store: FleetStore, timeout_s: float, *, quiet: bool = False) -> IndexSettings | None:
    """The index's settings; None when it has none, or when Valkey cannot be read now (logged unless quiet)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await store.settings()
    except (TimeoutError, ValueError, *VALKEY_ERRORS) as exc:
        if not quiet:
            log.warning("index settings not read now (serving with this predictor's own): %s: %s",
                        type(exc).__name__, exc)
        return None


async def check_settings(cfg: Config) -> None:
    """For ``serve`` before any worker starts: SettingsMismatch (its message one line) when the index's
    settings disagree with what was given; each worker's start-up then adopts the rest (predictor/http/app.py).
    Quiet about a Valkey it cannot reach: every worker's start-up says so in the log, and saying it here too
    printed each warning twice (once bare on stderr, before logging was set up)."""
    probe_log = logging.getLogger("kvpf.index")
    level = probe_log.level
    probe_log.setLevel(logging.ERROR)  # "did not answer; taking it for a single node": the workers say it
    try:
        index = Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format,
                               cluster=cfg.cluster_mode())
        try:
            found = await read_index_settings(index.fleet, 2 * cfg.valkey_timeout_s, quiet=True)
        finally:
            await index.close()
    finally:
        probe_log.setLevel(level)
    _, _, problems = reconcile(cfg, found)
    if problems:
        raise SettingsMismatch(refusal(problems))
