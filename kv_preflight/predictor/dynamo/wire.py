"""NVIDIA Dynamo's standalone KV indexer API, as pure values: request bodies, checks, answers.

The shapes are Dynamo's current ones (``python -m dynamo.indexer``, docs v1.3.0 to v1.6.2), read from
ai-dynamo/dynamo ``lib/kv-router/src/services/indexer/server.rs`` @ 47022ee4c6f1a997794ed038af8582a5e5df347e
(RegisterRequest, UnregisterRequest, QueryRequest, ScoreResponse, status codes),
``services/indexer/registry.rs`` @ 317eb30e8639550dbc7692723387a6dc2ae97ef5 (WorkerInfo, ListenerStatus,
error texts) and ``services/overlap.rs`` @ 5ea3d18eaab82a2b7d2e8ffae5814aaa05ee67df (MooncakeOverlapSummary:
per instance ``longest_matched``, ``gpu``, ``dp``, ``cpu``, ``disk``, in tokens, cpu and disk cumulative).
The routes and the I/O are in predictor/dynamo/api.py; docs/dynamo.md says what differs.
"""
from __future__ import annotations

import ipaddress
import os.path
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated
from urllib.parse import urlsplit

import msgspec

from kv_preflight.engines.endpoints import check_zmq_endpoint, endpoint_identity
from kv_preflight.index.entries import parse_entry
from kv_preflight.predictor.scoring.freshness import Freshness
from kv_preflight.keys.chain import MAX_TOKEN_ID, fnv64a
from kv_preflight.keys.multimodal import MultimodalItem

DEFAULT_ROUTING_GROUP = "default"  # Dynamo's default_routing_group()
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec decodes larger JSON integers too: see _u64 (its bound won't fit)
U64_MAX = 2**64 - 1


def _u64(value: int, name: str) -> None:
    """Dynamo's ids are u64 (serde refuses a larger one with a data error: 422); raised in ``__post_init__``,
    msgspec's ValidationError says so, since a ``le`` bound past int64 is not one msgspec takes."""
    if value > U64_MAX:
        raise ValueError(f"{name} {value} is not a u64 (at most {U64_MAX})")
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# Ids given to pods nobody registered: 53 bits, so a JavaScript client reads them exactly.
_STABLE_ID_MASK = (1 << 53) - 1

# Dynamo partitions a model's workers by routing group; ``tenant_id`` is its old name, accepted and ignored.


class RegisterRequest(msgspec.Struct):
    instance_id: U64
    endpoint: str
    model_name: str
    block_size: U32
    routing_group: str = DEFAULT_ROUTING_GROUP
    tenant_id: str | None = None  # accepted, ignored (Dynamo: `_tenant_id`)
    dp_rank: U32 | None = None
    replay_endpoint: str | None = None
    additional_salt: str | None = None  # accepted, ignored (Dynamo too: engines salt their own hashes)
    additionalsalt: str | None = None  # Dynamo's serde alias of additional_salt

    def __post_init__(self) -> None:
        _u64(self.instance_id, "instance_id")


class UnregisterRequest(msgspec.Struct):
    instance_id: U64
    model_name: str
    routing_group: str | None = None  # None: every routing group of the model
    tenant_id: str | None = None
    dp_rank: U32 | None = None  # honoured only with routing_group, as Dynamo does

    def __post_init__(self) -> None:
        _u64(self.instance_id, "instance_id")


class QueryRequest(msgspec.Struct):
    token_ids: list[TokenId]
    model_name: str
    routing_group: str = DEFAULT_ROUTING_GROUP
    tenant_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    # kv-preflight's addition: the prompt's multimodal items as the engine sees them, keyed as /v1/cache/predict
    # keys them (kv_preflight/keys/multimodal.py); Dynamo's indexer /query takes none
    mm_items: list[MultimodalItem] | None = None


class OverlapSummary(msgspec.Struct):
    """Dynamo's MooncakeOverlapSummary (field order as Rust serializes it)."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class ScoreResponse(msgspec.Struct, omit_defaults=True):
    scores: dict[str, dict[str, int]]  # instance -> dp rank -> device-tier tokens
    # block i -> how many (instance, rank) hold it on the device tier (Dynamo's positional indexer counts
    # workers; its radix trees count recent queries, a history this index does not keep: docs/dynamo.md)
    frequencies: list[int]
    instances: dict[str, OverlapSummary]
    # kv-preflight's addition (serde ignores unknown fields): how fresh the answer is, its pods keyed by
    # "<instance>" or "<instance>/<dp rank>" (predictor/scoring/freshness.py)
    freshness: Freshness | None = None


class ListenerInfo(msgspec.Struct, omit_defaults=True):
    endpoint: str
    status: str
    last_error: str | None = None


class WorkerInfo(msgspec.Struct):
    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, ListenerInfo]


def stable_instance_id(pod_id: str) -> int:
    """The id a pod nobody registered is answered under: FNV-64a of its name, 53 bits (never changes)."""
    return fnv64a(pod_id.encode()) & _STABLE_ID_MASK


def registered_pod(instance_id: int, dp_rank: int) -> str:
    """The pod a registered (instance, rank) is ingested as: one pod per rank, so ``dp`` is exact."""
    return f"dynamo-{instance_id}" if dp_rank == 0 else f"dynamo-{instance_id}-dp{dp_rank}"


def registration_id(instance_id: int, dp_rank: int) -> str:
    """The ``kvpf:engines`` field of a registered (instance, rank)."""
    return f"dynamo:{instance_id}:{dp_rank}"


# ---- endpoints

_TCP = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^:/\[\]]+):(\d+)")  # fullmatch: "$" would pass a trailing newline


class EndpointError(ValueError):
    """Not an endpoint Dynamo accepts (400)."""


class EndpointRefused(ValueError):
    """An endpoint this server will not connect to (403): outside --register-allow, or not reachable."""


def endpoint_host(endpoint: str) -> str:
    """The host of a ZMQ endpoint Dynamo accepts (tcp://HOST:PORT, ipc://PATH, inproc://NAME); raises
    EndpointError like Dynamo's ``validate_listener_endpoints`` (services/indexer/mod.rs) on any other."""
    if endpoint.startswith(("ipc://", "inproc://")):
        if endpoint.split("://", 1)[1]:
            return ""
        raise EndpointError(f"invalid endpoint `{endpoint[:200]}`: no path")
    m = _TCP.fullmatch(endpoint)
    if not m or not 0 <= int(m.group(2)) <= 65535:
        raise EndpointError(f"invalid endpoint `{endpoint[:200]}`: expected tcp://HOST:PORT, ipc://PATH or "
                            "inproc://NAME")
    return m.group(1).strip("[]")


def parse_allow(items: Iterable[str]) -> tuple[list[ipaddress.IPv4Network | ipaddress.IPv6Network], set[str]]:
    """``--register-allow`` values: CIDRs or addresses (networks), else host names (compared as given)."""
    nets, names = [], set()
    for item in items:
        item = item.strip()
        if not item:
            continue
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.-]+", item):
                raise ValueError(f"--register-allow {item!r} is neither a host name nor an address or CIDR") from None
            names.add(item.lower())
    return nets, names


LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")


DEFAULT_IPC_DIRS = ("/tmp",)  # --register-ipc-dir: where a registered ipc:// socket may be (vLLM's ipc paths are there)


def check_endpoint(endpoint: str, allow: Sequence[str], ipc_dirs: Sequence[str] = DEFAULT_IPC_DIRS,
                   services: Mapping[str, str] | None = None) -> None:
    """Raise EndpointError (malformed) or EndpointRefused (not ours to connect to) for a registered endpoint.

    ``allow`` empty means loopback only. An ipc:// endpoint is a path on this host, so it is allowed
    exactly when loopback is, and only inside one of ``ipc_dirs`` (its path normalized first: ``/../`` climbs
    no further); inproc:// lives inside another process and cannot be reached. ``services``: what this
    deployment serves over TCP that is no ZMQ publisher (``endpoint_identity`` -> what it is: Valkey, an
    HTTP port), refused, since an ingester told to subscribe there would speak ZMTP to it, and reconnect, for
    as long as the registration stands.
    """
    host = endpoint_host(endpoint)
    if endpoint.startswith("inproc://"):
        raise EndpointRefused(f"`{endpoint[:200]}` is an inproc endpoint: only its own process can reach it")
    nets, names = parse_allow(allow or LOOPBACK)
    if endpoint.startswith("ipc://"):
        host = "127.0.0.1"
        check_ipc_path(endpoint, ipc_dirs)
    elif services:
        what = services.get(endpoint_identity(endpoint))
        if what is not None:
            raise EndpointRefused(f"`{endpoint[:200]}` is {what}, not an engine's ZMQ publisher")
    if host in ("*", "0.0.0.0", "::", ""):
        raise EndpointRefused(f"`{endpoint[:200]}` names no host to connect to: give the engine's address")
    try:  # what Dynamo's format check lets through but no ingester socket could connect to (port 0, long ipc)
        check_zmq_endpoint(endpoint, bind=False)
    except ValueError as exc:
        raise EndpointError(f"invalid endpoint `{endpoint[:200]}`: {exc}") from None
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if host.lower() in names:
            return
        raise EndpointRefused(f"host {host[:100]!r} is not in --register-allow") from None
    if any(addr in n for n in nets) or host in names:
        return
    raise EndpointRefused(f"address {host} is not in --register-allow")


def check_ipc_path(endpoint: str, dirs: Sequence[str]) -> None:
    """Raise EndpointRefused unless an ipc:// endpoint's path, normalized, lies inside one of ``dirs``
    (absolute folders; an abstract-namespace name, ``ipc://@NAME``, and a relative path are in none)."""
    path = endpoint[len("ipc://"):]
    shown = endpoint[:200]
    if path.startswith("@") or not path.startswith("/"):
        raise EndpointRefused(f"`{shown}` is not an absolute path inside --register-ipc-dir "
                              f"({', '.join(dirs) or 'none given'})")
    real = os.path.normpath(path)
    for folder in dirs:
        base = os.path.normpath(folder)
        if base.startswith("/") and (real.startswith(base.rstrip("/") + "/")):
            return
    raise EndpointRefused(f"`{shown}` is outside --register-ipc-dir ({', '.join(dirs) or 'none given'})")


def own_services(valkey_urls: Iterable[str], http_urls: Mapping[str, str]) -> dict[str, str]:
    """What a registration may not name as its publisher: each Valkey node (``valkey_urls``: redis://HOST:PORT)
    and each HTTP server (URL -> what it is), by ``endpoint_identity`` (loopback spellings are one host)."""
    out: dict[str, str] = {}
    for url, what in [*((u, "Valkey") for u in valkey_urls), *http_urls.items()]:
        parts = urlsplit(url)
        try:
            port = parts.port or {"http": 80, "https": 443, "redis": 6379, "rediss": 6379}.get(parts.scheme)
        except ValueError:
            continue
        host = parts.hostname or "127.0.0.1"
        if not port:
            continue
        if host in ("0.0.0.0", "::"):  # a server on every interface: its loopback spelling at least
            host = "127.0.0.1"
        out[endpoint_identity(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}")] = \
            f"{what} ({host}:{port})"
    return out


# ---- the query answer


def tier_class(tier: str) -> int:
    """0 device, 1 host memory, 2 anything further (disk, storage, external): Dynamo's three columns."""
    t = tier.lower()
    if t in ("gpu", "device", ""):
        return 0
    if t in ("cpu", "cpu_pinned", "host", "host_pinned"):
        return 1
    return 2


def tier_prefixes(fields_per_key: Sequence[Sequence[str | bytes]],
                  pods: Iterable[str] | None = None) -> dict[str, tuple[int, int, int]]:
    """Per pod, leading canonical blocks held (device, device+host, any tier), from each key's fields.

    Cumulative like Dynamo's summary: a block counts for ``cpu`` if the pod holds it on the device or in
    host memory, for ``disk`` if it holds it anywhere, each counted only while unbroken from block 0.
    """
    wanted = set(pods) if pods is not None else None
    best: dict[str, list[int]] = {}  # pod -> [gpu, cpu, disk]
    open_: dict[str, list[bool]] = {}
    for i, fields in enumerate(fields_per_key):
        held: dict[str, int] = {}
        for f in fields:
            entry = parse_entry(f)
            if entry is None or entry.Speculative or (wanted is not None and entry.PodIdentifier not in wanted):
                continue
            cls = tier_class(entry.DeviceTier)
            held[entry.PodIdentifier] = min(cls, held.get(entry.PodIdentifier, 3))
        if i == 0:
            for pod in held:
                best[pod] = [0, 0, 0]
                open_[pod] = [True, True, True]
        any_open = False
        for pod, flags in open_.items():
            cls = held.get(pod, 3)
            for column in range(3):
                if flags[column] and cls <= column:
                    best[pod][column] = i + 1
                else:
                    flags[column] = False
            any_open |= any(flags)
        if not any_open:
            break
    return {p: (b[0], b[1], b[2]) for p, b in best.items()}


def rank_prefix(blocks: int, tier: str) -> tuple[int, int, int]:
    """A data-parallel rank's (device, device+host, any tier) prefix from its lookup match: its bits say how far
    it holds the chain and on which tier it counts (the ranks share their pod's llm-d entries, which
    ``tier_prefixes`` reads, so they cannot tell the ranks apart); a prefix that mixes tiers counts on its best."""
    cls = tier_class(tier)
    return (blocks if cls <= 0 else 0, blocks if cls <= 1 else 0, blocks)


def whole_blocks_tokens(canonical_blocks: int, canonical_block: int, engine_block: int | None) -> int:
    """Tokens in the engine's whole blocks covered by ``canonical_blocks`` request-key blocks."""
    e = engine_block if engine_block and engine_block > 0 else canonical_block
    return canonical_blocks * canonical_block // e * e


def build_score_response(
    prefixes: Mapping[str, tuple[int, int, int]],
    *,
    canonical_block: int,
    engine_blocks: Mapping[str, int | None],
    worker_of: Mapping[str, tuple[int, int]],
    expected: Iterable[tuple[int, int]] = (),
    block_size: int,
) -> ScoreResponse:
    """Dynamo's ScoreResponse from per-pod prefixes.

    ``worker_of`` maps pod -> (instance id, dp rank); ``expected`` are registered (instance, rank) pairs
    answered even with nothing matched (as Dynamo's documented example lists them); ``block_size`` is
    the partition's block size, the unit of ``frequencies``.
    """
    expected = set(expected)
    per_rank: dict[tuple[int, int], tuple[int, int, int]] = {w: (0, 0, 0) for w in expected}
    for pod, (g, c, d) in prefixes.items():
        if pod not in worker_of:
            continue
        e = engine_blocks.get(pod)
        tokens = tuple(whole_blocks_tokens(b, canonical_block, e) for b in (g, c, d))
        if any(tokens) or worker_of[pod] in per_rank:
            per_rank[worker_of[pod]] = tokens  # type: ignore[assignment]
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, OverlapSummary] = {}
    for (inst, rank), (g, c, d) in sorted(per_rank.items()):
        s = instances.get(str(inst))
        if s is None:
            s = instances[str(inst)] = OverlapSummary(0, 0, {}, 0, 0)
        s.dp[str(rank)] = g
        s.gpu, s.cpu, s.disk = max(s.gpu, g), max(s.cpu, c), max(s.disk, d)
        s.longest_matched = max(s.gpu, s.cpu, s.disk)
        if g > 0 or (inst, rank) in expected:
            scores.setdefault(str(inst), {})[str(rank)] = g
    device = sorted((g for (g, _, _) in per_rank.values() if g > 0), reverse=True)
    unit = block_size if block_size > 0 else canonical_block
    frequencies = [sum(1 for g in device if g >= (i + 1) * unit) for i in range((device[0] // unit) if device else 0)]
    return ScoreResponse(scores=scores, frequencies=frequencies, instances=instances)
