"""The route path: a prompt's keys to one pod, for ``/route`` and the gateway. The prediction (prediction.py) weighed
with each candidate's load, freshness, what the gateways booked and where a new prefix was placed
(predictor/scoring/route.py ``decide``, pure), and the candidates themselves: the pods that may take a request for a
model. ``Predictor`` (prediction.py) is a ``RoutePath``: these methods use its prediction, metadata, fleet and load.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kv_preflight.index.rank_pods import base_pod
from kv_preflight.keys.prompt import PromptKeys
from kv_preflight.predictor.explain.findings import Finding
from kv_preflight.predictor.errors import clip
from kv_preflight.predictor.request import KeyedRequest, PredictRequest
from kv_preflight.predictor.load import PodLoad
from kv_preflight.predictor.scoring.freshness import pod_freshness, stale_for_route, untrusted
from kv_preflight.predictor.scoring.placement import PlacementHint
from kv_preflight.predictor.scoring.ranks import decision_with_ranks
from kv_preflight.index.rank_pods import pods_with_ranks
from kv_preflight.predictor.scoring.route import RouteDecision, decide, placed_on, placement_order
from kv_preflight.predictor.scoring.score import Prediction
from kv_preflight.predictor.valkey_call import valkey_call

MAX_FRESHNESS_PODS = 64  # route candidates a route's freshness lists beside the pods holding the prompt


class RoutePath:
    """The routing half of ``Predictor`` (which sets every attribute these methods read)."""

    cfg: Any
    fleet: Any
    load: Any
    metadata: Any
    metrics: Any
    placements: Any
    policy: Any
    routed: Any
    ttft: Any
    warnings: Any

    async def route(self, req: PredictRequest) -> RouteDecision:
        model, prompt, n_tokens, head = await self._request_keys(req)
        decision = await self._route_keys(model, prompt.keys, n_tokens, await self.expand_pods(req.pods),
                                          req.max_staleness_ms, prompt)
        return msgspec.structs.replace(decision, warnings=self._warn(req, model, head) + decision.warnings)

    async def request_keys(self, req: PredictRequest | KeyedRequest) -> tuple[str, list[int], int, list[Finding]]:
        """(model, request keys, prompt length, the prompt's warnings): what ``route_keys`` decides from. The
        gateway tokenizes a request once with it and decides again from the same keys after a failed upstream."""
        if isinstance(req, KeyedRequest):
            await self._check_model(req.model, need_engine=False)
            return req.model, req.keys, req.n_tokens, self.warnings.check_keyed(req)
        model, prompt, n_tokens, head = await self._request_keys(req)
        # (an OpenAI request names no multimodal items: its canonical chain is every pod's)
        return model, prompt.keys, n_tokens, self._warn(req, model, head)

    async def route_keys(self, model: str, keys: list[int], n_tokens: int) -> RouteDecision:
        """``/route``'s decision for keys ``request_keys`` gave, over every pod serving the model; no ``freshness``
        block (the gateway's answer is the engine's, which has no place for one; the decision itself weighs each
        pod's freshness as ``/route``'s does)."""
        return await self._route_keys(model, keys, n_tokens, None, answer=False)

    async def route_keyed(self, req: KeyedRequest) -> RouteDecision:
        await self._check_model(req.model, need_engine=False)
        decision = await self._route_keys(req.model, req.keys, req.n_tokens, await self.expand_pods(req.pods),
                                          req.max_staleness_ms)
        return msgspec.structs.replace(decision, warnings=self.warnings.check_keyed(req) + decision.warnings)

    async def _route_keys(self, model: str, keys: list[int], n_tokens: int, pods: list[str] | None,
                          max_staleness_ms: int | None = None, prompt: PromptKeys | None = None,
                          answer: bool = True) -> RouteDecision:
        if pods is not None:
            await self._check_pods_filter(pods)
        # what the gateways routed (bookings, speculative entries), read while the lookup runs: predictor/routed.py
        routed = self.routed.start(self.foreseen(model, pods), keys) if self.routed is not None else None
        prediction = await self._predict_keys(model, keys, n_tokens, pods, prompt, routed, fresh=False)
        candidates = await self._route_candidates(model, prediction, pods)
        freshness = self.freshness_of(prediction, None, extra=sorted(candidates)[:MAX_FRESHNESS_PODS]) if answer else None
        held = [a.pod_id for a in prediction.pod_affinities]
        per_pod = self.fleet.freshness(held) if self.fleet is not None else pod_freshness(None, held, 0, 0.0)
        if self.routed is not None:  # an engine no ingester feeds, routed by the gateways' approximate index
            per_pod = self.routed.mark_approximate(per_pod)
        stale = []
        if max_staleness_ms is not None:
            aged = {p: self.fleet.aged(f) for p, f in per_pod.items()} if self.fleet is not None else per_pod
            stale = stale_for_route(aged, max_staleness_ms)
        if self.fleet is not None and (distrusted := untrusted(per_pod)):  # blocks nobody vouches for: not routed by
            prediction = msgspec.structs.replace(
                prediction, pod_affinities=[a for a in prediction.pod_affinities if a.pod_id not in distrusted])
        if stale:  # the cache it would route by may be older than allowed: by load alone, and say why
            prediction = msgspec.structs.replace(prediction, pod_affinities=[], best_pod=None,
                                                 predicted_cached_tokens=0, blocks_cached=0, cache_hit_ratio=0.0)
        loads = {p: self.load_of(p) for p in candidates}
        shared = await routed.for_route(candidates) if routed is not None else None
        # no await from the hint to the note below (but a claim's, which settles the same prefix fleet-wide): a
        # concurrent request of the same new prefix sees this placement
        hint = self.placements.hint(keys[0], candidates) if self.placements is not None and keys else PlacementHint()
        footprints = hint.footprints or None
        if shared is not None and self.routed is not None and self.routed.window_ms > 0:
            footprints = {p: r.footprint for p, r in shared.items()}  # every gateway's placements, not ours alone
        pending = hint.pending or (self.routed.pending(shared) if self.routed is not None else None)
        decision = decide(prediction, candidates, loads, policy=self.policy, ttft=self.ttft.for_model(model),
                          affinity_key=keys[0] if keys else n_tokens, footprints=footprints, pending=pending,
                          booked={p: r.booked for p, r in shared.items()} if shared else None,
                          booked_at_scrape=self.routed.booked_at_scrape(loads) if shared else None)
        if self.routed is not None and keys and pending is None and \
                len(order := placement_order(decision, keys[0])) > 1:
            # a new prefix, placed fleet-wide: with the placements of the last moment that our read may not show (a
            # pod claimed for it elsewhere that is overloaded, or no longer a candidate here, is not taken)
            claimed = await self.routed.claim(keys[0], len(keys), order)
            if claimed is not None and claimed != decision.pod_id and any(p == claimed for p, _ in order):
                decision = placed_on(decision, claimed)
        if pods and not candidates:  # the filter named pods, and none may take a request now
            decision = msgspec.structs.replace(decision, detail=clip(
                f"no pod of the pods filter may take it: {', '.join(sorted(pods)[:5])}{' ...' if len(pods) > 5 else ''}"
                " unreachable (its engine fails its health checks; the fleet records say so)"))
        if stale:  # the cache was not consulted: the rule's own reason (no_overlap, ...) would only mislead
            decision = msgspec.structs.replace(
                decision, reason="stale_index", detail=clip(
                    f"routed by load alone, the cache not consulted: the index of {', '.join(stale[:5])}"
                    f"{' ...' if len(stale) > 5 else ''} may be older than max_staleness_ms {max_staleness_ms} (a current "
                    "pod's staleness is up to about 2 s: a renewal and a read apart)"))
        elif self.placements is not None and keys and decision.pod_id is not None:
            self._note_placement(keys[0], len(keys), prediction, decision)
        self.metrics.route(decision.reason)
        # what the prediction could not claim (hybrid groups not all known) holds for the route built on it
        decision = decision_with_ranks(decision, self.dp_pods())
        return msgspec.structs.replace(decision, freshness=freshness, warnings=list(prediction.warnings or []))

    def foreseen(self, model: str, pods: list[str] | None) -> set[str]:
        """The pods a route for ``model`` will likely have as candidates, from what is in memory (no read): the
        pods filter, else those the index, the fleet records and the scraped engines say serve it."""
        if pods is not None:
            return set(pods)
        out = set(self.metadata.cached_pods_of(model))
        if self.fleet is not None:
            retired = self.fleet.retired()
            out = {p for p in out | self.fleet.serving(model) if base_pod(p) not in retired}
        if self.load is not None:
            out |= self.load.serving(model) or set()
        return out

    def _note_placement(self, prefix: int, blocks: int, prediction: Prediction, decision: RouteDecision) -> None:
        """The prefix's home: the pod holding the most of it, or, when nobody does, the pod it was sent to."""
        assert self.placements is not None and decision.pod_id is not None
        if decision.best_overlap_pod is None:
            self.placements.placed(prefix, decision.pod_id, blocks)
            if self.routed is not None:
                self.routed.home(prefix, decision.pod_id, blocks)
            return
        best = next((a for a in prediction.pod_affinities if a.pod_id == decision.best_overlap_pod), None)
        if best is not None:
            self.placements.seen(prefix, best.pod_id, best.cached_blocks)
            if self.routed is not None:
                self.routed.home(prefix, best.pod_id, best.cached_blocks)

    async def _route_candidates(self, model: str, prediction: Prediction, pods: list[str] | None) -> set[str]:
        """Pods that may take a request for ``model``: the ``pods`` filter, else every pod known to serve it.

        Known: holds blocks of this prompt under this model's keys (a LoRA adapter's keys carry its
        name, so base-model blocks never count for an adapter), is in the index under this model, or
        lists it in ``/v1/models``. A pod whose model list is known and lacks the model is dropped, and
        so is a pod whose metrics stopped answering, while another candidate is left.
        """
        fleet_out = self.fleet.unreachable() | self.fleet.retired() if self.fleet else frozenset()
        if pods is not None:
            pods = pods_with_ranks(pods, [a.pod_id for a in prediction.pod_affinities])  # ranks found of a pod named
            return {p for p in pods if base_pod(p) not in fleet_out}
        out = {a.pod_id for a in prediction.pod_affinities}
        known = self.metadata.fresh_pods_of(model)  # (no read, no deadline to set, while the registry's read is fresh)
        if known is None:
            async with valkey_call(self.valkey_deadline_s, "pods of model"):
                known = await self.metadata.pods_of(model)
        out |= known
        if self.fleet is not None:
            # every pod whose record lists the model; unreachable and retired pods are never routed to (nor their
            # data-parallel ranks, whose record is their pod's)
            out |= self.fleet.serving(model)
            out = {p for p in out if ((ms := self.fleet.models_of(base_pod(p))) is None or model in ms)
                   and base_pod(p) not in fleet_out}
        if self.load is not None:
            out |= self.load.serving(model) or set()
            out = {p for p in out if p not in self.load.served or model in self.load.served[p]}
            reachable = out - self.load.unreachable()
            out = reachable or out
        if self.routed is not None:  # pods that just failed a request here, while another is left
            out = self.routed.usable(out)
        return out

    def load_of(self, pod: str) -> PodLoad | None:
        """The predictor's own scrape (--pod-metrics, --engine-url) when fresh, else the fleet's shared load."""
        base = base_pod(pod)
        own = self.load.snapshot(base, self.policy.stale_s) if self.load else None
        if own is None and self.fleet is not None:
            # a data-parallel rank's own load when its owner scraped it per rank, else its engine's
            shared = self.fleet.load(pod, self.policy.stale_s)
            return shared if shared is not None or base == pod else self.fleet.load(base, self.policy.stale_s)
        return own


__all__ = ["MAX_FRESHNESS_PODS", "RoutePath"]
