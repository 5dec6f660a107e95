"""The fleet's shared records in Valkey: pod records, engine load, ingester leases, registered engines,
index-wide settings, pod aliases, replay feeds and the last fleet diagnosis.

Ingesters write them and predictors read them (docs/fleet.md); the values are kv_preflight/fleet/records.py's,
the key names kv_preflight/index/layout.py's. None of these keys is touched per batch: they are the control plane,
apart from the index's data.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from kv_preflight.fleet import records as fleet
from kv_preflight.index import scripts
from kv_preflight.index.backend import Looked, foreign_as_empty, ms_of
from kv_preflight.index.connect import IndexBackend
from kv_preflight.index.entries import text
from kv_preflight.index.layout import (ALIASES_KEY, DIAGNOSIS_KEY, EPOCH_KEY, FEEDS_KEY, FLEET_KEY, FORGET_KEY,
                                       INGESTERS_KEY, LOAD_KEY, REGISTERED_KEY, SETTINGS_KEY, feed_field)


class FleetStore(Protocol):
    """The fleet store: what ingesters write and predictors read of the fleet (records, leases, load, settings,
    the epoch, forgets, aliases, the diagnosis, replay feeds), on Valkey's clock. ``ValkeyFleetStore`` is the
    implementation over either backend (what differs, the backend does: how Valkey's time comes with reads, and
    a cluster's slot markers); tests/integration/test_contract_fleet_store.py is the bar for any other."""

    async def now_ms(self) -> int: ...
    async def fleet_view(self) -> fleet.FleetView: ...
    async def put_pod_records(self, records: dict[str, fleet.PodRecord]) -> None: ...
    async def replace_pod_record(self, pod_id: str, expected: fleet.PodRecord | None, record: fleet.PodRecord) -> bool: ...
    async def drop_pod_records(self, pod_ids: Iterable[str]) -> None: ...
    async def put_load(self, loads: dict[str, fleet.PodLoad]) -> None: ...
    async def put_lease(self, ingester_id: str, lease: fleet.IngesterLease) -> None: ...
    async def drop_leases(self, ingester_ids: Iterable[str]) -> None: ...
    async def registered_engines(self) -> dict[str, fleet.RegisteredEngine]: ...
    async def register_engine(self, engine_id: str, engine: fleet.RegisteredEngine) -> None: ...
    async def unregister_engine(self, engine_id: str) -> bool: ...
    async def settings(self) -> fleet.IndexSettings | None: ...
    async def claim_settings(self, ours: fleet.IndexSettings) -> fleet.IndexSettings: ...
    async def epoch(self) -> str | None: ...
    async def claim_epoch(self, token: str) -> str: ...
    async def replace_epoch(self, seen: str, token: str) -> str: ...
    async def look_at_shards(self, epoch: str) -> Looked: ...
    async def mark_shards(self, epoch: str) -> None: ...
    async def maxmemory_policy(self) -> str | None: ...
    async def forget_pods(self, pod_ids: Iterable[str]) -> int: ...
    async def forgotten(self) -> dict[str, int]: ...
    async def unforget_pods(self, pod_ids: Iterable[str]) -> None: ...
    async def add_aliases(self, pairs: Iterable[tuple[str, str]]) -> None: ...
    async def aliases(self) -> dict[str, list[str]]: ...
    async def put_fleet_diagnosis(self, summary: bytes) -> int: ...
    async def fleet_diagnosis(self) -> tuple[bytes | None, int, int]: ...
    async def remember_feed(self, replay_endpoint: str, rank: int, pod_id: str, model: str) -> None: ...
    async def feeds(self, replay_endpoints: Iterable[str]) -> list[tuple[str, int, str, str]]: ...


class ValkeyFleetStore:
    """Reads and writes of the fleet's records, on a single node or a cluster (redis-py routes each key; what
    differs, the backend does: how Valkey's time comes with reads, and the shards' slot markers)."""

    def __init__(self, client, backend: IndexBackend):
        self.client = client
        self.backend = backend

    async def now_ms(self) -> int:
        """Valkey's clock (``TIME``), the one clock every lease and age in the fleet is measured on."""
        return ms_of(await self.client.time())

    async def fleet_view(self) -> fleet.FleetView:
        """Pods, their load and the ingesters' leases, with Valkey's time, in one round trip
        (on a cluster: one per shard holding them). Rows that do not decode are skipped."""
        now, pods, load, leases = await self._timed_read(FLEET_KEY, LOAD_KEY, INGESTERS_KEY)
        return fleet.FleetView(
            now_ms=now,
            pods={text(k): r for k, v in (pods or {}).items() if (r := fleet.decode_pod(v)) is not None},
            load={text(k): r for k, v in (load or {}).items() if (r := fleet.decode_load(v)) is not None},
            ingesters={text(k): r for k, v in (leases or {}).items()
                       if (r := fleet.decode_lease(v)) is not None})

    async def _timed_read(self, *hashes: str) -> list[Any]:
        """Valkey's time (ms) and HGETALL of each hash, in one round trip where the topology allows it."""
        def fill(pipe) -> None:
            for h in hashes:
                pipe.hgetall(h)

        now, rest = await self.backend.read_timed(fill)
        return [now, *foreign_as_empty(rest)]

    async def put_pod_records(self, records: dict[str, fleet.PodRecord]) -> None:
        if records:
            await self.client.hset(FLEET_KEY, mapping={p: fleet.encode(r) for p, r in records.items()})

    async def replace_pod_record(self, pod_id: str, expected: fleet.PodRecord | None, record: fleet.PodRecord) -> bool:
        """Write ``record`` only if the pod's record is still ``expected`` (None: absent): two ingesters
        acting on one pod at once (one retiring it, one attaching a new engine under its id) cannot both
        win. One small script: compare and set in one step."""
        found = await self.client.eval(scripts.CAS_FIELD, 1, FLEET_KEY, pod_id,
                                       fleet.encode(expected) if expected is not None else "", fleet.encode(record))
        return bool(int(found))

    async def drop_pod_records(self, pod_ids: Iterable[str]) -> None:
        pod_ids = list(pod_ids)
        if pod_ids:
            await self.client.hdel(FLEET_KEY, *pod_ids)
            await self.client.hdel(LOAD_KEY, *pod_ids)

    async def put_load(self, loads: dict[str, fleet.PodLoad]) -> None:
        if loads:
            await self.client.hset(LOAD_KEY, mapping={p: fleet.encode(r) for p, r in loads.items()})

    async def put_lease(self, ingester_id: str, lease: fleet.IngesterLease) -> None:
        await self.client.hset(INGESTERS_KEY, ingester_id, fleet.encode(lease))

    async def drop_leases(self, ingester_ids: Iterable[str]) -> None:
        ids = list(ingester_ids)
        if ids:
            await self.client.hdel(INGESTERS_KEY, *ids)

    async def registered_engines(self) -> dict[str, fleet.RegisteredEngine]:
        raw = await self.client.hgetall(REGISTERED_KEY)
        return {text(k): r for k, v in (raw or {}).items() if (r := fleet.decode_registered(v)) is not None}

    async def register_engine(self, engine_id: str, engine: fleet.RegisteredEngine) -> None:
        await self.client.hset(REGISTERED_KEY, engine_id, fleet.encode(engine))

    async def unregister_engine(self, engine_id: str) -> bool:
        return bool(await self.client.hdel(REGISTERED_KEY, engine_id))

    async def settings(self) -> fleet.IndexSettings | None:
        """The index-wide settings, None before any writer has set them."""
        raw = await self.client.hgetall(SETTINGS_KEY)
        return fleet.IndexSettings.from_fields({text(k): text(v) for k, v in (raw or {}).items()})

    async def claim_settings(self, ours: fleet.IndexSettings) -> fleet.IndexSettings:
        """Set the settings if none are set (first writer wins, field by field); return what the index
        holds, for the caller to compare with its own (``IndexSettings.disagreements``)."""
        async with self.client.pipeline(transaction=False) as pipe:
            for name, value in ours.as_fields().items():
                pipe.hsetnx(SETTINGS_KEY, name, value)
            await pipe.execute()
        found = await self.settings()
        assert found is not None
        return found

    # ---- the index's epoch: did Valkey lose the data since a writer last looked?

    async def epoch(self) -> str | None:
        found = await self.client.hget(EPOCH_KEY, "id")
        return text(found) if found is not None else None

    async def claim_epoch(self, token: str) -> str:
        """Set the epoch to ``token`` if none is set (first writer wins); the epoch the index has now."""
        if await self.client.hsetnx(EPOCH_KEY, "id", token):
            await self._epoch_began()
        return text(await self.client.hget(EPOCH_KEY, "id"))

    async def replace_epoch(self, seen: str, token: str) -> str:
        """A new epoch, ``token``, if the index is still in ``seen`` or has none (of the ingesters that found
        one shard's data gone, the first wins, and the others see "another"); the epoch the index has now."""
        if await self.client.eval(scripts.CAS_FIELD, 1, EPOCH_KEY, "id", seen, token):
            await self._epoch_began()
        found = await self.client.hget(EPOCH_KEY, "id")
        return text(found) if found is not None else await self.claim_epoch(token)

    async def _epoch_began(self) -> None:
        """When the epoch began (Valkey ms), ``id_at``: a shard started before it lost nothing that the epoch's
        rebuild does not cover (kv_preflight/index/cluster/markers.py)."""
        await self.client.hset(EPOCH_KEY, "id_at", await self.now_ms())

    async def look_at_shards(self, epoch: str) -> Looked:
        """The primaries that came back without their data in ``epoch``, and those whose marker was evicted
        (kv_preflight/index/cluster/markers.py); on a single node, none: its epoch key says it all."""
        return await self.backend.look_at_shards(epoch)

    async def mark_shards(self, epoch: str) -> None:
        """Every slot marked in ``epoch``, so a shard's loss from here on shows (``look_at_shards``; a cluster's)."""
        await self.backend.mark_shards(epoch)

    async def maxmemory_policy(self) -> str | None:
        """Valkey's ``maxmemory-policy``, None where CONFIG is not allowed (a managed service)."""
        try:
            found = await self.client.config_get("maxmemory-policy")
        except Exception:  # noqa: BLE001 - CONFIG renamed or refused: nothing to warn about then
            return None
        value = (found or {}).get("maxmemory-policy")
        return text(value) if value is not None else None

    # ---- pods being forgotten

    async def forget_pods(self, pod_ids: Iterable[str]) -> int:
        """Ask every ingester to let go of these pods (and refuse their frames); returns Valkey's time."""
        now = await self.now_ms()
        pods = list(pod_ids)
        if pods:
            await self.client.hset(FORGET_KEY, mapping={p: str(now) for p in pods})
        return now

    async def forgotten(self) -> dict[str, int]:
        raw = await self.client.hgetall(FORGET_KEY)
        return {text(k): int(text(v)) for k, v in (raw or {}).items() if text(v).isdigit()}

    async def unforget_pods(self, pod_ids: Iterable[str]) -> None:
        """These pods may be ingested again (registered anew)."""
        pods = list(pod_ids)
        if pods:
            await self.client.hdel(FORGET_KEY, *pods)

    async def add_aliases(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Record that each (name, other) pair names one pod both ways (``--pod-id endpoint``)."""
        merged: dict[str, set[str]] = {}
        for a, b in pairs:
            merged.setdefault(a, set()).add(b)
            merged.setdefault(b, set()).add(a)
        if not merged:
            return
        names = sorted(merged)
        found = await self.client.hmget(ALIASES_KEY, names)
        for name, old in zip(names, found):
            if old:
                merged[name] |= set(text(old).split("\t"))
        await self.client.hset(ALIASES_KEY, mapping={n: "\t".join(sorted(v)) for n, v in merged.items()})

    async def aliases(self) -> dict[str, list[str]]:
        """Every recorded alias (a few per pod, written once per pod and ingester)."""
        return {text(k): text(v).split("\t") for k, v in (await self.client.hgetall(ALIASES_KEY) or {}).items()}

    async def put_fleet_diagnosis(self, summary: bytes) -> int:
        """Store the summary stamped with Valkey's time; returns that time (ms)."""
        now = await self.now_ms()
        await self.client.hset(DIAGNOSIS_KEY, mapping={"summary": summary, "at_ms": str(now)})
        return now

    async def fleet_diagnosis(self) -> tuple[bytes | None, int, int]:
        """(summary or None, when it was stored, Valkey's time now), in one round trip."""
        now, fields = await self._timed_read(DIAGNOSIS_KEY)
        fields = {text(k): v for k, v in (fields or {}).items()}
        at = fields.get("at_ms")
        return fields.get("summary"), int(at) if at else 0, now

    async def remember_feed(self, replay_endpoint: str, rank: int, pod_id: str, model: str) -> None:
        """Note that ``replay_endpoint`` (rank ``rank``) serves ``pod_id``; see ``feeds``."""
        await self.client.hset(FEEDS_KEY, feed_field(replay_endpoint, rank), f"{pod_id}\t{model}")

    async def feeds(self, replay_endpoints: Iterable[str]) -> list[tuple[str, int, str, str]]:
        """(replay endpoint, rank, pod, model) remembered for these endpoints: what a restarted
        ingester resumes at start, before any frame names a pod (SGLang's replay replies carry
        no topic, so the pod cannot be learned from them)."""
        wanted = set(replay_endpoints)
        if not wanted:
            return []
        out = []
        for f, v in (await self.client.hgetall(FEEDS_KEY)).items():
            endpoint, _, rank = text(f).rpartition("|")
            pod, _, model = text(v).partition("\t")
            if endpoint in wanted and rank.isdigit() and pod:
                out.append((endpoint, int(rank), pod, model))
        return sorted(out)


__all__ = ["FleetStore", "ValkeyFleetStore"]
