"""A remote-indexer API on its own port (``serve --dynamo-port``): NVIDIA Dynamo's standalone KV indexer routes.

A router that speaks to Dynamo's ``python -m dynamo.indexer`` (Mooncake KV Indexer RFC) can use the
kv-preflight index instead: ``/query`` answers from the same Valkey index the predictor reads, and
``/register`` / ``/unregister`` add and remove engine sources at run time by writing ``kvpf:engines``
(kv_preflight/fleet/records.py ``RegisteredEngine``), which every ingester treats as a discovery source. Shapes,
status codes and error texts are Dynamo's (predictor/dynamo/wire.py cites the source); what differs
is in docs/dynamo.md. ``/query_by_hash`` and ``/dump`` need Dynamo's own per-block XXH3 hashes and
event log, which this index does not keep: they answer 501.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from kv_preflight.predictor.http.auth import ApiKeyAuth, load_api_keys
from kv_preflight.predictor.http.body import read_json_body
from kv_preflight.index.rank_pods import base_pod, split_rank_pod
from kv_preflight.predictor.scoring.ranks import dp_pods_of
from kv_preflight.predictor.dynamo.wire import (DEFAULT_ROUTING_GROUP, EndpointError, EndpointRefused, QueryRequest,
                                   RegisterRequest, UnregisterRequest, WorkerInfo, ListenerInfo, build_score_response,
                                   check_endpoint, own_services, rank_prefix, registered_pod, registration_id,
                                   stable_instance_id,
                                   tier_prefixes)
from kv_preflight.predictor.errors import PredictorError
from kv_preflight.predictor.valkey_call import valkey_call
from kv_preflight.predictor.scoring.freshness import answer_freshness, pod_freshness
from kv_preflight.fleet import records as fleet
from kv_preflight.index.lifecycle import LET_GO_WAIT_S, forget_pods
from kv_preflight.index.pod_log import PodLogError
from kv_preflight.config import Config
from kv_preflight.engines.endpoints import endpoint_identity
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.keys.multimodal import checked_items
from kv_preflight.keys.prompt import PromptKeys
from kv_preflight.predictor.scoring.groups import apply_groups, pods_groups

log = logging.getLogger("kvpf.dynamo")

MAX_NAME_BYTES = 256  # model_name, routing_group of a registration
MAX_ENDPOINT_BYTES = 512
MAX_WORKERS_PAGE = 1000  # /workers answers at most this many workers a request (?limit=, ?offset=)
QUERY_BODY_LIMIT = 8 * 1024 * 1024  # Dynamo's QUERY_REQUEST_BODY_LIMIT_BYTES
OTHER_BODY_LIMIT = 64 * 1024
_encoder = msgspec.json.Encoder()


def _json(data: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(data), status_code=status, media_type="application/json")


def _error(message: str, status: int) -> Response:
    return _json({"error": message}, status)


class Unanswerable(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.message, self.status = message, status


async def _decode(request: Request, kind: type, limit: int, cfg: Config) -> Any:
    """The body as ``kind``: 400 for text that is not JSON, 422 for JSON of the wrong shape (what axum's
    ``Json`` extractor answers), 413 over the limit."""
    try:
        body = await read_json_body(request, limit=limit, timeout_s=cfg.request_read_timeout_s)
    except PredictorError as exc:
        raise Unanswerable(exc.message, exc.status) from None
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        try:  # msgspec checks the shape while it parses: text that is not JSON at all is still a 400
            msgspec.json.decode(body)
        except (msgspec.DecodeError, RecursionError) as syntax:
            raise Unanswerable(f"Failed to parse the request body as JSON: {str(syntax)[:300]}", 400) from None
        raise Unanswerable(f"Failed to deserialize the JSON body into the target type: {str(exc)[:300]}", 422) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise Unanswerable(f"Failed to parse the request body as JSON: {str(exc)[:300]}", 400) from None


class DynamoApi:
    """The routes' logic over one Index; every Valkey step bounded like the predictor's."""

    def __init__(self, cfg: Config, index: Index):
        self.cfg = cfg
        self.index = index
        self._view: fleet.FleetView | None = None  # the fleet's leases, for the answers' freshness
        self._view_at = -1e9
        self._view_failing: str | None = None  # why the last read of the fleet's records failed (None: it did not)

    @property
    def deadline_s(self) -> float:
        return 4 * self.cfg.valkey_timeout_s

    async def registrations(self) -> dict[str, fleet.RegisteredEngine]:
        """This API's registrations (``dynamo:`` ids) among the run-time engines."""
        async with valkey_call(self.deadline_s, "registered engines"):
            found = await self.index.fleet.registered_engines()
        return {k: r for k, r in found.items() if k.startswith("dynamo:") and r.instance_id is not None}

    # ---- /register

    async def register(self, req: RegisterRequest) -> tuple[int, dict[str, str]]:
        refused = self._check_endpoints(req)
        if refused is not None:
            return refused
        for name, value, most in (("model_name", req.model_name, MAX_NAME_BYTES),
                                  ("routing_group", req.routing_group, MAX_NAME_BYTES),
                                  ("endpoint", req.endpoint, MAX_ENDPOINT_BYTES),
                                  ("replay_endpoint", req.replay_endpoint or "", MAX_ENDPOINT_BYTES)):
            if len(value.encode()) > most:
                return 400, {"error": f"{name} is {len(value.encode())} bytes, over the {most} a registration may hold"}
            if name.endswith("_name") and not value:
                return 400, {"error": f"{name} is empty"}
        rank = req.dp_rank or 0
        async with valkey_call(self.deadline_s, "registered engines"):
            every = await self.index.fleet.registered_engines()
            view = await self.index.fleet.fleet_view()
        refused = self._check_endpoints(req, self._own_services(every, view))
        if refused is not None:
            return refused
        if len(every) >= self.cfg.max_registered_engines:
            return 429, {"error": f"{len(every)} engines are registered, the most this index takes "
                                  f"(--max-registered-engines {self.cfg.max_registered_engines})"}
        same_model = sum(1 for r in every.values() if r.model == req.model_name)
        if same_model >= self.cfg.max_registered_per_model:
            return 429, {"error": f"{same_model} engines are registered for model={req.model_name}, the most one "
                                  f"model takes (--max-registered-per-model {self.cfg.max_registered_per_model})"}
        regs = {k: r for k, r in every.items() if k.startswith("dynamo:") and r.instance_id is not None}
        mine = [r for r in regs.values() if r.instance_id == req.instance_id]
        for r in mine:
            if (r.model, r.routing_group) != (req.model_name, req.routing_group):
                return 409, {"error": f"instance {req.instance_id} is already registered for model={r.model} "
                                      f"routing_group={r.routing_group}"}
            if r.dp_rank == rank:
                return 409, {"error": f"instance {req.instance_id} dp_rank {rank} already registered"}
        for r in regs.values():
            if (r.model, r.routing_group) == (req.model_name, req.routing_group) and r.block_size != req.block_size:
                return 409, {"error": f"block_size mismatch for model={req.model_name} routing_group="
                                      f"{req.routing_group}: existing={r.block_size}, requested={req.block_size}"}
        mine_ids = {k for k, r in every.items() if r.instance_id == req.instance_id}
        taken = _sources_in_use(every, view, exclude=mine_ids, own_pods={registered_pod(req.instance_id, rank)})
        for endpoint in filter(None, (req.endpoint, req.replay_endpoint)):
            owner = taken.get(endpoint_identity(endpoint))
            if owner is not None:  # a second pod with the same cache would be a phantom copy of the first
                return 409, {"error": f"endpoint {endpoint} is already a source of {owner}"}
        async with valkey_call(self.deadline_s, "register"):
            now = await self.index.fleet.now_ms()
            await self.index.fleet.unforget_pods([registered_pod(req.instance_id, rank)])  # registered anew
            await self.index.fleet.register_engine(registration_id(req.instance_id, rank), fleet.RegisteredEngine(
                source=req.endpoint, replay=req.replay_endpoint or "", pod=registered_pod(req.instance_id, rank),
                model=req.model_name, engine="vllm", instance_id=req.instance_id, registered_ms=now,
                block_size=req.block_size, dp_rank=rank, routing_group=req.routing_group))
        log.info("registered instance %d dp_rank %d (%s, %s) at %s", req.instance_id, rank, req.model_name,
                 req.routing_group, req.endpoint)
        return 201, {"status": "ok"}

    def _check_endpoints(self, req: RegisterRequest,
                         services: dict[str, str] | None = None) -> tuple[int, dict[str, str]] | None:
        """400 for a malformed endpoint, 403 for one refused (outside --register-allow or --register-ipc-dir,
        or one of ``services``), None when both endpoints may be subscribed."""
        for endpoint in filter(None, (req.endpoint, req.replay_endpoint)):
            try:
                check_endpoint(endpoint, self.cfg.register_allow, self.cfg.register_ipc_dirs, services)
            except EndpointError as exc:
                msg = str(exc)
                if endpoint == req.replay_endpoint and endpoint != req.endpoint:
                    msg = msg.replace("invalid endpoint", "invalid replay endpoint", 1)
                return 400, {"error": msg}
            except EndpointRefused as exc:
                return 403, {"error": f"endpoint refused: {exc}"}
        return None

    def _own_services(self, registered: Mapping[str, fleet.RegisteredEngine], view: fleet.FleetView) -> dict[str, str]:
        """The TCP servers of this deployment that are no ZMQ publisher: Valkey (the URL's node, and on a
        cluster every node its client knows), this server's HTTP ports, and every engine's HTTP port the
        fleet knows (the engines it serves, its pod records, the engines registered by URL)."""
        cfg = self.cfg
        valkey = [cfg.valkey_url]
        valkey += [f"redis://{host}:{port}" for host, port in self.index.backend.nodes()]  # a cluster's shards
        http = {f"http://{cfg.host}:{cfg.port}": "the predictor's HTTP port"}
        if cfg.dynamo_port:
            http[f"http://{cfg.host}:{cfg.dynamo_port}"] = "this remote-indexer API's HTTP port"
        engines = [u for urls in cfg.engine_urls.values() for u in urls]
        engines += [r.engine_url for r in view.pods.values() if r.engine_url]
        engines += [r.url for r in registered.values() if r.url]
        http.update({u: "an engine's HTTP port" for u in engines})
        return own_services(valkey, http)

    # ---- /unregister

    async def unregister(self, req: UnregisterRequest) -> tuple[int, dict[str, str]]:
        regs = await self.registrations()
        mine = {k: r for k, r in regs.items() if r.instance_id == req.instance_id}
        if not mine:
            return 404, {"error": f"instance {req.instance_id} not found"}
        first = next(iter(mine.values()))
        if first.model != req.model_name or (req.routing_group is not None and first.routing_group != req.routing_group):
            return 404, {"error": f"instance {req.instance_id} is registered for model={first.model} "
                                  f"routing_group={first.routing_group}"}
        if req.routing_group is not None and req.dp_rank is not None:
            mine = {k: r for k, r in mine.items() if r.dp_rank == req.dp_rank}
            if not mine:
                return 404, {"error": f"instance {req.instance_id} dp_rank {req.dp_rank} not found"}
        async with valkey_call(self.deadline_s + LET_GO_WAIT_S, "unregister"):
            for engine_id in mine:
                await self.index.fleet.unregister_engine(engine_id)
            # Dynamo drops an unregistered worker's blocks from its tree: its entries go with it here, once
            # no ingester ingests it any more (a worker still publishing would otherwise come back as a pod
            # that no listing shows: index/lifecycle.py)
            try:
                await forget_pods(self.index, sorted({r.pod for r in mine.values()}), keep_refusing=True)
            except PodLogError as exc:  # its entries cannot be found to clear: left, flagged (nothing let go)
                log.error("unregistered instance %d, but its entries are left: %s", req.instance_id, exc)
                if exc.pod_id:
                    await self.index.meta.mark_incomplete(exc.pod_id, f"unregistered; not cleared: {exc}"[:300])
                return 500, {"error": f"instance {req.instance_id} unregistered, but its entries are left "
                                      f"(flagged incomplete): {exc}"}
        log.info("unregistered instance %d (%d listener(s))", req.instance_id, len(mine))
        return 200, {"status": "ok"}

    # ---- /workers

    async def workers(self, model_name: str | None, routing_group: str | None) -> list[WorkerInfo]:
        regs = await self.registrations()
        async with valkey_call(self.deadline_s, "workers"):
            pods = await self.index.meta.pod_ids()  # pod -> model, for pods that have sent events
            view = await self.index.fleet.fleet_view()
            registered_pods = {r.pod for r in regs.values()}
            infos = {i.pod_id: i for i in await self.index.meta.pod_infos(sorted(set(pods) - registered_pods))}
        out: dict[int, WorkerInfo] = {}
        for r in sorted(regs.values(), key=lambda r: (r.instance_id, r.dp_rank)):
            status = _status(r.pod, pods, view)
            w = out.get(r.instance_id)  # type: ignore[arg-type]
            if w is None:
                w = out[r.instance_id] = WorkerInfo(  # type: ignore[index]
                    instance_id=r.instance_id, source="zmq", status=status, model_name=r.model,  # type: ignore[arg-type]
                    routing_group=r.routing_group or DEFAULT_ROUTING_GROUP, block_size=r.block_size,
                    endpoints={}, listeners={})
            w.endpoints[str(r.dp_rank)] = r.source
            w.listeners[str(r.dp_rank)] = ListenerInfo(endpoint=r.source, status=status)
            w.status = _aggregate([x.status for x in w.listeners.values()])
        for pod in sorted(set(pods) - registered_pods):
            info = infos.get(pod)
            # a data-parallel rank (``<pod>@dp<r>``, index/rank_pods.py) answers under its pod's id
            out.setdefault(stable_instance_id(base_pod(pod)), WorkerInfo(
                instance_id=stable_instance_id(base_pod(pod)), source="zmq", status=_status(pod, pods, view),
                model_name=pods[pod], routing_group=DEFAULT_ROUTING_GROUP,
                block_size=(info.engine_block_size or 0) if info else 0, endpoints={}, listeners={}))
        return [w for w in out.values()
                if (model_name is None or w.model_name == model_name)
                and (routing_group is None or w.routing_group == routing_group)]

    # ---- /query

    async def query(self, req: QueryRequest) -> tuple[int, Any]:
        regs = await self.registrations()
        async with valkey_call(self.deadline_s, "pods"):
            pods = await self.index.meta.pod_ids()
        part = [r for r in regs.values() if (r.model, r.routing_group) == (req.model_name, req.routing_group)]
        worker_of = {r.pod: (r.instance_id, r.dp_rank) for r in part}
        registered_pods = {r.pod for r in regs.values()}
        if req.routing_group == DEFAULT_ROUTING_GROUP:
            # Pods nobody registered (ingested from --engine, --source, discovery) form the default group.
            # A data-parallel engine's ranks (``<pod>@dp<r>``, index/rank_pods.py) answer under their pod's id, per rank.
            for pod, model in pods.items():
                if model == req.model_name and pod not in registered_pods:
                    base, rank = split_rank_pod(pod)
                    worker_of[pod] = (stable_instance_id(base), rank)
        if not worker_of:
            return 404, {"error": f"no indexer for model={req.model_name} routing_group={req.routing_group}"}
        block_sizes = {r.block_size for r in part if r.block_size}
        try:
            items = checked_items(req.mm_items, len(req.token_ids)) if req.mm_items else ()
            prompt = PromptKeys(req.token_ids, req.lora_name or req.model_name, self.cfg.block_size,
                                hash_seed=self.cfg.hash_seed, cache_salt=req.cache_salt, items=items,
                                hash_algo=self.cfg.hash_algo)
            keys = prompt.keys
        except ValueError as exc:
            return 422, {"error": str(exc)[:300]}
        prefixes: dict[str, tuple[int, int, int]] = {}
        engine_blocks: dict[str, int | None] = {}
        incomplete: list = []
        if keys:
            async with valkey_call(self.deadline_s, "query"):
                infos = []
                for chain, pods in (await self._chains(prompt, part, worker_of)).items():
                    got, got_infos = await self._prefixes(list(chain), pods, worker_of, req.model_name,
                                                          len(req.token_ids))
                    prefixes.update(got)
                    infos += got_infos
            engine_blocks = {i.pod_id: i.engine_block_size for i in infos}
            incomplete = [i for i in infos if i.incomplete]
            if not block_sizes:
                block_sizes = {b for b in engine_blocks.values() if b}
        unit = block_sizes.pop() if len(block_sizes) == 1 else self.cfg.block_size
        answer = build_score_response(
            prefixes, canonical_block=self.cfg.block_size, engine_blocks=engine_blocks, worker_of=worker_of,
            expected=[(r.instance_id, r.dp_rank) for r in part], block_size=unit)  # type: ignore[misc]
        named = sorted(set(prefixes) | {r.pod for r in part})[:MAX_WORKERS_PAGE]
        view = await self._fleet_view()
        now_ms = view.now_ms + int((time.monotonic() - self._view_at) * 1000) if view is not None else 0
        per_pod = pod_freshness(view, named, now_ms, time.time())
        label = {p: str(i) if r == 0 else f"{i}/{r}" for p, (i, r) in worker_of.items()}
        fresh = answer_freshness({label.get(p, p): f for p, f in per_pod.items()},
                                 incomplete=[label.get(i.pod_id, i.pod_id) for i in incomplete],
                                 holders=[label.get(p, p) for p in prefixes], fleet_problem=self._fleet_problem())
        return 200, msgspec.structs.replace(answer, freshness=fresh)

    async def _chains(self, prompt: PromptKeys, part: list[fleet.RegisteredEngine],
                      worker_of: Mapping[str, tuple[int, int]]) -> dict[tuple[int, ...], list[str]]:
        """The workers to read under each chain of the prompt: all under one for a text prompt; with multimodal
        items, each under the chain of its engine block size (its registration's, else its meta's, else the
        canonical size), sizes that give the same chain together (keys/prompt.py)."""
        pods = sorted(worker_of)
        if not prompt.items:
            return {tuple(prompt.keys): pods}
        registered = {r.pod: r.block_size for r in part if r.block_size}
        infos = {i.pod_id: i for i in await self.index.meta.scoring_infos([p for p in pods if p not in registered])}
        out: dict[tuple[int, ...], list[str]] = {}
        for pod in pods:
            info = infos.get(pod)
            size = registered.get(pod) or (info.engine_block_size if info is not None else None)
            out.setdefault(tuple(prompt.for_engine_block(size)), []).append(pod)
        return out

    async def _prefixes(self, keys: list[int], pods: list[str], worker_of: Mapping[str, tuple[int, int]], model: str,
                        n_tokens: int) -> tuple[dict[str, tuple[int, int, int]], list[Any]]:
        """Each of ``pods``' tier prefixes of the chain, and the pods' scoring infos. The lookup script (one round
        trip) finds each pod's prefix over every tier; only that deep are the keys' fields read to split it by
        tier (nothing at all on a miss)."""
        matches = await self.index.lookup(keys, pods)
        depth = max((m.blocks for m in matches), default=0)
        fields = await self.index.fields_per_key(keys[:depth]) if depth else []
        prefixes = tier_prefixes(fields, {p: worker_of[p] for p in pods})
        ranked = dp_pods_of(pods)
        if ranked:  # the ranks of a pod share its llm-d entries: each rank's prefix is its bits'
            prefixes = {p: v for p, v in prefixes.items() if base_pod(p) not in ranked}
            prefixes.update({m.pod_id: rank_prefix(m.blocks, m.tier) for m in matches if base_pod(m.pod_id) in ranked})
        infos = await self.index.meta.scoring_infos(sorted(prefixes))  # block size and KV cache groups
        hybrid = pods_groups({i.pod_id: i.groups for i in infos}, self.cfg.group_specs.get(model))
        if hybrid:
            prefixes = await self._hybrid_prefixes(keys, matches, prefixes, hybrid, infos, n_tokens)
        return prefixes, infos

    async def _fleet_view(self) -> fleet.FleetView | None:
        """The fleet's leases, read at most once a second (they are renewed once a second)."""
        if time.monotonic() - self._view_at > 1.0:
            try:
                async with valkey_call(self.deadline_s, "fleet"):
                    self._view = await self.index.fleet.fleet_view()
                self._view_at = time.monotonic()
                self._view_failing = None
            except PredictorError as exc:
                # the last view, aged (its leases turn late, then expired), or none: its pods read "unknown"
                self._view_failing = exc.message
        return self._view

    def _fleet_problem(self) -> str | None:
        """Why the answer's accounts may be old: the fleet's records not readable since the last read."""
        if self._view_failing is None:
            return None
        age = f" for {int((time.monotonic() - self._view_at) * 1000)} ms" if self._view is not None else ""
        return (f"the fleet records (ingester leases, pod records) not read{age} ({self._view_failing[:200]}): "
                "each pod's account is as of the last successful read")

    async def _hybrid_prefixes(self, keys: list[int], matches: list[Any], prefixes: dict[str, tuple[int, int, int]],
                               hybrid: dict[str, Any], infos: list[Any], n_tokens: int) -> dict[str, tuple[int, int, int]]:
        """Each hybrid pod's tier prefixes capped at what all its KV cache groups' rules accept (issue 24), as
        /predict counts it but without its last-token rule: Dynamo's overlap is whole blocks of the tokens."""
        mine = [m for m in matches if m.pod_id in hybrid]
        depth = max((m.blocks for m in mine), default=0)
        if not depth:
            return prefixes
        presence, nums = await self.index.group_presence(keys[:depth], hybrid)
        adjusted = apply_groups(mine, hybrid, {i.pod_id: i.engine_block_size for i in infos}, presence, nums,
                                self.cfg.block_size, n_tokens + 1)
        out = dict(prefixes)
        for m in adjusted:
            if m.pod_id in out:
                out[m.pod_id] = tuple(min(b, m.blocks) for b in out[m.pod_id])  # type: ignore[assignment]
        return out


def _sources_in_use(registered: Mapping[str, fleet.RegisteredEngine], view: fleet.FleetView,
                    exclude: set[str], own_pods: set[str] = frozenset()) -> dict[str, str]:
    """Endpoint identity -> who uses it: every other registration's sockets, and the sockets the live
    ingesters subscribe (engines found by --engine, --source, discovery), as their leases list them."""
    taken: dict[str, str] = {}
    for engine_id, r in registered.items():
        if engine_id not in exclude:
            for endpoint in filter(None, (r.source, r.replay)):
                taken.setdefault(endpoint_identity(endpoint), f"registered engine {engine_id}")
    excluded = {endpoint_identity(e) for k in exclude for e in (registered[k].source, registered[k].replay) if e}
    for ingester, lease in view.live_ingesters().items():
        for endpoint, pod in lease.sources.items():
            # the instance's own sockets, ingested already (its registration lost with Valkey's data, say)
            if endpoint_identity(endpoint) not in excluded and not (pod and pod in own_pods):
                taken.setdefault(endpoint_identity(endpoint), f"an engine ingested by {ingester}")
    return taken


def _status(pod: str, pods: Mapping[str, str], view: fleet.FleetView) -> str:
    """Dynamo's listener status: pending until the pod's first batch is in the index, failed while the
    fleet finds it unreachable, active otherwise."""
    record = view.pods.get(pod)
    if record is not None and record.state == "unreachable":
        return "failed"
    return "active" if pod in pods else "pending"


def _aggregate(statuses: list[str]) -> str:
    """Dynamo's ListenerStatus::aggregate: failed > pending > active > paused."""
    for s in ("failed", "pending", "active"):
        if s in statuses:
            return s
    return "paused"


def create_dynamo_app(cfg: Config, index: Index | None = None) -> Starlette:
    """The ASGI app of the remote-indexer port; ``index`` for callers that own one (tests)."""
    keys = load_api_keys(cfg.api_keys_file, cfg.api_keys)
    owns = index is None
    if index is None:
        index = Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format,
                               cluster=cfg.cluster_mode())
    api = DynamoApi(cfg, index)

    def route(kind: type | None, method: str, limit: int = OTHER_BODY_LIMIT):
        async def handler(request: Request) -> Response:
            try:
                if kind is None:
                    args = (request.query_params.get("model_name"), request.query_params.get("routing_group"))
                    try:
                        offset = int(request.query_params.get("offset", "0"))
                        size = int(request.query_params.get("limit", MAX_WORKERS_PAGE))
                    except ValueError:
                        return _error("offset and limit are whole numbers", 400)
                    if offset < 0 or size < 1:  # refused, not clamped: a client's arithmetic gone wrong says so
                        return _error(f"offset must be 0 or more and limit 1 or more (got offset={offset}, "
                                      f"limit={size})", 400)
                    size = min(MAX_WORKERS_PAGE, size)
                    every = await api.workers(*args)
                    page = _json(every[offset:offset + size])
                    if offset + size < len(every):  # a bounded answer: the rest by ?offset=
                        page.headers["x-kvpf-next-offset"] = str(offset + size)
                    return page
                status, body = await getattr(api, method)(await _decode(request, kind, limit, cfg))
                return _json(body, status)
            except Unanswerable as exc:
                return _error(exc.message, exc.status)
            except PredictorError as exc:  # Valkey unreachable or slow: Dynamo's indexer failure is a 500
                return _error(exc.message, 500 if exc.status == 503 else exc.status)
            except VALKEY_ERRORS as exc:
                return _error(f"index unavailable: {type(exc).__name__}", 500)
            except ClientDisconnect:
                return _error("client disconnected", 400)
        return handler

    async def not_implemented(request: Request) -> Response:
        return _error(f"{request.url.path} is not implemented by kv-preflight: it answers from llm-d request keys and "
                      "keeps neither Dynamo's per-block XXH3 hashes nor its event log; use /query with token_ids", 501)

    async def health(request: Request) -> Response:
        return Response(b"", status_code=200)  # Dynamo's handle_health: a bare 200

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(str(exc.detail), exc.status_code)

    async def lifespan_close(app: Starlette):
        yield
        if owns:
            await index.close()

    from contextlib import asynccontextmanager

    middleware = [Middleware(ApiKeyAuth, keys=keys)] if keys else []
    return Starlette(
        routes=[
            Route("/register", route(RegisterRequest, "register"), methods=["POST"]),
            Route("/unregister", route(UnregisterRequest, "unregister"), methods=["POST"]),
            Route("/workers", route(None, "workers"), methods=["GET"]),
            Route("/query", route(QueryRequest, "query", QUERY_BODY_LIMIT), methods=["POST"]),
            Route("/query_by_hash", not_implemented, methods=["POST"]),
            Route("/dump", not_implemented, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=middleware,
        exception_handlers={HTTPException: http_error},
        lifespan=asynccontextmanager(lifespan_close),
    )
