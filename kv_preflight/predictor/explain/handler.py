"""``POST /v1/cache/explain``: the I/O around predictor/explain/rules.py's pure rules.

The body is /predict's plus an optional ``compare`` (a second prompt in any input form, the earlier
request the user expected to hit), validated by the same parser with the same limits. Gathered here:
the tokens of both (given, local tokenizer, or the engine), one lookup under the request's model and
one under each other model the fleet knows (bounded by MAX_OTHER_MODELS: the "same tokens under
another root" finding), the pods' engine block sizes, and decoded text around a divergence (the local
tokenizer, else the engine's ``/detokenize``). Not a hot path: it may ask the engine a few times.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from kv_preflight.predictor.explain import rules
from kv_preflight.predictor.errors import BadRequest, EngineRejected, EngineUnavailable, clip
from kv_preflight.predictor.explain.rules import Explanation, Finding, PodChain
from kv_preflight.predictor.explain.warnings import hints_from_probe
from kv_preflight.predictor.request import PredictRequest, check_mm_items, check_token_count, parse_request
from kv_preflight.predictor.scoring.ranks import rank_of, with_ranks
from kv_preflight.predictor.scoring.groups import (GroupBits, apply_groups, group_findings, keys_needed, pods_groups,
                                                   window_cut)
from kv_preflight.predictor.scoring.score import engine_cached_tokens, score
from kv_preflight.predictor.prediction import Predictor
from kv_preflight.predictor.valkey_call import valkey_call
from kv_preflight.predictor.scoring.routed import mark_speculative, with_routed
from kv_preflight.index.rank_pods import pods_with_ranks
from kv_preflight.index.routed import keys_blob

MAX_OTHER_MODELS = 8  # other roots looked up for the other_model finding (one round trip each)
MAX_POD_CHAINS = 64  # pods listed in ``pods``; the rest are counted in pods_truncated
MAX_DECODE_TOKENS = 65_536  # whole prompts decoded for the whitespace and Unicode rules up to this length


def parse_explain(body: bytes, *, max_tokens: int, max_pods: int) -> tuple[PredictRequest, PredictRequest | None]:
    """The predict body (parsed by predict's own parser, so the same errors and limits) and the ``compare`` input."""
    try:
        obj = msgspec.json.decode(body)
    except RecursionError:
        raise BadRequest("invalid JSON: nested too deeply (1000 levels or more)") from None
    except msgspec.DecodeError:
        obj = None  # parse_request words the error
    if not (isinstance(obj, dict) and "compare" in obj):
        return parse_request(body, max_tokens=max_tokens, max_pods=max_pods), None
    compare = obj.pop("compare")
    req = parse_request(msgspec.json.encode(obj), max_tokens=max_tokens, max_pods=max_pods)
    if compare is None:
        return req, None
    if not isinstance(compare, dict):
        raise BadRequest("compare must be an object holding one of token_ids, prompt, messages")
    extra = [k for k in compare if k not in ("token_ids", "prompt", "messages")]
    if extra:
        raise BadRequest(f"compare: unknown field {clip(extra[0])!r}: compare takes one of token_ids, prompt, "
                         "messages (its model and pods are the request's)")
    try:
        other = parse_request(msgspec.json.encode({"model": req.model, **compare}), max_tokens=max_tokens,
                              max_pods=max_pods)
    except BadRequest as exc:
        raise BadRequest(f"compare: {exc.message}") from None
    return req, other


async def explain(p: Predictor, req: PredictRequest, other: PredictRequest | None) -> Explanation:
    model = req.model
    assert model
    tokens, source = await _tokens(p, req)
    if req.mm_items:
        req.mm_items = check_mm_items(req.mm_items, len(tokens))
    prompt = p.prompt_keys(model, tokens, req.cache_salt, req.mm_items)
    cfg = p.cfg
    # a pod named stands for its other names and its data-parallel ranks (Predictor.expand_pods)
    req = msgspec.structs.replace(req, pods=await p.expand_pods(req.pods))
    async with valkey_call(p.valkey_deadline_s * 4, "explain lookups"):
        sets = await p.lookup_prompt(prompt, req.pods) if req.pods != [] else []
        known = await p.metadata.known_models()
        roots = _other_roots(p, model, _other_models(p, known) - {model})[:MAX_OTHER_MODELS]
        elsewhere = []
        for root in roots:
            for _, got in await p.lookup_prompt(p.prompt_keys(root, tokens, req.cache_salt, req.mm_items), req.pods):
                elsewhere.extend((root, m) for m in got.matches)
        serving = sorted(await p.metadata.pods_of(model))
        matches = [m for _, f in sets for m in f.matches]
        infos = await p.metadata.pod_infos({m.pod_id for m in matches} | {m.pod_id for _, m in elsewhere}
                                           | set(serving[:MAX_POD_CHAINS]))
        declared = cfg.group_specs.get(model)
        hybrid = pods_groups({pod: i.groups for pod, i in infos.items()}, declared)
        group_notes = group_findings(model, (m.pod_id for m in matches), hybrid, declared, p.complete_groups)
        if hybrid:  # a hybrid pod reuses what every KV cache group's rule accepts
            matches = []
            for keys, f in sets:
                if not keys_needed(f.matches, hybrid):
                    matches += f.matches
                    continue
                presence, nums = await p.index.group_presence(keys[:keys_needed(f.matches, hybrid)], hybrid)
                adjusted = apply_groups(f.matches, hybrid, {pod: i.engine_block_size for pod, i in infos.items()},
                                        presence, nums, cfg.block_size, len(tokens))
                group_notes += _group_cuts(f.matches, adjusted, hybrid, infos, GroupBits(presence), nums,
                                           cfg.block_size, len(tokens))
                matches += adjusted
    partial = [f for _, f in sets if f.partial]
    if req.pods is not None:  # the ranks found of a pod named (before a registry read lists them)
        req = msgspec.structs.replace(req, pods=pods_with_ranks(req.pods, [m.pod_id for m in matches]))
    matches, speculative = await _with_routed(p, model, prompt.keys, matches, serving, req.pods, hybrid)
    engine_blocks = {pod: i.engine_block_size for pod, i in infos.items()}
    prediction = score(matches, prompt_len=len(tokens), canonical_block=cfg.block_size, engine_blocks=engine_blocks,
                       incomplete={pod for pod, i in infos.items() if i.incomplete}, pods=req.pods,
                       ttft=p.ttft.for_model(model))
    prediction = mark_speculative(prediction, speculative)
    if partial:
        prediction = msgspec.structs.replace(prediction, partial=True,
                                             partial_from_block=min(f.unanswered_from for f in partial))

    def chain(root: str, pod: str, blocks: int, tier: str | None) -> PodChain:
        return rules.pod_chain(pod, root, blocks, canonical_block=cfg.block_size, engine_block=engine_blocks.get(pod),
                               prompt_len=len(tokens), tier=tier)

    chains = [msgspec.structs.replace(chain(model, m.pod_id, m.blocks, m.tier),
                                      speculative_blocks=speculative.get(m.pod_id, 0)) for m in matches]
    held = {m.pod_id for m in matches}
    # every pod that could have held it and does not: each pod the filter names (whether or not the index has seen
    # it serve the model yet), else the index's pods of the model
    chains += [chain(model, pod, 0, None) for pod in (sorted(set(req.pods)) if req.pods is not None else serving)
               if pod not in held]
    chains.sort(key=lambda c: (-c.stop_block, c.pod_id))
    other_chains = [chain(root, m.pod_id, m.blocks, m.tier) for root, m in elsewhere]

    await _learn_bos(p, model)
    warnings = p.warnings.check(model, tokens[:2], chat=req.prompt is None) + [
        f for f in group_notes if f.kind != "group_cut"]
    findings: list[Finding] = list(warnings) + [f for f in group_notes if f.kind == "group_cut"]
    text = _input_text(req)
    if text is not None:
        findings += rules.text_findings(text, len(tokens))
    findings += rules.other_model_findings(chains + other_chains, model, _relations(p, model, roots))

    decoded_by = None
    divergence = None
    if other is not None:
        theirs, _ = await _tokens(p, other)
        if not rules.continues(tokens, theirs):
            divergence, decoded_by = await _divergence(p, model, req, other, tokens, theirs)
            if not any(f.kind == divergence.cause for f in findings):
                findings.append(Finding(divergence.cause, divergence.token_index, divergence.detail))
    prediction = msgspec.structs.replace(prediction, freshness=p.freshness_of(
        prediction, req.pods, extra=[c.pod_id for c in chains[:MAX_POD_CHAINS]]))
    dp = p.dp_pods()  # each data-parallel rank named as its pod and rank (predictor/scoring/ranks.py)
    prediction = with_ranks(prediction, dp)
    shown = [c if (r := rank_of(c.pod_id, dp))[1] is None else msgspec.structs.replace(c, pod_id=r[0], dp_rank=r[1])
             for c in chains[:MAX_POD_CHAINS]]
    return Explanation(**msgspec.structs.asdict(prediction) | {"warnings": warnings},
                       model=model, pods=shown, pods_truncated=len(chains) > MAX_POD_CHAINS,
                       findings=findings, divergence=divergence, decoded_by=decoded_by)


# ---------------------------------------------------------------- helpers


async def _with_routed(p: Predictor, model: str, keys: list[int], matches: list[Any], serving: list[str],
                       pods: list[str] | None, hybrid: dict[str, Any]) -> tuple[list[Any], dict[str, int]]:
    """On a gateway, the matches with what was routed merged in (predictor/scoring/routed.py), and per pod the
    blocks that stood on speculative entries alone: a chain's stop may be a gateway's guess, and says so."""
    if p.routed is None or p.routed.store is None or not keys or pods == []:
        return matches, {}
    wanted = {m.pod_id for m in matches} | set(serving[:MAX_POD_CHAINS]) | p.foreseen(model, pods)
    got = await p.routed.read(wanted if pods is None else wanted & set(pods), keys_blob(keys))
    if not got:
        return matches, {}
    return with_routed(matches, got, approximate=p.routed.approximate, skip=hybrid)



def _group_cuts(before: Sequence[Any], after: Sequence[Any], hybrid: dict[str, Any], infos: dict[str, Any],
                bits: GroupBits, nums: dict[str, int], canonical: int, prompt_len: int) -> list[Finding]:
    """A ``group_cut`` finding per hybrid pod whose KV cache groups' rules reuse less than its full-attention
    prefix: the group that cut it and, for a sliding-window group, the blocks it evicted (vLLM frees a
    sliding-window group's blocks outside the window, so a prefix whose full-attention blocks are all cached
    can still be recomputed from the last run of ceil((window - 1) / block) cached window blocks)."""
    out = []
    for m, a in zip(before, after):
        if m.pod_id not in nums:
            continue
        groups = hybrid[m.pod_id]
        ebs = infos[m.pod_id].engine_block_size or canonical
        prefix_tokens = engine_cached_tokens(m.blocks, canonical, ebs, prompt_len)  # a plain model's count
        hit = a.blocks * canonical
        if hit >= prefix_tokens:
            continue
        cut = window_cut(groups, m.blocks, bits, nums[m.pod_id], canonical, ebs, prompt_len)
        if cut is not None:
            g, window, missing = cut
            size = groups[g].block_size or ebs
            shown = ", ".join(f"#{i}" for i in missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12
                                                                 else "")
            detail = (f"pod {m.pod_id!r} holds enough of this prompt in its full-attention group to reuse "
                      f"{prefix_tokens} tokens, but "
                      f"KV cache group {g} (sliding window of {window} tokens, blocks of {size}) has evicted block(s) "
                      f"{shown} of that prefix: vLLM reuses {hit} tokens (the hit must end after enough contiguous "
                      f"window blocks)")
        else:
            kinds = ", ".join(f"{g}: {s.kind}" for g, s in sorted(groups.items()))
            detail = (f"pod {m.pod_id!r} holds enough of this prompt in its full-attention group to reuse "
                      f"{prefix_tokens} tokens, but "
                      f"its other KV cache groups' rules ({kinds}) accept only {hit}")
        out.append(Finding("group_cut", hit, detail))
    return out



async def _tokens(p: Predictor, req: PredictRequest) -> tuple[list[int], str]:
    model = req.model
    assert model
    if req.token_ids is not None:
        await p._check_model(model, need_engine=False)
        return list(req.token_ids), "given"
    await p._check_model(model, need_engine=True)
    tokens, source = await p.tokenization.tokenize(model, prompt=req.prompt, messages=req.messages)
    if not tokens:
        raise BadRequest(f"the {source} tokenizer turned the input into no tokens")
    check_token_count(len(tokens), p.cfg.max_tokens)
    return tokens, source


def _other_models(p: Predictor, known: frozenset[str]) -> set[str]:
    """Every model name the predictor has heard of: the index's, the configured engines' and tokenizers', and
    what the scraped engines list in /v1/models (LoRA adapters included)."""
    out = set(known) | set(p.tokenizer.engine_urls) | set(p.tokenization.models)
    if p.load is not None:
        for served in p.load.served.values():
            out |= set(served)
    return out


def _base_of(p: Predictor, model: str) -> str | None:
    """The base model of a LoRA adapter: from the index (the pods whose events stored its blocks), else from
    the fleet records (an engine's /v1/models lists its base first, then its adapters)."""
    base = p.metadata.base_of(model)
    if base is None and p.fleet is not None:
        return p.fleet.base_of(model)
    return base


def _other_roots(p: Predictor, model: str, others: set[str]) -> list[str]:
    """The other roots to look the prompt up under, the related ones first: the base model of this adapter and
    its other adapters, or this base model's adapters; then the rest by name."""
    base = _base_of(p, model)
    family = {base} | p.metadata.adapters_of(base) if base else set(p.metadata.adapters_of(model))
    return sorted(others, key=lambda r: (r not in family, r != base, r))


def _relations(p: Predictor, model: str, roots: Sequence[str]) -> dict[str, str]:
    """How each other root stands to the request's model, in words, for the other_model finding."""
    base = _base_of(p, model)
    out = {}
    for root in roots:
        if base is not None and root == base:
            out[root] = f"the base model {root!r} (this request names its LoRA adapter {model!r})"
        elif base is not None and _base_of(p, root) == base:
            out[root] = f"another LoRA adapter, {root!r}, of the same base model {base!r}"
        elif _base_of(p, root) == model:
            out[root] = f"LoRA adapter {root!r} of this base model"
    return out


def _input_text(req: PredictRequest) -> str | None:
    if req.prompt is not None:
        return req.prompt
    if req.messages:
        last = req.messages[-1].get("content")
        return last if isinstance(last, str) else None
    return None


def _comparable_text(req: PredictRequest) -> str | None:
    """The input as text, when both sides of a comparison can be compared as text without decoding."""
    if req.prompt is not None:
        return req.prompt
    if req.messages is not None:
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in req.messages)
    return None


async def _learn_bos(p: Predictor, model: str) -> None:
    """For a model with no local tokenizer, ask its engine once what its BOS is (two one-character prompts)."""
    if model in p.warnings.hints or not p.tokenizer.has_engine(model):
        return
    try:
        a = await p.tokenizer.tokenize(model, prompt="a")
        b = await p.tokenizer.tokenize(model, prompt="b")
    except (EngineRejected, EngineUnavailable):
        return
    p.warnings.hints[model] = hints_from_probe(a, b)


async def _divergence(p: Predictor, model: str, req: PredictRequest, other: PredictRequest, ours: list[int],
                      theirs: list[int]) -> tuple[rules.Divergence, str | None]:
    position = rules.first_divergence(ours, theirs)
    assert position is not None
    hints = p.warnings.hints.get(model)
    slices = [*rules.context_slices(ours, position), *rules.context_slices(theirs, position)]
    same_form = (req.prompt is None) == (other.prompt is None) and (req.messages is None) == (other.messages is None)
    texts = (_comparable_text(req), _comparable_text(other)) if same_form else (None, None)
    if texts[0] is None and len(ours) <= MAX_DECODE_TOKENS and len(theirs) <= MAX_DECODE_TOKENS:
        slices += [ours, theirs]
    decoded, decoded_by = await _decode(p, model, slices)

    def decode(ts: Sequence[int]) -> str:
        return decoded.get(tuple(ts), rules.ids_text(ts))

    if texts[0] is None and decoded_by is not None:
        texts = (decode(ours), decode(theirs))
    chat = req.messages is not None or other.messages is not None
    cause = rules.classify(ours, theirs, position, bos_id=hints.bos_id if hints else None,
                           labels=("this prompt", "the comparison"),
                           same_input=same_form and req.token_ids is None
                           and (req.prompt, req.messages) == (other.prompt, other.messages),
                           chat=chat, ours_text=texts[0], theirs_text=texts[1],
                           rendered_vs_given=chat and not same_form)
    return rules.Divergence(
        token_index=position, block_index=position // p.cfg.block_size, cause=cause.kind, detail=cause.detail,
        ours=rules.divergence_side(ours, position, decode), theirs=rules.divergence_side(theirs, position, decode),
        ours_tokens=len(ours), theirs_tokens=len(theirs), tokens_cut=cause.tokens_cut), decoded_by


async def _decode(p: Predictor, model: str, slices: list[list[int]]) -> tuple[dict[tuple[int, ...], str], str | None]:
    """Each slice decoded by the local tokenizer, else the engine's /detokenize; ({}, None) when neither can."""
    m = p.tokenization.models.get(model)
    if m is not None and m.local is not None:
        tok = m.local.tokenizer
        return {tuple(s): tok.decode(s, skip_special_tokens=False) for s in slices}, "local"
    urls = p.tokenizer.urls_for(model)  # --engine-url engines of the model, else the fleet's
    if not urls:
        return {}, None
    base = urls[0]
    out: dict[tuple[int, ...], str] = {}
    try:
        async with asyncio.timeout(p.tokenizer.timeout_s * 2):
            for s in slices:
                if not s or tuple(s) in out:
                    continue
                resp = await p.tokenizer.client.post(f"{base}/detokenize", json={"model": model, "tokens": s})
                if resp.status_code != 200:
                    return {}, None
                out[tuple(s)] = str(_json(resp).get("prompt", ""))
    except (TimeoutError, httpx.HTTPError, ValueError):
        return {}, None
    out[()] = ""
    return out, "engine"


def _json(resp: httpx.Response) -> dict[str, Any]:
    data = msgspec.json.decode(resp.content)
    if not isinstance(data, dict):
        raise ValueError("not an object")
    return data

