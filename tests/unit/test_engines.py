"""Engine adapters (kv_preflight/engines/): every engine's fixtures decode to the events they encode, and the
bridge keys them as llm-d's request keys, whatever the engine's block size."""
from __future__ import annotations

import base64
import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from kv_preflight.ingester.bridge import ChainState, model_for, plan_batch
from kv_preflight.ingester.discovery import sources_from
from kv_preflight.engines import ENGINES, engine
from kv_preflight.index.entries import RemoveBlock, StoreBlock
from kv_preflight.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Topic, topic_or_none,
)
from kv_preflight.keys.chain import request_keys
from tests.conftest import fixture_path

ENGINE_FIXTURES = ["sglang-array-frames.jsonl", "sglang-map-frames.jsonl", "sglang-map-page24-eagle-frames.jsonl",
                   "sglang-map-page1-frames.jsonl", "trtllm-frames.jsonl", "vllm-offload-storage-frames.jsonl"]


def load_fixture(name: str) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in fixture_path(name).read_text().splitlines() if line.strip()]
    return lines[0]["header"], lines[1:]


def frames_of(msg: dict) -> list[bytes]:
    return [msg["topic"].encode(), msg["seq"].to_bytes(8, "big"), base64.b64decode(msg["payload_b64"])]


def decoded(name: str, topic: Topic | None = Topic("p", "tiny")):
    header, msgs = load_fixture(name)
    return header, [engine(header["engine"]).decode_frames(frames_of(m), topic=topic) for m in msgs]


@pytest.mark.parametrize("name", ENGINE_FIXTURES)
def test_every_engine_fixture_decodes_without_errors(name):
    header, frames = decoded(name)
    assert "@ " in header["sources"][0] or "PR #" in header["sources"][0]  # cites file @ commit, or the PR
    assert all(not f.errors and f.batch is not None and f.topic == Topic("p", "tiny") for f in frames)
    stored = [e for f in frames for e in f.batch.events if isinstance(e, BlockStored)]
    assert stored and all(0 <= h < 2**64 for e in stored for h in e.block_hashes)  # signed int64s read unsigned
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in stored)


def test_sglang_array_and_map_layouts_decode_to_the_same_events():
    _, arrays = decoded("sglang-array-frames.jsonl")
    _, maps = decoded("sglang-map-frames.jsonl")
    first_a, first_m = arrays[1].batch.events[0], maps[1].batch.events[0]
    assert first_a.parent_block_hash is None and first_a.block_size == 8 and first_m.block_size == 64
    assert first_a.token_ids == list(range(1000, 1008)) and first_m.token_ids == list(range(1000, 1064))
    mediums = {e.medium for f in arrays + maps for e in f.batch.events if isinstance(e, (BlockStored, BlockRemoved))}
    assert mediums == {"GPU", "CPU_PINNED"}
    assert isinstance(arrays[0].batch.events[0], AllBlocksCleared) and isinstance(maps[0].batch.events[0], AllBlocksCleared)
    # the salt travels in a trailing metadata map (PR #30827) or as a map field (PR #37482)
    assert arrays[-1].batch.events[0].cache_salt == "tenant-a" == maps[-1].batch.events[0].cache_salt
    lora = maps[-2].batch.events[0]
    assert lora.lora_id == 7 and lora.lora_name is None


def test_sglang_eagle_pairs_are_read_as_their_first_token():
    header, frames = decoded("sglang-map-page24-eagle-frames.jsonl")
    assert header["eagle"] and header["page_size"] == 24
    first = frames[1].batch.events[0]
    assert first.block_size == 24 and first.token_ids == list(range(1000, 1024))
    raw = msgspec.msgpack.decode(base64.b64decode(load_fixture("sglang-map-page24-eagle-frames.jsonl")[1][1]["payload_b64"]))
    assert raw[1][0]["token_ids"][:2] == [[1000, 1001], [1001, 1002]]  # what SGLang sent
    # vLLM never sends pairs: the same payload through vLLM's layout is refused, event by event
    vllm = engine("vllm").decode_frames(frames_of(load_fixture("sglang-map-page24-eagle-frames.jsonl")[1][1]),
                                        topic=Topic("p", "tiny"))
    assert vllm.errors and "token_ids" in vllm.errors[0]


def test_trtllm_merged_blocks_and_hash():
    header, frames = decoded("trtllm-frames.jsonl")
    assert header["block_size"] == 32 and header["negative_hashes"] > 0  # the fixture covers signed hashes
    merged = frames[0].batch.events[0]
    assert len(merged.block_hashes) == 4 and merged.block_size == 32 and len(merged.token_ids) == 128
    stored = [h for f in frames for e in f.batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert any(h >= 1 << 63 for h in stored)  # its negative int64 hashes, read as the same 64 bits unsigned
    # TensorRT-LLM never sends tagged arrays: one is an error, not a misread
    arrays = msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "GPU"]], 0])
    f = engine("trtllm").decode_frames([b"", (0).to_bytes(8, "big"), arrays], topic=Topic("p", "m"))
    assert f.errors and "tagged-array" in f.errors[0]


def test_vllm_placeholders_are_skipped_and_counted_and_storage_is_a_tier():
    header, frames = decoded("vllm-offload-storage-frames.jsonl", topic=None)
    assert sum(f.skipped for f in frames) == header["placeholders"] == 3
    assert all(f.error_count == 0 for f in frames)  # never an error, so never a flag
    assert frames[0].topic == Topic("vllm-off", "tiny")
    storage = [e for e in frames[3].batch.events if isinstance(e, BlockStored)]
    assert [e.medium for e in storage] == ["STORAGE"]  # its locality/ownership fields are tolerated
    plan = plan_batch(frames[3].batch, pod_id="p", topic_model="tiny", state=_state_after(frames[:2]),
                      hash_seed="", block_size=16, entry_field=lambda pod, medium, group: f"{pod}@{medium}",
                      extra_keys=engine("vllm").extra_keys)
    assert {m.tier for m in plan.mutations} == {"storage"} and plan.orphans == 0


def test_unknown_fields_are_tolerated_on_every_path():
    ev = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None, "token_ids": list(range(16)),
          "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "locality": "REMOTE",
          "ownership": "x", "session_id": "s", "brand_new_field": {"nested": [1, 2]}}
    for payload in ([1.0, [ev], 0], [1.0, [ev, {"type": "BlockStored", "block_hashes": [6], "token_ids": [],
                                                 "block_size": 0, "parent_block_hash": None}], 0]):
        f = engine("vllm").decode_frames([b"kv@p@m", (0).to_bytes(8, "big"), msgspec.msgpack.encode(payload)])
        assert not f.errors and f.batch.events[0].block_hashes == [5]
    assert f.skipped == 1  # the second payload took the tolerant path (a placeholder), same result


def _state_after(frames) -> ChainState:
    state = ChainState()
    for f in frames:
        plan_batch(f.batch, pod_id="p", topic_model="tiny", state=state, hash_seed="", block_size=16,
                   entry_field=lambda pod, medium, group: pod, extra_keys=engine("vllm").extra_keys)
    return state


@pytest.mark.parametrize("page", list(range(1, 65)))
def test_sglang_pages_of_any_size_key_the_same_request_keys(page):
    """A prompt stored one SGLang page at a time, any page size 1..64, keys exactly llm-d's request keys of
    its whole 16-token blocks; evicting the pages from the end removes the keys their tokens completed."""
    tokens = list(range(500, 500 + 200))
    usable = len(tokens) // page * page
    state, stores, parent = ChainState(), [], None
    for i in range(0, usable, page):
        h = 10_000 + i
        batch = EventBatch(1.0, [BlockStored([h], parent, tokens[i:i + page], page, medium="CPU_PINNED")])
        plan = plan_batch(batch, pod_id="p", topic_model="tiny", state=state, hash_seed="", block_size=16,
                          entry_field=lambda pod, medium, group: pod, extra_keys=engine("sglang").extra_keys)
        assert plan.orphans == 0
        stores += [m for m in plan.mutations if isinstance(m, StoreBlock)]
        parent = h
    keyed = [k for s in stores for k in s.request_keys]
    assert keyed == request_keys(tokens[:usable // 16 * 16], model="tiny")
    assert {s.tier for s in stores} == {"cpu_pinned"}  # llm-d's lowercased medium
    last = BlockRemoved([parent], medium="CPU_PINNED")
    removal = plan_batch(EventBatch(2.0, [last]), pod_id="p", topic_model="tiny", state=state, hash_seed="",
                         block_size=16, entry_field=lambda pod, medium, group: pod, extra_keys=engine("sglang").extra_keys)
    assert removal.mutations == [RemoveBlock(parent, "cpu_pinned", 0)]


def test_lora_id_is_keyed_by_the_adapter_name_it_is_mapped_to():
    ev = BlockStored([1], None, list(range(32)), 32, lora_id=7)
    assert model_for(ev, "tiny", {"7": "sql-lora"}) == "sql-lora"
    assert model_for(ev, "tiny") == "tiny:lora_id=7"  # unnamed: never a hit on the base model
    assert model_for(BlockStored([1], None, [], 1, lora_id=7, lora_name="given"), "tiny", {"7": "x"}) == "given"
    plan = plan_batch(EventBatch(1.0, [ev]), pod_id="p", topic_model="tiny", state=ChainState(), hash_seed="",
                      block_size=16, entry_field=lambda pod, medium, group: pod, lora_names={"7": "sql-lora"},
                      extra_keys=engine("sglang").extra_keys)
    assert plan.mutations[0].request_keys == tuple(request_keys(list(range(32)), model="sql-lora"))


def test_topics_empty_foreign_and_named():
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}], 0])
    seq = (3).to_bytes(8, "big")
    named = Topic("sgl-0", "m")
    for topic in (b"", b"sglang-events", b"kv@other@x"):  # a named source stands for any topic frame
        f = engine("sglang").decode_frames([topic, seq, payload], topic=named)
        assert f.topic == named and not f.errors and f.seq == 3
    assert engine("sglang").decode_frames([b"", seq, payload]).topic is None  # unnamed, empty: no pod
    assert engine("vllm").decode_frames([b"foreign", seq, payload]).errors  # unnamed, foreign: refused
    # replay replies: SGLang's carry no topic, TensorRT-LLM's an empty one; both take the named pod
    assert engine("sglang").decode_frames([b"", seq, payload], topic=named).topic == named
    assert engine("trtllm").decode_frames([b"", b"", seq, payload], topic=named).topic == named
    assert not engine("trtllm").decode_frames([b"", b"", seq, payload]).errors  # an empty topic is no error
    assert topic_or_none("kv@a@b@c") == Topic("a", "b@c") and topic_or_none("") is None
    assert topic_or_none("nope") is None


def test_the_registry_and_what_each_engine_declares():
    assert set(ENGINES) == {"vllm", "sglang", "trtllm"}
    assert engine(None).name == "vllm"
    with pytest.raises(ValueError, match="not one of"):
        engine("tgi")
    assert ENGINES["trtllm"].default_block_size == 32 and not ENGINES["sglang"].replay_topic
    assert ENGINES["vllm"].load_metrics.running == "vllm:num_requests_running"


def test_sglang_server_info_gives_sources_named_by_serving_address():
    body = {"page_size": 16, "served_model_name": "qwen", "dp_size": 2, "enable_dp_attention": True,
            "kv_events_config": json.dumps({"publisher": "zmq", "endpoint": "tcp://*:5557",
                                            "replay_endpoint": "tcp://*:5600"})}
    a, b = sources_from(engine("sglang"), "http://10.0.0.5:30000", body)
    assert (a.endpoint, a.replay, a.rank, b.endpoint, b.replay, b.rank) == (
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5600", 0, "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5601", 1)
    assert a.engine == "sglang" and a.named_topic == Topic("10.0.0.5:30000", "qwen") and not a.bind
    topic = dict(body, kv_events_config={"publisher": "zmq", "endpoint": "tcp://ingester:5557", "topic": "kv@s-0@qwen"},
                 enable_dp_attention=False)
    (c,) = sources_from(engine("sglang"), "http://10.0.0.5:30000", topic)
    assert c.bind and c.endpoint == "tcp://*:5557" and c.named_topic is None and c.topic == "kv@s-0@qwen"
    assert sources_from(engine("sglang"), "http://h:1", {"page_size": 1}) == []  # events off


def test_lora_names_come_from_the_flag_or_the_environment(monkeypatch):
    from kv_preflight.config import Config, parse_lora_names

    assert Config.load(lora_names=parse_lora_names(["7=sql-lora", "08=b"])).lora_names == {"7": "sql-lora", "8": "b"}
    monkeypatch.setenv("KVPF_LORA_NAMES", "3=x,4=y")
    assert Config.load().lora_names == {"3": "x", "4": "y"}
    with pytest.raises(ValueError, match="numeric LoRA id"):
        parse_lora_names(["sql=7"])


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=9),
    lambda c: st.lists(c, max_size=6) | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "parent_block_hash", "medium", "lora_id",
                         "cache_salt", "metadata", "session_id"]) | st.text(max_size=3), c, max_size=6),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(ENGINES)), st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "x"]),
       st.lists(_VALUES, max_size=8), _VALUES)
def test_fuzz_every_engine_layout_never_raises(name, tag, positional, as_map):
    """Arrays in each engine's field order, maps, pairs, metadata maps: a worded error at worst."""
    events = [[tag, *positional], as_map if not isinstance(as_map, dict) else {"type": tag, **as_map}]
    try:
        payload = msgspec.msgpack.encode([1.0, events, None])
    except (TypeError, OverflowError):
        return
    for topic in (None, Topic("p", "m")):
        out = engine(name).decode_frames([b"", (1).to_bytes(8, "big"), payload], topic=topic)
        assert isinstance(out.errors, list) and out.error_count + out.skipped + len(out.batch.events) == 2


def test_vllm_kv_capacity_from_its_cache_config_info():
    """What a gateway bounds an engine's approximate index by (docs/gateway.md): a real vLLM 0.32 capture, and the
    simulator's series (num_gpu_blocks x block_size)."""
    from kv_preflight.engines.vllm import read_kv_capacity
    from tests.conftest import fixture_path

    assert read_kv_capacity(fixture_path("vllm-0.32-metrics.txt").read_text()) == (8192, 32)
    sim = 'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="512"} 1.0'
    assert read_kv_capacity(sim) == (512 * 16, 16)
    assert read_kv_capacity(sim + "\n" + sim.replace('engine="0"', 'engine="1"')) == (2 * 512 * 16, 16)  # DP ranks
    assert read_kv_capacity("vllm:num_requests_running 0.0\n") is None
