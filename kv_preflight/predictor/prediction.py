"""The prediction path, from a validated request to a Prediction, with its I/O bounded.

Per request: tokens (given, or from the engine), request keys (C, in-process), one
Valkey round trip for every pod's consecutive prefix, pod metadata from a ~1 s
cache, then pure scoring. Every Valkey call runs under a deadline, and any Valkey
failure becomes IndexUnavailable (503) rather than a hang or a 500.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kv_preflight.predictor.explain.findings import Finding
from kv_preflight.predictor.errors import (BadRequest, EngineUnavailable, IndexUnavailable, NotFound, NotReady,
                                           UnknownModel, clip)
from kv_preflight.predictor.fleet_view import FleetWatcher
from kv_preflight.predictor.load import LoadMonitor
from kv_preflight.predictor.metadata import IndexMetadata
from kv_preflight.predictor.metrics import PredictorMetrics
from kv_preflight.predictor.route_path import MAX_FRESHNESS_PODS, RoutePath
from kv_preflight.predictor.routed import RoutedRead, RoutedState
from kv_preflight.predictor.valkey_call import valkey_call
from kv_preflight.predictor.scoring.routed import mark_speculative, with_routed
from kv_preflight.predictor.scoring.placement import PrefixPlacements
from kv_preflight.predictor.explain.warnings import PromptWarnings
from kv_preflight.predictor.request import KeyedRequest, PredictRequest, check_mm_items, check_token_count
from kv_preflight.predictor.scoring.route import RoutingPolicy
from kv_preflight.predictor.scoring.freshness import Freshness, answer_freshness, pod_freshness
from kv_preflight.predictor.scoring.score import Prediction, score
from kv_preflight.predictor.scoring.ranks import dp_pods_of, with_ranks
from kv_preflight.index.rank_pods import base_pod, pods_with_ranks
from kv_preflight.predictor.stats import ProcessCounters, StatsQuery, build_stats, read_pods_summary
from kv_preflight.predictor.tokens.source import Tokenization
from kv_preflight.predictor.tokens.engine import EngineTokenizer
from kv_preflight.predictor.diagnosis.traffic import Traffic
from kv_preflight.predictor.diagnosis.fleet import stats_view as diagnosis_view
from kv_preflight.predictor.scoring.ttft import TtftModels
from kv_preflight.config import Config
from kv_preflight.index.entries import Lookup
from kv_preflight.index.index import VALKEY_ERRORS, Index
from kv_preflight.index.pod_meta import ScoringInfo
from kv_preflight.index.presence import read_group_bits
from kv_preflight.predictor.scoring.groups import CompleteGroups, apply_groups, group_findings, keys_needed, pods_groups
from kv_preflight.keys.multimodal import MultimodalItem
from kv_preflight.keys.prompt import PromptKeys


ALIASES_TTL_S = 1.0  # a pod renamed by `ingest --pod-id endpoint` is known to pods filters within a second
PARTIAL_LOG_S = 10.0  # a shard down makes every answer partial: one log line a while says why, the counter counts

log = logging.getLogger("kvpf.predictor")


@dataclass
class Predictor(RoutePath):
    cfg: Config
    index: Index
    tokenizer: EngineTokenizer
    metadata: IndexMetadata
    counters: ProcessCounters
    owns_index: bool = True
    tokenization: Tokenization = None  # type: ignore[assignment]  # set in __post_init__ when not given
    ttft: TtftModels = field(default_factory=TtftModels)
    policy: RoutingPolicy = field(default_factory=RoutingPolicy)
    load: LoadMonitor | None = None  # engine metrics for routing; None: no engine to scrape
    metrics: PredictorMetrics = field(default_factory=PredictorMetrics)
    _aliases: dict[str, list[str]] = field(default_factory=dict)  # kvpf:aliases, cached ALIASES_TTL_S
    _aliases_at: float = float("-inf")
    warnings: PromptWarnings = None  # type: ignore[assignment]  # set in __post_init__
    traffic: Traffic = field(default_factory=Traffic)  # for kv-preflight diagnose fleet (predictor/diagnosis/traffic.py)
    fleet: FleetWatcher | None = None  # the ingesters' fleet records (kvpf:fleet, kvpf:load); None: not read
    placements: PrefixPlacements | None = None  # where this process sent new prefixes lately; None: by load only
    complete_groups: CompleteGroups = field(default_factory=CompleteGroups)  # hybrid pods found fully described
    routed: RoutedState | None = None  # what the gateway sent where (predictor/routed.py); None: the index alone
    _partial_logged_at: float = float("-inf")

    def __post_init__(self) -> None:
        if self.tokenization is None:
            self.tokenization = Tokenization(self.tokenizer, {})
        if self.warnings is None:
            self.warnings = PromptWarnings(self.tokenization)

    @classmethod
    def create(cls, cfg: Config, index: Index | None = None) -> "Predictor":
        owns = index is None
        if index is None:
            index = Index.from_url(cfg.valkey_url, timeout_s=cfg.valkey_timeout_s, entry_format=cfg.entry_format,
                                   cluster=cfg.cluster_mode())
        # the fleet records give every pod's engine: tokenization goes there for a model with no --engine-url
        fleet = FleetWatcher(index, interval_s=min(cfg.metrics_interval_s, 1.0), timeout_s=2 * cfg.valkey_timeout_s)
        engine = EngineTokenizer(cfg.engine_urls, cfg.engine_timeout_s, discovered=fleet.engines_of)
        tokenization = Tokenization.load(engine, cfg.tokenizers, check=cfg.tokenizer_check)
        ttft = TtftModels.load(cfg.ttft_model)
        load = None
        if cfg.pod_metrics or cfg.engine_urls:
            load = LoadMonitor.from_config(cfg.pod_metrics, cfg.engine_urls, cfg.metrics_interval_s)
        return cls(
            cfg=cfg, index=index, tokenizer=engine,
            metadata=IndexMetadata(index), counters=ProcessCounters(), owns_index=owns,
            tokenization=tokenization, ttft=ttft, policy=routing_policy(cfg), load=load, fleet=fleet,
            placements=prefix_placements(cfg),
        )

    @property
    def valkey_deadline_s(self) -> float:
        # socket timeouts bound each read; this bounds the whole step (connect + script + reply)
        return 2 * self.cfg.valkey_timeout_s

    async def predict(self, req: PredictRequest) -> Prediction:
        model, prompt, n_tokens, head = await self._request_keys(req)
        prediction = await self._predict_keys(model, prompt.keys, n_tokens, await self.expand_pods(req.pods), prompt)
        warnings = self._warn(req, model, head) + await self._pods_warnings(req.pods) + (prediction.warnings or [])
        return msgspec.structs.replace(with_ranks(prediction, self.dp_pods()), warnings=warnings)

    def _warn(self, req: PredictRequest, model: str, head: list[int]) -> list[Any]:
        return self.warnings.check(model, head, chat=req.prompt is None)

    async def _request_keys(self, req: PredictRequest) -> tuple[str, PromptKeys, int, list[int]]:
        """(model, the prompt's request keys, prompt length, first two tokens) of a parsed request, tokenizing
        prompt/messages first."""
        model = req.model
        assert model  # parse_request guarantees it
        if req.token_ids is not None:
            await self._check_model(model, need_engine=False)
            tokens = req.token_ids
        else:
            await self._check_model(model, need_engine=True)
            tokens, source = await self.tokenization.tokenize(model, prompt=req.prompt, messages=req.messages)
            self.metrics.tokenized(model, source)
            if not tokens:
                raise BadRequest(f"the {source} tokenizer turned the input into no tokens")
            check_token_count(len(tokens), self.cfg.max_tokens)
            if req.mm_items:
                req.mm_items = check_mm_items(req.mm_items, len(tokens))
        prompt = self.prompt_keys(model, tokens, req.cache_salt, req.mm_items)
        return model, prompt, len(tokens), tokens[:2]

    def prompt_keys(self, model: str, tokens: Sequence[int], cache_salt: str | None = None,
                    items: Sequence[MultimodalItem] | None = None) -> PromptKeys:
        """The prompt's keys under ``model`` (an adapter's name roots an adapter's chain), its canonical chain
        computed now: a token id outside uint32 is the client's error (400)."""
        prompt = PromptKeys(tokens, model, self.cfg.block_size, hash_seed=self.cfg.hash_seed, cache_salt=cache_salt,
                            items=items or (), hash_algo=self.cfg.hash_algo)
        try:
            prompt.keys
        except ValueError as exc:
            raise BadRequest(clip(str(exc))) from None
        return prompt

    async def predict_keyed(self, req: KeyedRequest) -> Prediction:
        """A token_ids request whose keys the request parser already computed (the fast path)."""
        await self._check_model(req.model, need_engine=False)
        prediction = await self._predict_keys(req.model, req.keys, req.n_tokens, await self.expand_pods(req.pods))
        warnings = self.warnings.check_keyed(req) + await self._pods_warnings(req.pods) + (prediction.warnings or [])
        return msgspec.structs.replace(with_ranks(prediction, self.dp_pods()), warnings=warnings)

    async def _pods_warnings(self, pods: list[str] | None) -> list[Finding]:
        """A predict whose pods filter names a pod nobody knows (a typo, a pod not reported yet) or a retired
        one answers, but says so: 0 cached tokens for it would read as "not cached". (A route refuses them.)"""
        if not pods:
            return []
        unknown, gone = await self._pods_not_known(pods)
        out = []
        if unknown:
            out.append(Finding("unknown_pod", None, clip(
                "the pods filter names " + _names(unknown) + ": not in the index, the fleet records or "
                "--pod-metrics, so counted as holding nothing (a typo, or a pod no ingester has reported yet?)")))
        if gone:
            out.append(Finding("retired_pod", None, clip(
                "the pods filter names retired pod(s) " + _names(gone) + ": never offered, counted as holding nothing")))
        return out

    async def _predict_keys(self, model: str, keys: list[int], prompt_len: int, pods: list[str] | None,
                            prompt: PromptKeys | None = None, routed: RoutedRead | None = None,
                            fresh: bool = True) -> Prediction:
        """``keys``: the prompt's canonical chain; ``prompt``: the prompt itself, when its multimodal items key it
        differently per engine block size (each pod is then read under the chain of its own size); ``routed``:
        what the gateways routed (bookings, speculative entries), being read (predictor/routed.py); ``fresh``:
        False for a route, which says its own freshness, over its candidates (route_path.py)."""
        matches: list[Any] = []
        infos: dict[str, ScoringInfo] = {}
        unanswered = None
        why = ""
        findings: list[Finding] = []
        hybrid: dict[str, Any] = {}
        retired = self.fleet.retired() if self.fleet else frozenset()
        if pods is not None and retired:
            pods = [p for p in pods if base_pod(p) not in retired]  # a retired pod is never offered (nor its ranks)
        if routed is None and self.routed is not None and keys:
            routed = self.routed.start(self.foreseen(model, pods), keys)
        # An empty pods filter means no candidate pod, hence nothing cached (not "every pod").
        if keys and (pods is None or pods):
            async with valkey_call(self.valkey_deadline_s, "prefix lookup"):
                if prompt is not None:
                    found_sets = await self.lookup_prompt(prompt, pods)
                else:
                    found_sets = [(keys, await self.index.lookup_detailed(keys, pods, mode=self.cfg.lookup))]
                sets = [(k, [m for m in f.matches if base_pod(m.pod_id) not in retired], f) for k, f in found_sets]
                matches = [m for _, ms, _ in sets for m in ms]
                if pods is not None:  # the ranks found of a pod named (before a registry read lists them)
                    pods = pods_with_ranks(pods, [m.pod_id for m in matches])
                cut = [f for _, f in found_sets if f.unanswered_from is not None]
                if cut:
                    first = min(cut, key=lambda f: f.unanswered_from)
                    unanswered, why = first.unanswered_from, first.unanswered_why
                try:
                    infos = await self.metadata.pod_infos(m.pod_id for m in matches)
                except VALKEY_ERRORS:
                    if unanswered is None:
                        raise
                    # A cluster shard is down and it holds a pod's metadata too: score with the
                    # defaults (canonical blocks); the answer already says it is a lower bound.
                    infos = {}
                declared = self.cfg.group_specs.get(model)
                hybrid = pods_groups({p: i.groups for p, i in infos.items() if i.groups}, declared)
                findings = group_findings(model, (m.pod_id for m in matches), hybrid, declared, self.complete_groups)
                if hybrid:  # a hybrid model's other KV cache groups, read beside: each group's rule decides
                    matches = [m for k, ms, f in sets
                               for m in await self._hybrid_matches(k, ms, hybrid, infos, prompt_len, f.group_bits)]
        speculative: dict[str, int] = {}
        if routed is not None and keys and (pods is None or pods):
            got = await routed.get({m.pod_id for m in matches})
            if got:  # the longest of index, speculative and approximate prefix (predictor/scoring/routed.py)
                matches, speculative = with_routed(matches, got, approximate=self.routed.approximate, skip=hybrid)
                infos = await self._routed_infos(matches, infos, speculative)
        if self.fleet is not None and matches:  # a holder the last read of the records knows nothing of: read again
            approximate = self.routed.approximate if self.routed is not None else ()
            await self.fleet.catch_up({m.pod_id for m in matches if m.pod_id not in approximate})
        prediction = score(matches, prompt_len=prompt_len, canonical_block=self.cfg.block_size, infos=infos,
                           pods=pods, ttft=self.ttft.for_model(model),
                           unreachable=self.fleet.unreachable() if self.fleet else ())
        prediction = mark_speculative(prediction, speculative)
        self.traffic.observe(model, keys[0] if keys else None, prompt_len, prediction.predicted_cached_tokens)
        if unanswered is not None:
            # A cluster shard did not answer: every count is a lower bound from that block on.
            self.metrics.partial_answers.inc()
            now = time.monotonic()
            if now - self._partial_logged_at >= PARTIAL_LOG_S:
                self._partial_logged_at = now
                log.warning("a Valkey Cluster shard did not answer (%s): answers are partial from block %d on, their "
                            "counts lower bounds (kvpf_partial_answers_total counts them; this line comes at most "
                            "every %.0f s)", why or "no reason given", unanswered, PARTIAL_LOG_S)
            prediction = msgspec.structs.replace(prediction, partial=True, partial_from_block=unanswered)
        if findings:  # pods answered without a claim of exactness (hybrid groups not all known)
            prediction = msgspec.structs.replace(prediction, warnings=findings)
        if not fresh:
            return prediction
        if pods is None:  # the pods that could have held it: a pod stalled behind a miss makes the miss stale too
            serving = self.metadata.cached_pods_of(model)  # no read of its own: what the last one said
            if self.fleet is not None:
                serving |= self.fleet.serving(model)
            extra = sorted(p for p in serving if base_pod(p) not in retired)[:MAX_FRESHNESS_PODS]
        else:
            extra = []
        return msgspec.structs.replace(prediction, freshness=self.freshness_of(prediction, pods, extra))

    def freshness_of(self, prediction: Prediction, pods: list[str] | None, extra: Iterable[str] = ()) -> Freshness:
        """The answer's freshness: per pod it names (its matches, the pods filter, ``extra``), the pod's ingestion
        state from the fleet's leases; the state of the whole (predictor/scoring/freshness.py)."""
        holders = [a.pod_id for a in prediction.pod_affinities]
        named = holders + list(pods or ()) + list(extra)
        per_pod = self.fleet.freshness(named) if self.fleet is not None else pod_freshness(None, named, 0, 0.0)
        if self.routed is not None:  # a pod no ingester feeds, indexed by what the gateways sent: approximate
            per_pod = self.routed.mark_approximate(per_pod)
        return answer_freshness(per_pod, partial=prediction.partial, holders=holders,
                                incomplete=[a.pod_id for a in prediction.pod_affinities if a.incomplete],
                                fleet_problem=self.fleet.problem() if self.fleet is not None else None,
                                aged=self.fleet.aged if self.fleet is not None else None)

    async def lookup_prompt(self, prompt: PromptKeys, pods: list[str] | None) -> list[tuple[list[int], Lookup]]:
        """Each pod's prefix of the prompt, as (chain, lookup) pairs: one of a text prompt; a prompt with multimodal
        items read under the chain of each pod's engine block size (``lookup_per_engine_block``)."""
        if prompt.items:
            return await self.lookup_per_engine_block(prompt, pods)
        return [(prompt.keys, await self.index.lookup_detailed(prompt.keys, pods, mode=self.cfg.lookup))]

    async def lookup_per_engine_block(self, prompt: PromptKeys,
                                      pods: list[str] | None) -> list[tuple[list[int], Lookup]]:
        """A prompt with multimodal items read once per engine block size among the pods that may hold it (the
        pods filter, else the model's pods): each chain's matches kept for the pods of its size only (a pod's
        size is its meta's ``engine_block_size``; the canonical size while it has none). A pod found holding
        the prompt whose size was not looked up yet (not listed under the model when this began) is read under
        its own chain in a second round. Sizes whose chains are the same share one lookup."""
        canonical = self.cfg.block_size
        if pods is not None:
            candidates = set(pods)
        else:
            candidates = await self.metadata.pods_of(prompt.model)
            if self.fleet is not None:
                candidates |= self.fleet.serving(prompt.model)
        infos = dict(await self.metadata.pod_infos(sorted(candidates))) if candidates else {}

        def size_of(pod: str) -> int:
            info = infos.get(pod)
            return info.engine_block_size if info is not None and info.engine_block_size else canonical

        sizes = {size_of(p) for p in candidates} or {canonical}
        chains: dict[int, tuple[int, ...]] = {}  # engine block size -> its chain
        found: dict[tuple[int, ...], Lookup] = {}
        for _round in range(2):
            for size in sorted(sizes - set(chains)):
                chain = chains[size] = tuple(prompt.for_engine_block(size))
                if chain not in found:
                    found[chain] = await self.index.lookup_detailed(list(chain), pods, mode=self.cfg.lookup)
            held = {m.pod_id for f in found.values() for m in f.matches} - set(infos)
            if held:
                infos.update(await self.metadata.pod_infos(sorted(held)))
            sizes |= {size_of(m.pod_id) for f in found.values() for m in f.matches}
            if sizes <= set(chains):
                break
        out = []
        for chain, f in found.items():
            mine = {size for size, c in chains.items() if c == chain}
            out.append((list(chain), Lookup([m for m in f.matches if size_of(m.pod_id) in mine], f.unanswered_from,
                                            f.group_bits, f.unanswered_why)))
        return out

    async def _hybrid_matches(self, keys: list[int], matches: list[Any], hybrid: dict[str, Any],
                              infos: dict[str, ScoringInfo], prompt_len: int,
                              group_bits: list[dict[tuple[str, int], bytes]] | None = None) -> list[Any]:
        """Matches of pods with several KV cache groups, replaced by what every group's rule accepts
        (kv_preflight/predictor/scoring/groups.py), from the chain keys' presence read once for all of them:
        the lookup's own read when it returned every key's group bitmaps (``Lookup.group_bits``), else here."""
        needed = keys_needed(matches, hybrid)
        if not needed:
            return matches
        if group_bits is not None and len(group_bits) >= needed:
            presence = group_bits[:needed]
        else:
            presence = await read_group_bits(self.index.backend, keys[:needed])
        nums = await self.index.numbering.pod_numbers(hybrid)
        return apply_groups(matches, hybrid, {p: i.engine_block_size for p, i in infos.items()}, presence, nums,
                            self.cfg.block_size, prompt_len)

    async def expand_pods(self, pods: list[str] | None) -> list[str] | None:
        """A pods filter with each pod's other names added: with ``ingest --pod-id endpoint`` a pod is
        indexed as "<ip>:<port>" and may be named by its topic name too, or the other way round."""
        if not pods:
            return pods
        now = time.monotonic()
        if now - self._aliases_at > ALIASES_TTL_S:  # read at most once a second, not per request
            async with valkey_call(self.valkey_deadline_s, "pod aliases"):
                self._aliases = await self.index.fleet.aliases()
            self._aliases_at = now
        aliases = self._aliases
        if aliases:
            pods = list(dict.fromkeys([*pods, *(a for p in pods for a in aliases.get(p, ()))]))
        # a pod with data-parallel ranks stands for every rank (predictor/scoring/ranks.py): the ranks the registry
        # lists (read at most once a second) or a lease does (before they publish)
        async with valkey_call(self.valkey_deadline_s, "pods"):
            names = set(await self.metadata.all_pods())
        return pods_with_ranks(pods, names | (self.fleet.listed() if self.fleet is not None else frozenset()))

    def dp_pods(self) -> frozenset[str]:
        """The pods known to have data-parallel ranks: a ``<pod>@dp<r>`` in the registry as last read, or in an
        ingester's lease (it lists the ranks it subscribes before they publish). No read of its own."""
        listed = self.fleet.listed() if self.fleet is not None else frozenset()
        return self.metadata.cached_dp_pods() | dp_pods_of(listed)

    async def _routed_infos(self, matches: list[Any], infos: dict[str, ScoringInfo],
                            speculative: dict[str, int]) -> dict[str, ScoringInfo]:
        """Scoring info for the pods what was routed added: a pod held speculatively alone (its meta), an
        approximate pod (no meta: its engine's block size as the gateway read it)."""
        assert self.routed is not None
        approximate = {m.pod_id: ScoringInfo(m.pod_id, self.routed.approximate_block_size.get(m.pod_id), False)
                       for m in matches if m.pod_id in self.routed.approximate and m.pod_id not in infos}
        missing = [p for p in speculative if p not in infos and p not in approximate]
        if missing:
            async with valkey_call(self.valkey_deadline_s, "pod metadata"):
                approximate |= await self.metadata.pod_infos(missing)
        return {**infos, **approximate} if approximate else infos

    async def _pods_not_known(self, pods: list[str]) -> tuple[list[str], list[str]]:
        """(unknown, retired) pods of a filter: unknown to the index, the fleet records and --pod-metrics."""
        retired = self.fleet.retired() if self.fleet else frozenset()
        known: set[str] = set(self.fleet.known()) if self.fleet else set()
        if self.load is not None:
            known |= {t.pod_id for t in self.load.targets if t.pod_id}
        wanted = set(pods)
        if wanted - known - retired:
            async with valkey_call(self.valkey_deadline_s, "known pods"):
                known |= await self.metadata.all_pods()
            if self._aliases:
                known |= set(self._aliases)
        return sorted(wanted - known - retired), sorted(wanted & retired)

    async def _check_pods_filter(self, pods: list[str]) -> None:
        """A route must name a pod that exists: one the index, the fleet records or --pod-metrics know,
        and not retired (else ``"pods": ["nope"]`` would answer ``pod_id: "nope"``)."""
        unknown, gone = await self._pods_not_known(pods)
        if gone or unknown:
            parts = []
            if unknown:
                parts.append("unknown pods (not in the index, the fleet records or --pod-metrics): " + _names(unknown))
            if gone:
                parts.append("retired pods: " + _names(gone))
            raise BadRequest(clip("the pods filter names " + "; ".join(parts)))

    async def _check_model(self, model: str, *, need_engine: bool) -> None:
        """Known = has an engine URL or a local tokenizer, or pods in the index serve it; prompts need a tokenizer.

        What the client cannot fix is a 503 (retryable): the fleet records not read yet, no pod of any model
        reported yet, no engine of a known model reachable to tokenize. An unknown model, while others are
        known, is the client's (a 400 that lists them)."""
        if self.tokenization.can_tokenize(model):
            return
        try:
            async with valkey_call(self.valkey_deadline_s, "model check"):
                known = model in await self.metadata.known_models(model)
        except IndexUnavailable:
            if not self.index.partial_reads:
                raise
            # The registry's shard may be the one that is down while the others answer: the model goes
            # unchecked, and the lookup says how far it could read ("partial"), never a 5xx.
            known = True
        if not known and self.fleet is not None:
            known = bool(self.fleet.serving(model))
        if (not known or need_engine) and self.fleet is not None and not self.fleet.ready:
            raise NotReady(f"not ready: this predictor has not read the fleet records yet, so it cannot tell "
                           f"whether {clip(repr(model))} is served, nor by which engine "
                           f"({self.fleet.failing or 'reading them'}); retry shortly (GET /ready says when)")
        if not known:
            models = await self._known_models()
            if not models:
                raise NotReady(
                    f"not ready: no ingester has reported a pod of any model yet, so {clip(repr(model))} cannot be "
                    "told from a typo; retry once the ingesters have read their engines (`kv-preflight index pods` "
                    "lists what they reported)")
            raise UnknownModel(unknown_model_message(model, models, gateway=self.routed is not None))
        if need_engine:
            raise EngineUnavailable(
                f"cannot tokenize for model {clip(repr(model))}: no engine of it answers /tokenize now (no live "
                "pod's fleet record gives one: its engines are down, unreachable, or not reported yet) and no "
                f"--engine-url or --tokenizer is configured for it; retry, give "
                f"{'gateway' if self.routed is not None else 'serve'} --tokenizer {clip(model)}=DIR, or send token_ids"
            )

    async def _known_models(self) -> list[str]:
        """Models the index or the fleet records know, plus those configured (--engine-url, --tokenizer)."""
        models = set(self.tokenizer.engine_urls) | set(self.tokenization.models)
        if self.fleet is not None:
            models |= self.fleet.models()
        try:
            async with valkey_call(self.valkey_deadline_s, "known models"):
                models |= await self.metadata.known_models()
        except IndexUnavailable:
            pass
        return sorted(models)

    async def ready(self) -> tuple[bool, str]:
        """Ready to answer: Valkey answers and the fleet records were read (a model is judged by them)."""
        ok, why = await self.healthy()
        if not ok:
            return False, why
        if self.fleet is not None and not self.fleet.ready:
            return False, "the fleet records have not been read yet" + (
                f" ({self.fleet.failing})" if self.fleet.failing else "")
        return True, ""

    async def healthy(self) -> tuple[bool, str]:
        try:
            async with valkey_call(self.valkey_deadline_s, "PING"):
                await self.index.ping()
        except IndexUnavailable as exc:
            return False, exc.message
        return True, ""

    async def stats(self, query: StatsQuery | None = None) -> dict[str, Any]:
        """Bounded whatever the number of pods: a summary and one page of pods, or one pod (predictor/stats.py)."""
        query = query or StatsQuery()
        summary = None
        async with valkey_call(self.valkey_deadline_s * 4, "stats"):
            key_count = await self.index.key_count()
            pod_models = await self.index.meta.pod_ids()
            index_counters = await self.index.meta.counters()
            if query.pod is not None:
                if query.pod not in pod_models:
                    raise NotFound(f"no pod {clip(repr(query.pod))} in the index")
                page = [query.pod]
            else:
                page = sorted(pod_models)[query.pods_offset:query.pods_offset + query.pods_limit]
                summary = await read_pods_summary(self.index, pod_models)
            pods = await self.index.meta.pod_infos(page)
            diagnosis = diagnosis_view(*await self.index.fleet.fleet_diagnosis())
        out = build_stats(
            key_count=key_count, pods=pods, index_counters=index_counters, process=self.counters, now=time.time(),
            summary=summary, query=query,
        )
        out["tokenization"] = self.tokenization.status()
        out["engine_load"] = self.load_stats()
        out["traffic"] = self.traffic.as_dict()
        out["fleet_diagnosis"] = diagnosis  # the last `kv-preflight diagnose fleet`, with its age
        if self.fleet is not None:
            out["fleet"] = self.fleet.status(self.policy.stale_s)
        return out

    def load_stats(self) -> dict[str, Any]:
        if self.load is None:
            return {}
        now = self.load.clock()
        out: dict[str, Any] = {}
        for t in self.load.targets:
            pod = t.pod_id or f"(undiscovered) {t.base_url}"
            ld = self.load.loads.get(t.pod_id) if t.pod_id else None
            out[pod] = {
                "metrics_url": t.metrics_url,
                "running": ld.running if ld else None, "waiting": ld.waiting if ld else None,
                "kv_usage": ld.kv_usage if ld else None, "age_s": round(now - ld.at, 3) if ld else None,
                "models": sorted(self.load.served.get(t.pod_id, ())) if t.pod_id else [],
                "error": self.load.failures.get(t.pod_id) if t.pod_id else "pod id not discovered yet",
            }
        return out

    async def aclose(self) -> None:
        await self.tokenizer.aclose()
        if self.owns_index:
            await self.index.close()


def _names(pods: list[str], limit: int = 10) -> str:
    return ", ".join(repr(p) for p in pods[:limit]) + (" ..." if len(pods) > limit else "")


def unknown_model_message(model: str, known: list[str], *, gateway: bool = False) -> str:
    """Names the cause (no ingester reported a pod of it), lists the known models and, when one is near
    (case-insensitively: "Tiny" for "tiny"), asks if that was meant. A gateway's (``gateway``) names its own
    --engine too: an engine given so makes the models it serves known."""
    import difflib

    lowered = {m.lower(): m for m in known}
    near = [lowered[model.lower()]] if model.lower() in lowered else [
        lowered[m] for m in difflib.get_close_matches(model.lower(), list(lowered), n=1, cutoff=0.6)]
    shown = ", ".join(repr(m) for m in known[:20]) + (f" ... ({len(known)} in all)" if len(known) > 20 else "")
    hint = f"; did you mean {near[0]!r}?" if near else ""
    configured = ("no --engine of this gateway serves it, nor does any --engine-url or --tokenizer name it" if gateway
                  else "no --engine-url or --tokenizer names it")
    return (f"unknown model {clip(repr(model))}: no ingester has reported a pod of this model yet, and "
            f"{configured} (known models: {clip(shown)}){hint}")


def prefix_placements(cfg: Config) -> PrefixPlacements | None:
    if cfg.route_placement_window_s <= 0:
        return None
    return PrefixPlacements(window_s=cfg.route_placement_window_s, pending_s=cfg.route_pending_s)


def routing_policy(cfg: Config) -> RoutingPolicy:
    return RoutingPolicy(
        tier_weights=dict(cfg.route_tier_weights), waiting_weight=cfg.route_waiting_weight,
        overload_abs=cfg.route_overload_abs, overload_rel=cfg.route_overload_rel,
        max_kv_usage=cfg.route_max_kv_usage, good_match=cfg.route_good_match, stale_s=cfg.route_stale_s,
    )
