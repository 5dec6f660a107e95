"""Why a prompt missed the prefix cache: the one classifier of token divergences, and the explain answer. Pure.

Two token lists that "should" be equal part at a first position; the shape of the difference says
why, and the same rules serve the start-up tokenizer check (local vs engine tokens of one input,
predictor/tokens/parity.py) and ``POST /v1/cache/explain`` (this prompt vs the earlier one the
user expected to hit). The usual causes, from the field guide the product grew out of:

* a BOS doubled (the text already starts with the BOS string and the tokenizer adds another) or
  missing (tokens made without special tokens);
* the front of a conversation cut by a rolling window: every turn then starts a new chain, so
  nothing after the cut is ever reused (llm-d, vLLM and SGLang all key blocks by their prefix);
* whitespace or Unicode normalization differences that render "the same" text as other tokens;
* a chat template that renders the same messages differently (a date injected, another template);
* the same tokens cached under another model's or LoRA adapter's root (keys never match across roots).

Then, per pod, what the engine's own rules take off a match (predictor/scoring/score.py has the formula):
whole engine blocks only, the last prompt token always recomputed, the partial last block never cached.
No I/O here; predictor/explain/handler.py gathers the tokens and the index's answer.
"""
from __future__ import annotations

import array
import sys
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import msgspec

from kv_preflight.predictor.scoring.score import Prediction

from kv_preflight.predictor.explain.findings import (CONTENT, DUPLICATE_BOS, EXTRA_TOKENS, MISSING_BOS,
                                OTHER_MODEL, ROLLING_CONTEXT, TEMPLATE_DRIFT, TOKENIZER_DRIFT, UNICODE, WHITESPACE,
                                Finding)

# A cut is only called a rolling window when at least this many tokens after it line up (fewer could be chance).
MIN_ROLLING_MATCH = 4
ROLLING_PROBE = 16  # tokens of ours searched for in theirs
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 8  # tokens decoded around a divergence


class Cause(NamedTuple):
    kind: str
    detail: str
    tokens_cut: int | None = None  # rolling_context: how many tokens of theirs are missing from ours


# ---------------------------------------------------------------- the classifier


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """The first index where the two differ (a length difference counts), or None when equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def leading(tokens: Sequence[int], token: int | None) -> int:
    """How many times ``token`` repeats at the start of ``tokens``."""
    if token is None:
        return 0
    n = 0
    for t in tokens:
        if t != token:
            break
        n += 1
    return n


def _packed(tokens: Sequence[int]) -> bytes:
    a = array.array("I", tokens)
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def rolling_cut(ours: Sequence[int], theirs: Sequence[int], position: int) -> tuple[int, int] | None:
    """(tokens cut, tokens that line up after the cut) when ours, from ``position`` on, is theirs with
    some tokens at ``position`` removed: the front of a window cut (position 0, or just after a kept
    BOS or system prompt). The smallest cut wins; None when nothing lines up for MIN_ROLLING_MATCH tokens."""
    probe_len = min(ROLLING_PROBE, len(ours) - position)
    if probe_len < MIN_ROLLING_MATCH:
        return None
    probe = _packed(ours[position:position + probe_len])
    hay = _packed(theirs[position + 1:])
    at = hay.find(probe)
    while at != -1 and at % 4:
        at = hay.find(probe, at + 1)
    if at == -1:
        return None
    cut = at // 4 + 1
    n = probe_len
    while position + n < len(ours) and position + cut + n < len(theirs) and \
            ours[position + n] == theirs[position + cut + n]:
        n += 1
    return cut, n


def _squash(text: str) -> str:
    return " ".join(text.split())


def classify(ours: Sequence[int], theirs: Sequence[int], position: int, *, bos_id: int | None,
             labels: tuple[str, str] = ("ours", "theirs"), same_input: bool = False, chat: bool = False,
             ours_text: str | None = None, theirs_text: str | None = None, rendered_vs_given: bool = False) -> Cause:
    """Why ``ours`` and ``theirs`` part at ``position``: a Cause whose ``kind`` is one of FINDING_KINDS.

    ``same_input``: both come from one input (the tokenizer check), so a difference is the tokenizer's
    or the template's, never the content's, and no window can have cut it. ``chat``: the input was chat
    messages (a template rendered it). ``ours_text``/``theirs_text``: the input text (or the tokens
    decoded), for the whitespace and Unicode rules.
    """
    a, b = labels
    if not same_input:
        cut = rolling_cut(ours, theirs, position)
        if cut is not None and not (position == 0 and cut[0] <= leading(theirs, bos_id)):
            kept = "the BOS and " if position and position == leading(theirs, bos_id) else ""
            return Cause(ROLLING_CONTEXT,
                         f"{a} is {b} with {cut[0]} token(s) cut at token {position} ({kept}"
                         f"{position} token(s) kept before the cut, {cut[1]} line up after it): a rolling "
                         "window dropped the front of the context, so every block after the cut is new",
                         cut[0])
    lead_a, lead_b = leading(ours, bos_id), leading(theirs, bos_id)
    if lead_a != lead_b and position <= max(lead_a, lead_b):
        counts = f"{a} starts with {lead_a} BOS, {b} with {lead_b}"
        if max(lead_a, lead_b) >= 2:
            return Cause(DUPLICATE_BOS, f"duplicate BOS: {counts}")
        return Cause(MISSING_BOS, f"BOS added on one side only: {counts}")
    shorter = min(len(ours), len(theirs))
    if same_input and ours_text is not None and ours_text != ours_text.rstrip() and position >= shorter - 3:
        return Cause(WHITESPACE, "trailing whitespace tokenized differently")
    if position >= shorter:
        longer = a if len(ours) > len(theirs) else b
        return Cause(EXTRA_TOKENS, f"{longer} has {abs(len(ours) - len(theirs))} extra token(s) at the end "
                                   "(EOS or generation prompt?)")
    if rendered_vs_given:
        return Cause(TEMPLATE_DRIFT, "chat template drift: the engine renders these messages with its own template, "
                                     "and the other side was rendered differently (another template, or another "
                                     "version of it); send messages, or render with the engine's template")
    if not same_input and ours_text is not None and theirs_text is not None and ours_text != theirs_text:
        if _squash(ours_text) == _squash(theirs_text):
            return Cause(WHITESPACE, f"the texts differ only in whitespace; the first difference is at token "
                                     f"{position}, where {a} and {b} tokenize the spacing differently")
        if unicodedata.normalize("NFKC", ours_text) == unicodedata.normalize("NFKC", theirs_text):
            return Cause(UNICODE, "the texts differ only in Unicode normalization (NFC/NFKC forms, compatibility "
                                  "characters such as a no-break space): normalize before sending")
    if chat and (same_input or rendered_vs_given or ours_text is None or ours_text == theirs_text):
        return Cause(TEMPLATE_DRIFT, "chat template drift (the rendered text differs, or a different template "
                                     "is in use)")
    if same_input:
        return Cause(TOKENIZER_DRIFT, "tokenizer drift (vocabulary, normalizer or pre-tokenizer differ)")
    return Cause(CONTENT, f"the prompts differ from token {position} on: different text, not a tokenization quirk")


# ---------------------------------------------------------------- findings from one prompt


def bos_findings(tokens: Sequence[int], bos_id: int | None, adds_bos: bool) -> list[Finding]:
    """BOS problems visible in the tokens alone (cheap: looks at the first two)."""
    if bos_id is None or not tokens:
        return []
    if len(tokens) > 1 and tokens[0] == bos_id and tokens[1] == bos_id:
        return [Finding(DUPLICATE_BOS, 1, "the prompt starts with BOS twice: the text began with the BOS string "
                                          "and the tokenizer added another; the engine caches it under other keys "
                                          "than the single-BOS prompt")]
    if adds_bos and tokens[0] != bos_id:
        return [Finding(MISSING_BOS, 0, "the model's tokenizer starts every prompt with BOS but these tokens do "
                                        "not (tokenized without special tokens?): they match no prompt the engine "
                                        "tokenized itself")]
    return []


def text_findings(text: str, n_tokens: int) -> list[Finding]:
    """Whitespace and Unicode that make an "identical" prompt tokenize differently next time."""
    out = []
    stripped = text.rstrip()
    if stripped != text:
        out.append(Finding(WHITESPACE, max(0, n_tokens - 1),
                           f"the text ends in {len(text) - len(stripped)} whitespace character(s); tokenizers merge "
                           "trailing whitespace with what follows, so the next turn's tokens at this point differ"))
    elif "\r\n" in text:
        out.append(Finding(WHITESPACE, None, "the text holds CRLF line ends; a client that sends LF elsewhere makes "
                                             "the same prompt other tokens"))
    if unicodedata.normalize("NFC", text) != text or "\u00a0" in text:
        out.append(Finding(UNICODE, None, "the text is not in Unicode NFC form (or holds no-break spaces): the "
                                          "same visible text in another form is other tokens"))
    return out


# ---------------------------------------------------------------- per pod: where the chain stops and what is lost


class LostTokens(msgspec.Struct, frozen=True):
    engine_block_rounding: int  # matched tokens short of a whole engine block (engine blocks > request-key blocks)
    last_token_recomputed: int  # the engine always recomputes the last prompt token: its whole block is not reused
    partial_last_block: int  # the prompt's tail shorter than a block: never keyed, never cached


class PodChain(msgspec.Struct, frozen=True, omit_defaults=True):
    pod_id: str
    model: str  # the root the chain was found under
    stop_block: int  # first request-key block this pod does not hold (= blocks matched)
    stop_token: int  # first token of that block
    matched_tokens: int  # stop_block * block size
    reused_tokens: int  # what the engine would actually reuse
    lost_tokens: LostTokens
    engine_block_size: int
    device_tier: str | None = None
    dp_rank: int | None = None  # the pod's data-parallel rank (a pod with ranks: predictor/scoring/ranks.py)
    speculative_blocks: int = 0  # of stop_block, blocks a gateway's speculative entries alone hold (docs/gateway.md)


def pod_chain(pod_id: str, model: str, blocks: int, *, canonical_block: int, engine_block: int | None,
              prompt_len: int, tier: str | None = None) -> PodChain:
    """The chain's stop and the tokens the engine's rules drop from the match, rule by rule (score.py's formula)."""
    e = engine_block if engine_block and engine_block > 0 else canonical_block
    matched = blocks * canonical_block
    whole = matched // e * e
    by_last = max(0, (prompt_len - 1) // e * e)
    reused = max(0, min(whole, by_last)) if prompt_len > 1 else 0
    full_blocks = prompt_len // canonical_block
    tail = prompt_len - full_blocks * canonical_block if blocks >= full_blocks else 0
    return PodChain(pod_id=pod_id, model=model, stop_block=blocks, stop_token=matched, matched_tokens=matched,
                    reused_tokens=reused,
                    lost_tokens=LostTokens(engine_block_rounding=matched - whole,
                                           last_token_recomputed=max(0, whole - reused), partial_last_block=tail),
                    engine_block_size=e, device_tier=tier)


# ---------------------------------------------------------------- the answer


class DivergenceSide(msgspec.Struct, frozen=True):
    token_id: int | None  # None: this side ended there
    token: str  # the token decoded ("" at the end)
    before: str  # the text of the tokens just before
    after: str  # and just after


class Divergence(msgspec.Struct, frozen=True):
    token_index: int
    block_index: int
    cause: str  # a finding kind
    detail: str
    ours: DivergenceSide
    theirs: DivergenceSide
    ours_tokens: int
    theirs_tokens: int
    tokens_cut: int | None = None  # rolling_context: tokens of the comparison missing from this prompt


class Explanation(Prediction, omit_defaults=False):
    """The prediction plus why: per-pod chains, findings (always a list), and the divergence from ``compare``."""

    model: str = ""
    pods: list[PodChain] = msgspec.field(default_factory=list)
    pods_truncated: bool = False
    findings: list[Finding] = msgspec.field(default_factory=list)
    divergence: Divergence | None = None
    decoded_by: str | None = None  # local | engine | None (token ids only)


def context_slices(tokens: Sequence[int], position: int) -> tuple[list[int], list[int], list[int]]:
    """The token at ``position`` (empty past the end), the tokens just before it and just after it."""
    return (list(tokens[position:position + 1]), list(tokens[max(0, position - CONTEXT_BEFORE):position]),
            list(tokens[position + 1:position + 1 + CONTEXT_AFTER]))


def ids_text(tokens: Sequence[int]) -> str:
    """Token ids as text, when no tokenizer can decode them."""
    return " ".join(str(t) for t in tokens)


def divergence_side(tokens: Sequence[int], position: int, decode: Callable[[Sequence[int]], str]) -> DivergenceSide:
    token, before, after = context_slices(tokens, position)
    return DivergenceSide(token_id=token[0] if token else None, token=decode(token) if token else "",
                          before=decode(before), after=decode(after))


def continues(ours: Sequence[int], theirs: Sequence[int]) -> bool:
    """True when one is a prefix of the other: the earlier prompt's blocks are all reusable, no divergence."""
    n = min(len(ours), len(theirs))
    return list(ours[:n]) == list(theirs[:n])


def best_by_model(chains: Sequence[PodChain], model: str) -> PodChain | None:
    mine = [c for c in chains if c.model == model]
    return max(mine, key=lambda c: (c.stop_block, c.pod_id), default=None)


def other_model_findings(chains: Sequence[PodChain], model: str,
                         relations: Mapping[str, str] | None = None) -> list[Finding]:
    """A longer chain under another root than under ours: the blocks exist but under a different name.
    ``relations``: how a root stands to ours, in words ("the base model 'tiny' (this request names its LoRA
    adapter 'a')", "another LoRA adapter, 'b', of the same base model 'tiny'"); else "model '<root>'"."""
    ours = best_by_model(chains, model)
    mine = ours.stop_block if ours else 0
    out = []
    seen = set()
    for c in sorted(chains, key=lambda c: (-c.stop_block, c.pod_id)):
        if c.model == model or c.model in seen or c.stop_block <= mine:
            continue
        seen.add(c.model)
        under = (relations or {}).get(c.model) or f"model {c.model!r}"
        out.append(Finding(OTHER_MODEL, ours.stop_token if ours else 0,
                           f"{c.stop_token} tokens of this prompt are cached on {c.pod_id} under {under}, "
                           f"{c.stop_token - (ours.stop_token if ours else 0)} more than under "
                           f"{model!r}: keys start from the model (or LoRA adapter) name, so they never match "
                           "across names; send the model name that pod serves"))
    return out