import base64

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.events import (
    MAX_ERROR_CHARS, MAX_LISTED_ERRORS, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
    encode_frames,
)
from kv_preflight.engines.vllm import ENGINE as VLLM
from tests.conftest import load_jsonl


def _live(name):
    return [
        VLLM.decode_frames([o["topic"].encode(), o["seq"].to_bytes(8, "big"), base64.b64decode(o["payload_b64"])])
        for o in load_jsonl(name)
    ]


def decode_payload(payload: bytes) -> tuple[EventBatch | None, list[str]]:
    """A batch as a vLLM PUB message carries it, and the reasons for any events dropped from it."""
    out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), payload])
    return out.batch, out.errors


def test_vllm_032_live_frames_decode_completely():
    frames = _live("vllm-0.32-live-frames.jsonl")
    assert frames and all(not f.errors and f.batch is not None for f in frames)
    assert {f.topic.pod_id for f in frames} == {"vllm-0"} and {f.topic.model for f in frames} == {"tiny"}
    kinds = [type(e).__name__ for f in frames for e in f.batch.events]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(kinds)
    stored = next(e for f in frames for e in f.batch.events if isinstance(e, BlockStored))
    assert stored.block_size == 32 and stored.medium == "GPU" and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention" and stored.lora_name is None
    assert len(stored.token_ids) == 32 * len(stored.block_hashes)
    # A prefix-cache reset: AllBlocksCleared then a BlockStored in the same batch, in that order.
    reset = next(f for f in frames if any(isinstance(e, AllBlocksCleared) for e in f.batch.events))
    assert isinstance(reset.batch.events[0], AllBlocksCleared) and isinstance(reset.batch.events[1], BlockStored)


def test_vllm_032_replay_frames_decode_and_end():
    frames = [VLLM.decode_frames([base64.b64decode(x) for x in o["frames_b64"]]) for o in load_jsonl("vllm-0.32-replay-frames.jsonl")]
    assert [f.seq for f in frames[:-1]] == list(range(len(frames) - 1))
    assert all(not f.errors and f.batch and f.topic.pod_id == "vllm-0" for f in frames[:-1])
    assert frames[-1].seq == -1 and frames[-1].batch is None and not frames[-1].errors


def test_old_replay_reply_without_topic():
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], 0])
    f = VLLM.decode_frames([b"", (7).to_bytes(8, "big"), payload])
    assert f.seq == 7 and f.topic is None and isinstance(f.batch.events[0], AllBlocksCleared)


def test_legacy_positional_frames():
    frames = _live("vllm-legacy-array-frames.jsonl")
    assert all(not f.errors for f in frames)
    first = frames[0].batch.events[0]
    assert isinstance(first, BlockStored) and first.block_hashes == [111, 222] and first.medium == "GPU"
    assert first.parent_block_hash is None and first.block_size == 32
    assert frames[1].batch.events[0].parent_block_hash == 222
    assert frames[2].batch.events[0].block_hashes == [0x1BC]  # bytes hash: last 8 bytes, big-endian
    assert isinstance(frames[3].batch.events[0], BlockRemoved) and frames[3].batch.events[0].block_hashes == [333]
    assert isinstance(frames[4].batch.events[0], AllBlocksCleared)


def test_unknown_tag_and_bad_event_are_reported_and_others_apply():
    payload = msgspec.msgpack.encode([1.0, [
        {"type": "BlockWarmed", "block_hashes": [1]},
        {"type": "BlockRemoved", "block_hashes": "nope"},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "future_field": {"x": 1}},
        ["AllBlocksCleared"],
    ]])
    batch, errors = decode_payload(payload)
    assert len(errors) == 2 and "unknown event tag" in errors[0]
    assert [type(e).__name__ for e in batch.events] == ["BlockRemoved", "AllBlocksCleared"]
    assert batch.data_parallel_rank is None


def test_map_batch_layout():
    payload = msgspec.msgpack.encode({"ts": 2.5, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    batch, errors = decode_payload(payload)
    assert not errors and batch.ts == 2.5 and batch.data_parallel_rank == 1


def test_stored_with_too_few_tokens_is_rejected():
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                            "token_ids": [1] * 40, "block_size": 32}]])
    batch, errors = decode_payload(payload)
    assert not batch.events and "need 64 tokens" in errors[0]


def test_encode_roundtrip():
    batch = EventBatch(ts=3.0, events=[BlockStored([1], None, list(range(16)), 16, medium="GPU", group_idx=0),
                                       BlockRemoved([1], medium="GPU"), AllBlocksCleared()], data_parallel_rank=0)
    f = VLLM.decode_frames(encode_frames("kv@p@m", 9, batch))
    assert f.seq == 9 and f.topic.pod_id == "p" and f.batch == batch and not f.errors


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_fuzz_frames_never_raise(frames):
    out = VLLM.decode_frames(frames)
    assert out.batch is None or isinstance(out.batch, EventBatch)


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5) | st.binary(max_size=9),
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids", "block_size",
                                                                           "parent_block_hash", "medium", "ts", "events"]) | st.text(max_size=3), c, max_size=6),
    max_leaves=30,
))
def test_fuzz_structured_payloads_never_raise(obj):
    try:
        payload = msgspec.msgpack.encode(obj)
    except (TypeError, OverflowError):
        return
    out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), payload])
    assert isinstance(out.errors, list)


def test_encoder_reproduces_vllm_032_bytes():
    """The one wire schema encodes exactly what vLLM 0.32 sent, so the simulator cannot drift."""
    from kv_preflight.events import encode_payload

    for o in load_jsonl("vllm-0.32-live-frames.jsonl"):
        raw = base64.b64decode(o["payload_b64"])
        f = VLLM.decode_frames([o["topic"].encode(), o["seq"].to_bytes(8, "big"), raw])
        assert encode_payload(f.batch) == raw, o["seq"]


# ---- hostile input: nothing raises, every failure is a bounded, counted error


def _stored_with(key: str, raw_value: bytes) -> bytes:
    """A vLLM 0.32 batch of one BlockStored map plus ``key`` set to the raw msgpack ``raw_value``."""
    body = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    head = msgspec.msgpack.encode(body)
    event = bytes([0x80 | (len(body) + 1)]) + head[1:] + msgspec.msgpack.encode(key) + raw_value
    return b"\x93\xcb" + bytes(8) + b"\x91" + event + b"\x00"


@pytest.mark.parametrize("depth", [999, 1000, 5000, 200_000])
@pytest.mark.parametrize("where", ["extra_keys", "future_field"])
def test_deep_nesting_is_a_decode_error_never_a_recursion_error(depth, where):
    out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), _stored_with(where, b"\x91" * depth + b"\xc0")])
    if where == "future_field" and out.batch is not None:  # under the recursion limit: skipped, as any unknown field
        assert not out.errors and len(out.batch.events) == 1
    else:
        assert out.batch is None or not out.batch.events
        assert out.errors and all(len(e) <= MAX_ERROR_CHARS for e in out.errors)


def test_extra_keys_deeper_than_the_bound_drop_the_event():
    ok = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), _stored_with("extra_keys", b"\x91\x92\xa2mm\x00")])
    assert not ok.errors and ok.batch.events[0].extra_keys == [["mm", 0]]
    deep = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), _stored_with("extra_keys", b"\x91" * 12 + b"\xc0")])
    assert deep.batch is not None and not deep.batch.events and "nest deeper" in deep.errors[0]


def test_a_non_utf8_topic_is_a_decode_error_not_a_pod():
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], 0])
    for topic in (b"kv@\xff\xfe@tiny", b"kv@pod@\xc3", b"\x80kv@pod@tiny"):
        out = VLLM.decode_frames([topic, (1).to_bytes(8, "big"), payload])
        assert out.topic is None and out.batch is None and "not UTF-8" in out.errors[0]
    assert VLLM.decode_frames([b"kv@caf\xc3\xa9@tiny", (1).to_bytes(8, "big"), payload]).topic.pod_id == "café"


def test_negative_seqs_and_non_finite_timestamps_are_decode_errors():
    payload = msgspec.msgpack.encode([1.0, [], 0])
    assert "negative" in VLLM.decode_frames([b"kv@p@m", (-2).to_bytes(8, "big", signed=True), payload]).errors[0]
    assert VLLM.decode_frames([b"", (-1).to_bytes(8, "big", signed=True), b""]).seq == -1  # the replay end marker
    for ts in (float("nan"), float("inf"), float("-inf")):
        out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), msgspec.msgpack.encode([ts, [], 0])])
        assert out.batch is None and "finite" in out.errors[0]


def test_errors_are_bounded_in_number_and_length():
    many = msgspec.msgpack.encode([1.0, [None] * 100_000 + [{"type": "AllBlocksCleared"}], 0])
    out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), many])
    assert len(out.errors) == MAX_LISTED_ERRORS and out.error_count == 100_000 and len(out.batch.events) == 1
    huge_tag = msgspec.msgpack.encode([1.0, [{"type": "x" * 1_000_000}], 0])
    assert len(VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), huge_tag]).errors[0]) < 200
    assert len(VLLM.decode_frames([b"kv@" + b"p" * 1_000_000, (1).to_bytes(8, "big"), b""]).errors[0]) < 200


@pytest.mark.parametrize("header", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                    b"\xc6\xff\xff\xff\xff"])
def test_size_claims_past_the_payload_are_errors_without_allocation(header):
    for payload in (b"\x93\xcb" + bytes(8) + header, _stored_with("token_ids", header)):
        out = VLLM.decode_frames([b"kv@p@m", (1).to_bytes(8, "big"), payload])
        assert out.errors and (out.batch is None or not out.batch.events)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8), st.integers(0, 6))
def test_fuzz_nested_and_framed_never_raise(frames, depth_exp):
    nested = b"\x91" * (10 ** depth_exp) + b"\xc0"
    for msg in (frames, [b"kv@p@m", (1).to_bytes(8, "big"), nested], [b""] + frames):
        out = VLLM.decode_frames(msg)
        assert isinstance(out.errors, list) and all(len(e) <= MAX_ERROR_CHARS for e in out.errors)
