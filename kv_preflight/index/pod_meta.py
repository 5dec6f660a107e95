"""Pods' metadata and the index's counters: the registry (pod -> model), each pod's meta hash (seqs, block
count, incomplete flag, counters, engine block size, KV cache groups) and ``kvpf:counters``; the key names are
kv_preflight/index/layout.py's. Reads go through the backend's ``read_commands`` (pipelined, per shard on a
cluster); writes are single commands on either client.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Any

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError

from kv_preflight.engines.hit_rules import FULL, KNOWN_KINDS, GroupSpec
from kv_preflight.index.connect import IndexBackend
from kv_preflight.index.entries import text
from kv_preflight.index import scripts
from kv_preflight.index.layout import (ADAPTERS_KEY, COUNTERS_KEY, PODS_KEY, parse_adapter_field, pod_meta_key,
                                      pod_outbox_key)


@dataclass
class PodInfo:
    pod_id: str
    model: str
    engine_block_size: int | None
    seqs: dict[str, int]
    last_event_time: float | None
    incomplete: bool
    incomplete_reason: str
    blocks: int
    counters: dict[str, int] = field(default_factory=dict)
    # held request keys whose parent the pod does not hold (kv_preflight/index/pod_state.py); None: not known (the
    # lookup walks the pod rather than bisecting it until its next clear)
    orphan_keys: int | None = None
    # batches applied whose changes on other shards have not all run yet (a cluster's outbox entries): until
    # 0, a lookup may not see all of the last batch (always 0 on a single node, where a batch is one script)
    pending_effects: int = 0
    # the epoch whose loss of Valkey's data the pod was last rebuilt whole after (``mark_complete``; "": none)
    rebuilt_epoch: str = ""


_POD_COUNTERS = ("batches", "stored", "removed", "cleared", "orphans", "restarts", "gaps_accepted", "replays",
                 "reannounced", "foreign_keys", "corrupt")


@dataclass(frozen=True)
class ScoringInfo:
    """What scoring needs of a pod (its engine block size, whether its index may miss blocks): the
    predictor reads this for every pod a prompt matches, so it is two fields of the pod's meta, not
    all of it (a prompt a thousand pods hold re-reads a thousand pods' worth every second)."""

    pod_id: str
    engine_block_size: int | None
    incomplete: bool
    # its KV cache groups (kind, sizes), when it has several (a hybrid model) or one of a kind other than full
    # attention: the engine's rule for each group decides the hit (kv_preflight/engines/hit_rules.py); None for a
    # plain model
    groups: Mapping[int, GroupSpec] | None = None


def groups_from(raw: Any) -> Mapping[int, GroupSpec] | None:
    """A pod's meta "groups" ({"<group>": [kind, block size, window, chunk, eagle]}) as specs; None when its
    groups need no rule (``has_a_rule``: one full-attention group, a plain model) or cannot be read. One read-only mapping per distinct value:
    a fleet's thousand hybrid pods of one model share it (parsed once, not at every metadata read)."""
    if not raw or not isinstance(raw, (bytes, str)):
        return None
    return _groups_of(raw)


def parse_groups(raw: Any) -> dict[int, GroupSpec]:
    """Every group a pod's meta "groups" names, whatever their number ({} when absent or unreadable): what the
    pod's state was planned with (``index migrate`` rebuilds the state, and its presence fields, from it)."""
    if not raw or not isinstance(raw, (bytes, str)):
        return {}
    try:
        found = msgspec.json.decode(raw)
        return {int(g): GroupSpec(*v) for g, v in found.items()}
    except (msgspec.DecodeError, TypeError, ValueError, AttributeError):
        return {}


@lru_cache(maxsize=1024)
def _groups_of(raw: bytes | str) -> Mapping[int, GroupSpec] | None:
    groups = parse_groups(raw)
    return MappingProxyType(groups) if has_a_rule(groups) else None


def has_a_rule(groups: Mapping[int, GroupSpec]) -> bool:
    """Whether a pod's groups need their rule to be scored: several groups (a hybrid model), or one group of a
    kind with a rule other than full attention's (a sliding-window-only, chunked-only or Mamba-only model:
    vLLM's ``UnitaryKVCacheCoordinator`` runs that kind's manager). One full-attention group is a plain model,
    and one group of a kind without a rule here stays as it was, scored as plain."""
    if len(groups) > 1:
        return True
    return any(s.kind in KNOWN_KINDS and s.kind != FULL for s in groups.values())


def scoring_info_from(pod_id: str, reply: Any) -> ScoringInfo:
    """A pod's ScoringInfo from ``HMGET meta engine_block_size incomplete groups``. State we did not write
    (a key of another type, a block size that is not a number) makes the pod incomplete, never an error."""
    if isinstance(reply, Exception):
        return ScoringInfo(pod_id, None, True)
    raw_ebs, raw_inc = reply[0], reply[1]
    ebs = None
    bad = False
    if raw_ebs:
        try:
            ebs = int(raw_ebs)
        except ValueError:
            bad = True
    return ScoringInfo(pod_id, ebs, bad or raw_inc in (b"1", "1"), groups_from(reply[2]) if len(reply) > 2 else None)


def pod_info_from(pod_id: str, meta_raw: Any) -> PodInfo:
    """A pod's metadata from its meta's HGETALL. State we did not write (a non-integer seq, a key of
    another type) makes the pod incomplete with the reason, never an exception."""
    problems: list[str] = []
    if isinstance(meta_raw, Exception):
        problems.append(f"{pod_meta_key(pod_id)}: {str(meta_raw)[:120]}")
        meta_raw = {}
    try:  # both clients answer bytes; decoded in one pass (a thousand pods' metadata is read at once)
        meta = {k.decode(): v.decode("utf-8", "replace") for k, v in meta_raw.items()}
    except AttributeError:
        meta = {text(k): text(v) for k, v in meta_raw.items()}

    def num(name: str, value: str, kind: type = int) -> Any:
        try:
            return kind(value)
        except ValueError:
            problems.append(f"{name} is {value[:40]!r}, not a number")
            return None

    seqs = {k[4:]: v for k, raw in meta.items() if k[:4] == "seq:" and (v := num(k, raw)) is not None}
    counters = {k: v for k in _POD_COUNTERS if k in meta and (v := num(k, meta[k])) is not None}
    ebs = num("engine_block_size", meta["engine_block_size"]) if meta.get("engine_block_size") else None
    let = num("last_event_time", meta["last_event_time"], float) if meta.get("last_event_time") else None
    reason = meta.get("incomplete_reason", "")
    if problems:
        reason = "; ".join(filter(None, [reason, "corrupt pod state: " + "; ".join(problems)]))
    return PodInfo(
        pod_id=pod_id,
        model=meta.get("model", ""),
        engine_block_size=ebs,
        seqs=seqs,
        last_event_time=let,
        incomplete=meta.get("incomplete") == "1" or bool(problems),
        incomplete_reason=reason,
        blocks=(num("blocks", meta["blocks"]) or 0) if meta.get("blocks") else 0,
        counters=counters,
        orphan_keys=(num("orphan_keys", meta["orphan_keys"])
                     if meta.get("orphan_keys") and meta.get("orphan_at") == meta.get("batches", "0") else None),
        rebuilt_epoch=meta.get("rebuilt_epoch", ""),
    )


class PodMeta:
    """Reads of the pods' registry and metadata, the flags and counters written beside the batches, on a
    single node or a cluster (``backend.read_commands`` routes the reads)."""

    def __init__(self, client, backend: IndexBackend):
        self.client = client
        self.backend = backend

    async def pod_ids(self) -> dict[str, str]:
        try:
            raw = await self.client.hgetall(PODS_KEY)
        except AttributeError as exc:  # redis-py's cluster client, on a node whose connection died under it
            raise RedisConnectionError(f"connection lost reading the registry: {exc}") from None
        return {k.decode(): v.decode() for k, v in raw.items()}

    async def adapters(self) -> dict[str, dict[str, str]]:
        """Per pod, the LoRA adapters its events stored blocks of, each with the pod's model (``kvpf:adapters``)."""
        out: dict[str, dict[str, str]] = {}
        for f, model in (await self.client.hgetall(ADAPTERS_KEY) or {}).items():
            got = parse_adapter_field(text(f))
            if got is not None:
                out.setdefault(got[0], {})[got[1]] = text(model)
        return out

    async def pod_info(self, pod_id: str) -> PodInfo:
        return (await self.pod_infos([pod_id]))[0]

    async def pod_infos(self, pod_ids: Sequence[str], chunk: int = 500) -> list[PodInfo]:
        """Several pods' metadata, pipelined ``chunk`` pods per round trip (bounded replies)."""
        out: list[PodInfo] = []
        for i in range(0, len(pod_ids), chunk):
            part = pod_ids[i:i + chunk]
            # each pod's meta and its outbox's length: the same slot (its hash tag), so one node answers both
            replies = await self._read_commands([c for p in part for c in (("HGETALL", pod_meta_key(p)),
                                                                           ("HLEN", pod_outbox_key(p)))])
            for j, p in enumerate(part):
                meta, pending = replies[2 * j], replies[2 * j + 1]
                if isinstance(meta, list):  # the lean connection answers HGETALL flat
                    meta = dict(zip(meta[::2], meta[1::2]))
                info = pod_info_from(p, meta)
                if isinstance(pending, int):
                    info.pending_effects = pending
                out.append(info)
        return out

    async def pods(self) -> list[PodInfo]:
        return await self.pod_infos(sorted(await self.pod_ids()))

    async def meta_fields(self, pod_ids: Sequence[str], fields: Sequence[str], chunk: int = 1000
                          ) -> list[list[Any] | None]:
        """Some fields of several pods' meta (HMGET each, pipelined ``chunk`` pods per round trip); None for a
        pod whose meta is of a foreign type."""
        out: list[list[Any] | None] = []
        for i in range(0, len(pod_ids), chunk):
            replies = await self._read_commands([("HMGET", pod_meta_key(p), *fields) for p in pod_ids[i:i + chunk]])
            out.extend(None if isinstance(r, Exception) else r for r in replies)
        return out

    async def scoring_infos(self, pod_ids: Sequence[str], chunk: int = 1000) -> list[ScoringInfo]:
        """Several pods' ScoringInfo, pipelined ``chunk`` pods per round trip: one HMGET each."""
        out: list[ScoringInfo] = []
        for i in range(0, len(pod_ids), chunk):
            part = pod_ids[i:i + chunk]
            replies = await self._read_commands([("HMGET", pod_meta_key(p), "engine_block_size", "incomplete", "groups")
                                                 for p in part])
            out.extend(scoring_info_from(p, r) for p, r in zip(part, replies))
        return out

    async def _read_commands(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        return await self.backend.read_commands(commands)

    async def counters(self) -> dict[str, int]:
        raw = await self.client.hgetall(COUNTERS_KEY)
        return {k.decode(): int(v) for k, v in raw.items()}

    async def count(self, name: str, n: int = 1, *, pod_id: str | None = None) -> None:
        key = pod_meta_key(pod_id) if pod_id else COUNTERS_KEY
        await self.client.hincrby(key, name, n)

    async def mark_incomplete(self, pod_id: str, reason: str, *, unless_rebuilt_in: str = "") -> bool:
        """Flag the pod; with ``unless_rebuilt_in``, not if it was rebuilt whole in that epoch of the index (by
        another ingester that noticed the same loss first). Whether it was flagged."""
        if not unless_rebuilt_in:
            await self.client.hset(pod_meta_key(pod_id), mapping={"incomplete": 1, "incomplete_reason": reason})
            return True
        return bool(await self.client.eval(scripts.FLAG_POD, 1, pod_meta_key(pod_id), reason, unless_rebuilt_in))

    async def mark_complete(self, pod_id: str, *, rebuilt_in: str = "") -> None:
        """Clear the flag; ``rebuilt_in``: the pod was rebuilt whole from its engine's replay after the loss that
        began that epoch (no later notice of that loss flags it again)."""
        fields: dict[str, str | int] = {"incomplete": 0, "incomplete_reason": ""}
        if rebuilt_in:
            fields["rebuilt_epoch"] = rebuilt_in
        await self.client.hset(pod_meta_key(pod_id), mapping=fields)


__all__ = ["PodInfo", "PodMeta", "ScoringInfo", "groups_from", "has_a_rule", "parse_groups", "pod_info_from",
           "scoring_info_from"]
