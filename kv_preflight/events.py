"""The KV-event wire schema, written once, and a decoder that never raises.

The structs below are the decoded events every engine's frames become; how an engine lays them out
on the wire (tagged arrays and their field order, EAGLE pairs) is its ``WireLayout``, owned by its
adapter in kv_preflight/engines/ and passed to every decoding function here (there is no default).

Frames are ``[topic, seq (8 bytes big-endian), payload]``; the payload is msgpack
``[ts, events, data_parallel_rank?]``. Two event layouts exist in the wild: named-field maps with a
``type`` key (vLLM >= 0.2x, SGLang since its PR #37482, TensorRT-LLM), and positional arrays whose first
element is the tag, their field order the engine's (older vLLM, older SGLang: the adapters' layouts).

Block hashes are ints, or bytes in some builds (we take the last 8 bytes,
big-endian, as llm-d and Dynamo do). Unknown fields are ignored and unknown tags
are reported, so a newer engine degrades to counted errors, never to a crash.

Frames can come from anyone who reaches a bound socket, so ``decode_frames`` raises
nothing at all: whatever msgspec or our checks reject (deep nesting included) becomes
a worded error, bounded in length because it is logged.
"""
from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

TOPIC_PREFIX = "kv"
SEQ_END = -1  # replay socket: a reply with this seq ends the stream


TokenId = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]  # checked by the fast decoder, as _build does


# The tag lets the fast decoder below read vLLM 0.32's maps straight into these structs.
class BlockStored(msgspec.Struct, frozen=True, tag_field="type", tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[TokenId]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None  # SGLang (PR #37482 map field; before it a trailing metadata map)


class BlockRemoved(msgspec.Struct, frozen=True, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag_field="type", tag="AllBlocksCleared"):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class Topic(msgspec.Struct, frozen=True):
    pod_id: str
    model: str


class DecodedFrame(msgspec.Struct, frozen=True):
    """One ZMQ message, decoded as far as it could be; ``errors`` says what was dropped and why."""

    topic: Topic | None
    seq: int | None
    batch: EventBatch | None
    errors: list[str]
    more_errors: int = 0  # further dropped events beyond the first MAX_LISTED_ERRORS, counted, not worded
    skipped: int = 0  # events that describe no indexable block (vLLM placeholders): counted, not errors

    @property
    def error_count(self) -> int:
        return len(self.errors) + self.more_errors


class DecodeError(ValueError):
    pass


# Error texts quote what was received and are logged: long or deep values are abbreviated.
_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = 60
_quote.maxlevel = 3
MAX_ERROR_CHARS = 300
# Worded errors kept per message: a 32 MiB frame of a million one-byte bad events must not become a
# million strings (and log lines); the rest are only counted.
MAX_LISTED_ERRORS = 16

# How deep ``extra_keys`` (kept as decoded, type Any) may nest. vLLM 0.32 sends per block None or a
# tuple of multimodal hashes, (hash, offset) pairs, a LoRA name or a cache salt: three levels.
MAX_EXTRA_KEYS_DEPTH = 8


_msgpack = msgspec.msgpack.Decoder()

@dataclass(frozen=True)
class WireLayout:
    """How one engine family lays its events out on the wire (kv_preflight/engines/ has one per family).

    ``positional`` names the fields of a tagged-array event, in order, per tag (None: that engine
    never sends arrays, so one is an error); ``pair_tokens`` accepts SGLang's EAGLE bigram pages,
    where each ``token_ids`` element is a ``[t_i, t_i+1]`` pair and the block's token is ``t_i``.
    """

    name: str
    positional: Mapping[str, tuple[str, ...]] | None = None
    pair_tokens: bool = False


class Placeholder(Exception):
    """Not an error: an event that names no tokens (vLLM's offloading placeholders, PR #51243)."""


_TYPES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def parse_topic(raw: bytes | str) -> Topic:
    """``kv@<pod>@<model>``; the model may itself contain ``@`` (rare, but split only twice).

    Strict UTF-8: replacing bad bytes would turn a garbled topic into a pod named "\ufffd",
    and different garbage into the same pod.
    """
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DecodeError(f"topic {_quote.repr(raw)} is not UTF-8") from None
    else:
        text = raw
    parts = text.split("@", 2)
    if len(parts) != 3 or not parts[1] or not parts[2]:
        raise DecodeError(f"topic {_quote.repr(text)} is not kv@<pod>@<model>")
    return Topic(pod_id=parts[1], model=parts[2])


def topic_or_none(raw: bytes | str | None) -> Topic | None:
    """``parse_topic`` for callers that only ask (discovery, tools): None for an empty or foreign topic."""
    if not raw:
        return None
    try:
        return parse_topic(raw)
    except DecodeError:
        return None


def parse_seq(raw: bytes) -> int:
    """8 bytes big-endian, signed: 0, 1, ... per engine process, and -1 only as the replay end marker."""
    if len(raw) != 8:
        raise DecodeError(f"sequence frame has {len(raw)} bytes, expected 8")
    seq = int.from_bytes(raw, "big", signed=True)
    if seq < SEQ_END:
        raise DecodeError(f"sequence number {seq} is negative")
    return seq


def block_hash_to_int(value: Any) -> int:
    """Ints pass through (masked to uint64); bytes hashes keep their last 8 bytes, big-endian."""
    if isinstance(value, bool):
        raise DecodeError("block hash is a bool")
    if isinstance(value, int):
        return value & 0xFFFFFFFFFFFFFFFF
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if not raw:
            raise DecodeError("empty bytes block hash")
        return int.from_bytes(raw[-8:], "big")
    raise DecodeError(f"block hash of type {type(value).__name__}")


def _nesting_within(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists, tuples and maps at most ``limit`` deep; iterative, so a
    hostile depth cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple)):
            children = item
        elif isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        else:
            continue
        if depth > limit:
            return False
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, tuple, dict)))
    return True


def _as_hash_list(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not a list")
    return [block_hash_to_int(v) for v in value]


def _int_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise DecodeError(f"{name} is not an integer")
    return value


def _str_or_none(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise DecodeError(f"{name} is not a string")


def _tokens(value: Any, layout: WireLayout) -> list[int]:
    """A block's token ids, checked; SGLang's EAGLE pages hold ``[t_i, t_i+1]`` pairs (its radix tree keys
    bigrams under speculative decoding, mem_cache/utils.py ``convert_to_bigram_key``): the token is ``t_i``."""
    if layout.pair_tokens and isinstance(value, list) and value and isinstance(value[0], (list, tuple)):
        value = [p[0] if isinstance(p, (list, tuple)) and len(p) == 2 else p for p in value]
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= 0xFFFFFFFF for t in value
    ):
        raise DecodeError("token_ids is not a list of integers in [0, 2^32)")
    return value


def _salt(fields: dict[str, Any]) -> str | None:
    """SGLang's cache salt: a map field since PR #37482, a trailing ``{"cache_salt": ...}`` before it (#30827)."""
    salt = fields.get("cache_salt")
    metadata = fields.get("metadata")
    if salt is None and isinstance(metadata, dict):
        salt = metadata.get("cache_salt")
    return _str_or_none("cache_salt", salt)


def _build(tag: str, fields: dict[str, Any], layout: WireLayout) -> Event:
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=_as_hash_list(fields.get("block_hashes")),
            medium=_str_or_none("medium", fields.get("medium")),
            group_idx=_int_or_none("group_idx", fields.get("group_idx")),
        )
    block_size = fields.get("block_size")
    if block_size == 0 and fields.get("token_ids") == []:
        # vLLM's offloading connector (PR #51243) announces Mamba/SSM and unresolved chunks with one
        # offload-key hash, no tokens and block_size 0: nothing to key, and not a defect of the stream.
        raise Placeholder()
    tokens = _tokens(fields.get("token_ids"), layout)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise DecodeError(f"block_size {_quote.repr(block_size)} is not a positive integer")
    hashes = _as_hash_list(fields.get("block_hashes"))
    if len(tokens) < len(hashes) * block_size:
        raise DecodeError(f"{len(hashes)} blocks of {block_size} need {len(hashes) * block_size} tokens, got {len(tokens)}")
    parent = fields.get("parent_block_hash")
    extra = fields.get("extra_keys")
    if isinstance(extra, list) and not _nesting_within(extra, MAX_EXTRA_KEYS_DEPTH):
        raise DecodeError(f"extra_keys nest deeper than {MAX_EXTRA_KEYS_DEPTH} levels")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else block_hash_to_int(parent),
        token_ids=tokens,
        block_size=block_size,
        lora_id=_int_or_none("lora_id", fields.get("lora_id")),
        medium=_str_or_none("medium", fields.get("medium")),
        lora_name=_str_or_none("lora_name", fields.get("lora_name")),
        extra_keys=extra if isinstance(extra, list) else None,
        group_idx=_int_or_none("group_idx", fields.get("group_idx")),
        kv_cache_spec_kind=_str_or_none("kv_cache_spec_kind", fields.get("kv_cache_spec_kind")),
        kv_cache_spec_sliding_window=_int_or_none(
            "kv_cache_spec_sliding_window", fields.get("kv_cache_spec_sliding_window")
        ),
        cache_salt=_salt(fields),
    )


def decode_event(raw: Any, layout: WireLayout) -> Event:
    """One event in either layout. Raises DecodeError (never anything else) on a bad one, and
    Placeholder on an event that names no block to index."""
    try:
        if isinstance(raw, dict):
            tag = raw.get("type")
            fields = raw
        elif isinstance(raw, list) and raw:
            if layout.positional is None:
                raise DecodeError(f"a tagged-array event, which {layout.name} does not send")
            tag = raw[0]
            names = layout.positional.get(tag) if isinstance(tag, str) else None
            fields = dict(zip(names, raw[1:])) if names is not None else {}
        else:
            raise DecodeError(f"event is a {type(raw).__name__}, not a map or tagged array")
        if isinstance(tag, bytes):
            tag = tag.decode("utf-8", "replace")
        if tag not in _TYPES:
            raise DecodeError(f"unknown event tag {_quote.repr(tag)}")
        return _build(tag, fields, layout)
    except (DecodeError, Placeholder):
        raise
    except Exception as exc:  # a shape nobody anticipated (RecursionError included): still a counted error
        raise DecodeError(f"malformed event: {type(exc).__name__}: {_quote.repr(str(exc))}") from None


class _WireBatch(msgspec.Struct, array_like=True):
    """vLLM 0.32's ``[ts, [event map, ...], dp_rank]``, typed: decoded and checked in C."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_fast_batch = msgspec.msgpack.Decoder(_WireBatch)
_U64 = 0xFFFFFFFFFFFFFFFF


def _decode_fast(payload: bytes) -> EventBatch | None:
    """The common payload in one typed decode, or None for anything the tolerant path must judge.

    None on any shape msgspec rejects (positional events, bytes hashes, an unknown tag, a
    2-element batch, ...) and on any event ``_build`` would drop, so errors are worded and
    counted in one place; what it returns equals what the tolerant path would. msgspec counts
    every nesting level against the interpreter's recursion limit (1000 by default, far inside
    the C stack) and raises RecursionError past it, even inside a field it skips: that too is
    None here, and the tolerant path turns it into a DecodeError.
    """
    try:
        wire = _fast_batch.decode(payload)
    except Exception:  # ValidationError, DecodeError, RecursionError, MemoryError: the slow path judges
        return None
    if not math.isfinite(wire.ts):
        return None
    events = wire.events
    for i, ev in enumerate(events):
        if type(ev) is BlockStored:
            if ev.block_size <= 0 or len(ev.token_ids) < len(ev.block_hashes) * ev.block_size:
                return None
            if ev.extra_keys and not _nesting_within(ev.extra_keys, MAX_EXTRA_KEYS_DEPTH):
                return None
            if (ev.block_hashes and (min(ev.block_hashes) < 0 or max(ev.block_hashes) > _U64)) or (
                    ev.parent_block_hash is not None and not 0 <= ev.parent_block_hash <= _U64):
                events[i] = msgspec.structs.replace(
                    ev, block_hashes=[block_hash_to_int(h) for h in ev.block_hashes],
                    parent_block_hash=None if ev.parent_block_hash is None else block_hash_to_int(ev.parent_block_hash))
        elif type(ev) is BlockRemoved and ev.block_hashes and (min(ev.block_hashes) < 0 or max(ev.block_hashes) > _U64):
            events[i] = msgspec.structs.replace(ev, block_hashes=[block_hash_to_int(h) for h in ev.block_hashes])
    return EventBatch(ts=wire.ts, events=events, data_parallel_rank=wire.data_parallel_rank)


def _decode_payload(payload: bytes, layout: WireLayout) -> tuple[EventBatch, list[str], int, int]:
    """The batch, the first MAX_LISTED_ERRORS reasons for dropped events, how many more were dropped,
    and how many placeholders were skipped."""
    fast = _decode_fast(payload)
    if fast is not None:
        return fast, [], 0, 0
    try:
        raw = _msgpack.decode(payload)
    except RecursionError:
        raise DecodeError("payload nests deeper than the decoder's recursion limit") from None
    except Exception as exc:
        raise DecodeError(f"payload is not msgpack: {_quote.repr(str(exc))}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    else:
        raise DecodeError("batch is neither [ts, events, dp_rank?] nor a map")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        # the apply script compares timestamps to tell a restart from a duplicate: NaN or inf would lie
        raise DecodeError("batch timestamp is not a finite number")
    if not isinstance(events, list):
        raise DecodeError("batch events is not a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        rank = None
    decoded: list[Event] = []
    errors: list[str] = []
    more = skipped = 0
    for i, ev in enumerate(events):
        try:
            decoded.append(decode_event(ev, layout))
        except Placeholder:
            skipped += 1
        except DecodeError as exc:
            if len(errors) < MAX_LISTED_ERRORS:
                errors.append(f"event {i}: {exc}")
            else:
                more += 1
    return EventBatch(ts=float(ts), events=decoded, data_parallel_rank=rank), errors, more, skipped


def decode_frames(frames: list[bytes], layout: WireLayout, *, topic: Topic | None = None) -> DecodedFrame:
    """A PUB message (``[topic, seq, payload]``) or a replay reply, fully tolerant: never raises.

    Replay replies come as ``["", topic, seq, payload]`` (vLLM 0.32, TensorRT-LLM) or
    ``["", seq, payload]`` (SGLang, older vLLM); the leading empty delimiter is stripped by the
    caller or here. ``topic``, when the source names its pod and model (``--source ...,pod=,model=``),
    stands for whatever topic frame came: publishers default to an empty one.
    """
    try:
        decoded = _decode_frames(frames, layout, topic)
    except Exception as exc:  # a bug or a shape no check anticipated: still one counted error, never a crash
        return DecodedFrame(None, None, None, [f"undecodable message: {type(exc).__name__}: {_quote.repr(str(exc))}"])
    if any(len(e) > MAX_ERROR_CHARS for e in decoded.errors):
        decoded = msgspec.structs.replace(decoded, errors=[_clip(e) for e in decoded.errors])
    return decoded


def _clip(error: str) -> str:
    return error if len(error) <= MAX_ERROR_CHARS else error[:MAX_ERROR_CHARS - 3] + "..."


def _decode_frames(frames: list[bytes], layout: WireLayout, fixed: Topic | None) -> DecodedFrame:
    # Replay replies lead with the ROUTER's empty delimiter frame.
    if len(frames) == 4 and frames[0] == b"":
        frames = frames[1:]
    elif len(frames) == 3 and frames[0] == b"" and len(frames[1]) == 8:
        frames = frames[1:]
    topic: Topic | None = None
    try:
        if len(frames) == 3:
            seq_raw, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq_raw, payload = frames[0], frames[1]
        else:
            return DecodedFrame(None, None, None, [f"message has {len(frames)} frames, expected 3"])
        if not all(isinstance(f, (bytes, bytearray, memoryview)) for f in frames):
            return DecodedFrame(None, None, None, ["message frames are not bytes"])
        seq = parse_seq(seq_raw)
        if seq != SEQ_END:
            # A source that names its pod ignores the topic frame; otherwise the replay end marker and
            # a topic-less replay reply carry an empty one, and every other message names its pod.
            if fixed is not None:
                topic = fixed
            elif len(frames) == 3 and frames[0] != b"":
                topic = parse_topic(frames[0])
    except DecodeError as exc:
        return DecodedFrame(topic, None, None, [str(exc)])
    if seq == SEQ_END or not payload:
        return DecodedFrame(topic, seq, None, [])
    try:
        batch, errors, more, skipped = _decode_payload(payload, layout)
    except DecodeError as exc:
        return DecodedFrame(topic, seq, None, [str(exc)])
    return DecodedFrame(topic, seq, batch, errors, more, skipped)


# ---- encoding: the simulator and tests publish exactly what vLLM 0.32 sends ----

_encoder = msgspec.msgpack.Encoder()


# vLLM 0.32's event structs are ``omit_defaults``: fields whose default is None are left out
# while unset; lora_id, medium and lora_name have no default there and are always sent.
_OMITTED_WHEN_NONE = frozenset({"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                                "cache_salt"})


def event_to_wire(event: Event) -> dict[str, Any]:
    """The map vLLM 0.32 would send for this event, byte for byte once msgpack-encoded."""
    body = {f: getattr(event, f) for f in event.__struct_fields__}
    return {"type": type(event).__name__,
            **{k: v for k, v in body.items() if not (v is None and k in _OMITTED_WHEN_NONE)}}


def encode_payload(batch: EventBatch) -> bytes:
    return _encoder.encode([batch.ts, [event_to_wire(e) for e in batch.events], batch.data_parallel_rank])


def encode_frames(topic: str, seq: int, batch: EventBatch | None) -> list[bytes]:
    payload = b"" if batch is None else encode_payload(batch)
    return [topic.encode(), seq.to_bytes(8, "big", signed=True), payload]


def make_topic(pod_id: str, model: str) -> str:
    return f"{TOPIC_PREFIX}@{pod_id}@{model}"
