"""Decode and validate a ``POST /v1/cache/predict`` body in one typed pass.

msgspec checks types and token-id bounds in C while decoding, so a 4K-token
request costs microseconds; what it cannot express (exactly one input, no empty
input, the token and pods limits, how deep ``messages`` nests) is checked right after.
Every failure is a BadRequest whose message names the field at fault and echoes at
most ``ECHO_LIMIT`` characters of what was sent.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from kv_preflight.predictor.errors import BadRequest, clip
from kv_preflight.config import Config
from kv_preflight.keys.chain import MAX_TOKEN_ID, request_keys_json
from kv_preflight.keys.multimodal import MultimodalItem, checked_items

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]

INPUTS = ("token_ids", "prompt", "messages")
# msgspec refuses JSON nested 1000 levels deep with a RecursionError; chat messages need a handful
# (message -> content parts -> part), so anything deeper than this inside ``messages`` is refused
# before a tokenizer or chat template has to walk it.
MAX_MESSAGES_DEPTH = 32
DEFAULT_MAX_PODS = Config.max_pods_filter


# Unknown fields are refused (400), not ignored: a "pod" meant as "pods" would otherwise drop the
# filter silently (docs/api: the body's fields are exactly these).
class PredictRequest(msgspec.Struct, forbid_unknown_fields=True):
    model: str | None = None
    token_ids: list[TokenId] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    pods: list[str] | None = None  # candidate pods; None = every pod
    cache_salt: str | None = None  # vLLM's per-request salt: keys block 0 as the engine does (kv_preflight/keys/chain.py)
    # the prompt's multimodal items as the engine sees them (identifier, placeholder offset and length in the token
    # ids, placeholders expanded): the blocks they overlap are keyed as vLLM keys them (kv_preflight/keys/multimodal.py)
    mm_items: list[MultimodalItem] | None = None
    # /route: route by load alone when the index of a pod the answer relies on may be older than this
    # (docs/routing.md "Freshness"); /predict and /explain take it and answer as always (freshness says)
    max_staleness_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None


_decoder = msgspec.json.Decoder(PredictRequest)

_FIELD_HINTS = {
    "token_ids": f"token_ids must be a list of integers in [0, {MAX_TOKEN_ID}]",
    "pods": "pods must be a list of pod id strings",
    "model": "model must be a string",
    "prompt": "prompt must be a string",
    "messages": "messages must be a list of chat message objects",
    "cache_salt": "cache_salt must be a string",
    "mm_items": "mm_items must be a list of {identifier: string, offset: integer >= 0, length: integer >= 1}",
    "max_staleness_ms": "max_staleness_ms must be a whole number of milliseconds, 0 or more",
}
_FIELD_AT = re.compile(r"at `\$\.(\w+)")


def parse_request(body: bytes, *, max_tokens: int, max_pods: int = DEFAULT_MAX_PODS) -> PredictRequest:
    if not body.strip():
        raise BadRequest("empty body: expected a JSON object with model and one of token_ids, prompt, messages")
    try:
        req = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        if _UNKNOWN.search(str(exc)):
            _refuse_if_too_deep(body)  # an unknown field stops the decoder before it sees how deep it is
        raise BadRequest(_explain(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid JSON: {clip(str(exc))}") from None
    except RecursionError:
        raise _too_deep() from None
    if not req.model:
        raise BadRequest("missing model: give the model name as the engine serves it (the adapter name for LoRA)")
    given = [name for name in INPUTS if getattr(req, name) is not None]
    if not given:
        raise BadRequest("give one of token_ids, prompt, messages")
    if len(given) > 1:
        raise BadRequest(f"give only one of token_ids, prompt, messages (got {', '.join(given)})")
    if req.token_ids is not None:
        if not req.token_ids:
            raise BadRequest("token_ids is empty")
        check_token_count(len(req.token_ids), max_tokens)
    elif req.prompt is not None and not req.prompt:
        raise BadRequest("prompt is empty")
    elif req.messages is not None:
        if not req.messages:
            raise BadRequest("messages is empty")
        check_depth(req.messages, MAX_MESSAGES_DEPTH, "messages")
    check_pods(req.pods, max_pods)
    if req.mm_items is not None:
        if not req.mm_items:
            req.mm_items = None
        elif req.token_ids is not None:
            req.mm_items = check_mm_items(req.mm_items, len(req.token_ids))
    return req


def check_mm_items(items: list[MultimodalItem], n_tokens: int) -> list[MultimodalItem]:
    """The items in placeholder order, or a 400 naming the one that overlaps another or runs past the prompt
    (a prompt or messages input is checked once tokenized)."""
    try:
        return checked_items(items, n_tokens)
    except ValueError as exc:
        raise BadRequest(clip(str(exc))) from None


class _KeyedShape(msgspec.Struct, forbid_unknown_fields=True):
    """The common request, token_ids kept as raw JSON text for the C routine."""

    model: str | None = None
    token_ids: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    pods: list[str] | None = None
    cache_salt: msgspec.Raw = msgspec.Raw()
    mm_items: msgspec.Raw = msgspec.Raw()
    max_staleness_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None


_keyed_decoder = msgspec.json.Decoder(_KeyedShape)

try:  # a member's place in a body found by C (kv_preflight/_speedups.c member_span); without it, decoded whole
    from kv_preflight._speedups import member_span as _member_span
except ImportError:  # pragma: no cover - no compiler at install time
    _member_span = None


def without_list(body: bytes, name: bytes) -> tuple[bytes, msgspec.Raw] | None:
    """``body`` with its top-level member ``name``, a JSON array, as ``[]``, and that array's text (a view of the
    body, not a copy). A token list is keyed from its text in C (``request_keys_json``, which checks it whole):
    the JSON decoder need not scan its digits first (for 4K tokens, 20 KB: as long as the keying). The body is
    valid exactly when the smaller one is and the list is what the keying accepts. None when the C routine is
    absent, or ``name`` is not there exactly once as an array (then decode it all)."""
    span = _member_span(body, name) if _member_span is not None else None
    if span is None or body[span[0]:span[0] + 1] != b"[":
        return None
    start, end = span
    return body[:start] + b"[]" + body[end:], msgspec.Raw(memoryview(body)[start:end])


class KeyedRequest(msgspec.Struct):
    """A token_ids request already turned into request keys (the fast path)."""

    model: str
    keys: list[int]
    n_tokens: int
    pods: list[str] | None
    raw_token_ids: msgspec.Raw = msgspec.Raw()  # the JSON list, unparsed: a reference, not a copy
    max_staleness_ms: int | None = None

    @property
    def head(self) -> tuple[int, ...]:
        """The first two token ids, for the BOS warnings (predictor/explain/warnings.py); parsed only when asked."""
        return leading_token_ids(self.raw_token_ids)


def parse_keyed(body: bytes, *, max_tokens: int, hash_seed: str, block_size: int,
                max_pods: int = DEFAULT_MAX_PODS) -> KeyedRequest | None:
    """The fast path for a well-formed token_ids request: keys straight from the JSON text.

    Anything else (other inputs, any error, an empty or over-long prompt) is None, and the
    caller goes through ``parse_request``, which decides, and words every error.
    Only a refusal that would cost as much again to reach there is raised here: JSON nested too
    deep, and a pods filter over the limit (no key is hashed for either).
    """
    cut = without_list(body, b"token_ids")
    try:
        shape = _keyed_decoder.decode(body if cut is None else cut[0])
    except msgspec.MsgspecError:
        return None
    except RecursionError:
        raise _too_deep() from None
    check_pods(shape.pods, max_pods)
    token_ids = shape.token_ids
    if cut is not None:
        if bytes(token_ids) != b"[]":  # (not the member member_span found: decided the ordinary way)
            return None
        token_ids = cut[1]
    if not shape.model or not token_ids or shape.prompt or shape.messages or shape.cache_salt or shape.mm_items:
        return None
    got = request_keys_json(token_ids, model=shape.model, hash_seed=hash_seed, block_size=block_size)
    if got is None or not 0 < got[1] <= max_tokens:
        return None
    return KeyedRequest(model=shape.model, keys=got[0], n_tokens=got[1], pods=shape.pods,
                        raw_token_ids=token_ids, max_staleness_ms=shape.max_staleness_ms)


_HEAD = re.compile(rb"\s*\[\s*(\d+)(?:\s*,\s*(\d+))?")


def leading_token_ids(raw: msgspec.Raw | bytes) -> tuple[int, ...]:
    """The first two ids of a JSON token list already validated by the C routine (one short regex, no decode)."""
    m = _HEAD.match(raw)  # type: ignore[call-overload]  # Raw is a buffer; match stops after two ids
    if m is None:
        return ()
    first, second = m.groups()
    return (int(first),) if second is None else (int(first), int(second))


def check_token_count(n: int, max_tokens: int) -> None:
    if n > max_tokens:
        raise BadRequest(f"too many tokens: {n} > the limit of {max_tokens} (max_tokens)")


def check_pods(pods: list[str] | None, max_pods: int) -> None:
    """The filter is sent to Valkey whole, so its length is bounded like the prompt's."""
    if pods is not None and len(pods) > max_pods:
        raise BadRequest(f"too many pods in the pods filter: {len(pods)} > the limit of {max_pods} (max_pods_filter)")


def check_depth(value: Any, limit: int, field: str) -> None:
    """Refuse ``value`` if lists and objects nest more than ``limit`` levels; iterative, so any depth is safe."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            raise BadRequest(f"{field} nests more than {limit} levels of lists and objects")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _too_deep() -> BadRequest:
    return BadRequest("invalid JSON: nested too deeply (1000 levels or more)")


_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def _refuse_if_too_deep(body: bytes) -> None:
    try:
        msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.MsgspecError:
        pass


def _explain(msgspec_message: str) -> str:
    unknown = _UNKNOWN.search(msgspec_message)
    if unknown and "at `$.mm_items" in msgspec_message:  # inside an item: say what an item takes
        return f"{_FIELD_HINTS['mm_items']} (and optionally modality): {clip(msgspec_message)}"
    if unknown:
        name = unknown.group(1)
        close = [f for f in ("model", "token_ids", "prompt", "messages", "pods", "cache_salt", "mm_items")
                 if f.rstrip("s") == name.rstrip("s")]
        return (f"unknown field {clip(name)!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                + ": the body takes model, one of token_ids, prompt, messages, and optionally pods, cache_salt "
                "and mm_items")
    m = _FIELD_AT.search(msgspec_message)
    hint = _FIELD_HINTS.get(m.group(1)) if m else None
    echo = clip(msgspec_message)
    if hint:
        return f"{hint}: {echo}"
    if "Expected `object`" in msgspec_message and " - at " not in msgspec_message:
        return f"the body must be a JSON object: {echo}"
    return f"invalid request: {echo}"
