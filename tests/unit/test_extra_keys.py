"""vLLM 0.32's ``extra_keys`` read by position (engines/vllm.py ``read_extra_keys``), and the request keys the
bridge gives the blocks of frames vLLM's own code published (tests/fixtures/build_extra_keys_frames.py) or a
real vLLM sent (vllm-0.32-lora-live-frames.jsonl): the keys the predictor computes for the same prompt, items,
salt and adapter (keys/multimodal.py, keys/chain.py ``prompt_request_keys``)."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kv_preflight.engines import BlockExtras
from kv_preflight.engines.vllm import ENGINE as VLLM
from kv_preflight.engines.vllm import read_extra_keys
from kv_preflight.events import BlockStored, EventBatch, make_topic
from kv_preflight.ingester.bridge import ChainState, adapter_of, model_for, plan_batch
from kv_preflight.keys.chain import prompt_request_keys, request_keys, salted_request_keys
from kv_preflight.keys.multimodal import MultimodalItem, canonical_extras, checked_items

FIXTURES = Path(__file__).parent.parent / "fixtures"
C = 16


def test_untagged_extra_keys_read_by_position():
    """The adapter's name first exactly when the event names one; then (identifier, offset) pairs; the salt; the
    prompt-embeds digest. A LoRA name is never a multimodal identifier (it was: the issue 38 bug)."""
    assert read_extra_keys(["adapter-x"], "adapter-x") is None
    assert read_extra_keys(["adapter-x", ["img", 5], "tenant-a", b"\x01\x02"], "adapter-x") == \
        BlockExtras(("img", "0102"), "tenant-a")
    assert read_extra_keys([["img", -27]], None) == BlockExtras(("img",))
    assert read_extra_keys(["tenant-a"], None) == BlockExtras((), "tenant-a")
    assert read_extra_keys(["adapter-x", "tenant-a"], "adapter-x") == BlockExtras((), "tenant-a")
    # a salt equal to the adapter's name is still the salt: position decides, not the value
    assert read_extra_keys(["x", "x"], "x") == BlockExtras((), "x")
    assert read_extra_keys([[b"\xab\xcd", 0]], None) == BlockExtras(("abcd",))
    # an adapter's event whose extra keys do not name it (another publisher): its lone string is the salt
    assert read_extra_keys(["tenant-a"], "adapter-x") == BlockExtras((), "tenant-a")
    assert read_extra_keys(None, None) is None and read_extra_keys([], "a") is None


def test_tagged_extra_keys_read_the_same():
    """vllm PR #44706 would publish the tuples the block hash uses, tags kept."""
    tagged = [["lora", "adapter-x", "/adapters/x"], ["mm", "img", 5], ["cache_salt", "tenant-a"],
              ["prompt_embeds", b"\x01\x02"]]
    assert read_extra_keys(tagged, "adapter-x") == BlockExtras(("img", "0102"), "tenant-a")
    assert read_extra_keys([["lora", "adapter-x", "/adapters/x"]], "adapter-x") is None
    assert read_extra_keys([["mm", "img", -3]], None) == BlockExtras(("img",))


def test_an_entry_of_no_known_shape_keys_the_block_apart():
    """Neither form: the block gets keys no request computes (a miss, never a hit on another prompt's blocks)."""
    got = read_extra_keys([{"what": 1}], None)
    assert got is not None and got.ids and got.salt is None


def messages(name: str) -> tuple[dict, list[dict]]:
    lines = (FIXTURES / name).read_text().splitlines()
    return json.loads(lines[0])["header"], [json.loads(line) for line in lines[1:]]


def planned_keys(msgs: list[dict], pod: str) -> dict[str, list[int]]:
    """Each case's message planned in order (one chain state per pod, as one ingester): its stored keys."""
    state = ChainState()
    out = {}
    for m in msgs:
        frames = [m["topic"].encode(), m["seq"].to_bytes(8, "big"), base64.b64decode(m["payload_b64"])]
        decoded = VLLM.decode_frames(frames)
        assert not decoded.errors, decoded.errors
        if decoded.topic.pod_id != pod:
            continue
        plan = plan_batch(decoded.batch, pod_id=pod, topic_model=decoded.topic.model, state=state, hash_seed="",
                          block_size=C, entry_field=lambda *a: "f", extra_keys=VLLM.extra_keys)
        assert plan.orphans == 0
        out[m.get("case", m["seq"])] = [k for mut in plan.mutations for k in mut.request_keys]
    return out


def expected_keys(case: dict) -> list[int]:
    """What the predictor computes for the case's prompt (keys/chain.py, keys/multimodal.py), for the canonical
    blocks the event covers: those inside its full engine blocks after the shared prefix."""
    tokens, e = case["tokens"], case["engine_block"]
    items = checked_items([MultimodalItem(**i) for i in case["items"]], len(tokens))
    keys = prompt_request_keys(tokens, model=case["adapter"] or case["model"], block_size=C,
                               cache_salt=case["cache_salt"],
                               extra_per_block=canonical_extras(items, len(tokens), C, e))
    full = len(tokens) // e * e
    return keys[case["shared_engine_blocks"] * e // C: full // C]


@pytest.mark.parametrize("case", messages("vllm-0.32-extra-keys-frames.jsonl")[0]["cases"], ids=lambda c: c["name"])
def test_frames_from_vllm_code_keyed_as_the_predictor_keys_the_prompt(case):
    """Images starting, ending and sitting inside engine blocks of 8, 16, 24, 32 and 48 tokens, a LoRA adapter
    with an image and a salt, untagged and tagged: the ingester's keys are the predictor's."""
    header, msgs = messages("vllm-0.32-extra-keys-frames.jsonl")
    got = planned_keys(msgs, case["pod"])[case["name"]]
    assert got == expected_keys(case)


def test_the_same_prompt_keyed_without_its_items_or_with_another_image_differs_from_the_first_image_on():
    header, msgs = messages("vllm-0.32-extra-keys-frames.jsonl")
    case = next(c for c in header["cases"] if c["name"] == "mm-e32")
    ingested = planned_keys(msgs, "mm-e32")["mm-e32"]
    text_only = request_keys(case["tokens"], model="vis")
    assert ingested[0] != text_only[0]  # img-a starts at token 5: block 0 is tainted
    other = dict(case, items=[dict(i, identifier="img-b2") if i["identifier"] == "img-b" else i
                              for i in case["items"]])
    theirs = expected_keys(other)
    assert theirs[:4] == ingested[:4] and theirs[4] != ingested[4]  # img-b starts at token 64: canonical block 4


def test_live_lora_frames_keyed_under_their_adapter():
    """A real vLLM 0.32 with two adapters: every adapter block keyed as llm-d keys it (the adapter's name as the
    model, nothing else), the salted one with its salt on the first block only."""
    header, msgs = messages("vllm-0.32-lora-live-frames.jsonl")
    tokens = list(range(1000, 1064))  # the two full engine blocks of 1000..1069
    got = planned_keys(msgs, "lora-0")
    assert got[0] == request_keys(tokens, model="tiny")
    assert got[1] == request_keys(tokens, model="a")
    assert got[2] == request_keys(tokens, model="b")
    assert got[3] == salted_request_keys(tokens, model="a", cache_salt="s1")


def test_adapter_of_names_what_a_request_names():
    ev = BlockStored([1], None, list(range(16)), 16, lora_id=3, lora_name=None)
    assert adapter_of(ev) is None and model_for(ev, "m") == "m:lora_id=3"
    assert adapter_of(ev, {"3": "sql"}) == "sql" == model_for(ev, "m", {"3": "sql"})
    assert adapter_of(BlockStored([1], None, list(range(16)), 16, lora_id=1, lora_name="a")) == "a"
    assert adapter_of(BlockStored([1], None, list(range(16)), 16)) is None


def test_a_batch_lists_the_adapters_it_stores():
    events = [BlockStored([1], None, list(range(16)), 16, lora_id=1, lora_name="a", extra_keys=[["a"]]),
              BlockStored([2], None, list(range(16)), 16, extra_keys=[None]),
              BlockStored([3], None, list(range(16)), 16, lora_id=7, extra_keys=[None])]
    plan = plan_batch(EventBatch(ts=1.0, events=events), pod_id="p", topic_model="m", state=ChainState(),
                      hash_seed="", block_size=C, entry_field=lambda *a: "f", extra_keys=VLLM.extra_keys)
    assert plan.adapters == {"a"}
    assert make_topic("p", "m") == "kv@p@m"
