"""A token list read where it lies in the body (C ``member_span``, ``request.without_list``), the rest decoded with
``[]`` in its place: the gateway's prompt and a predict or route body's token_ids must read every body exactly as
decoding the whole does, the same answer or the same error."""
from __future__ import annotations

import json
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.predictor import request
from kv_preflight.predictor.gateway import openai
from kv_preflight.predictor.errors import BadRequest

pytestmark = pytest.mark.skipif(request._member_span is None, reason="the C routines are not built")

ARGS = dict(chat=False, max_tokens=64, hash_seed="", block_size=4, hash_algo="fnv64a")

_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=6),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=8)
_prompt = (st.lists(st.integers(0, 2**32 + 2), max_size=70) | st.lists(st.integers(-3, 40), max_size=6)
           | st.text(max_size=5) | _json)
_members = st.dictionaries(
    st.sampled_from(["model", "prompt", "max_tokens", "max_completion_tokens", "stream", "cache_salt", "temperature",
                     "messages", "x", "pro\\u006dpt"]),
    st.one_of(_prompt, st.sampled_from(["m", "m\\n", ""]), st.integers(-2, 9), st.booleans(), st.none(), _json),
    max_size=6)


def _read(body: bytes, c: bool):
    saved = request._member_span
    if not c:
        request._member_span = None
    try:
        got = openai.read_routable(body, **ARGS)
        r = got.request
        return ("ok", type(r).__name__, r.model, getattr(r, "keys", None), getattr(r, "n_tokens", None),
                getattr(r, "token_ids", None), getattr(r, "prompt", None), r.head if hasattr(r, "head") else None,
                got.stream, got.max_tokens)
    except BadRequest as exc:
        return ("error", exc.message)
    finally:
        request._member_span = saved


def _assemble(members: list[tuple[str, object]], spaces: str) -> bytes:
    """Members in the order given, duplicates kept, names as written (an escape stays an escape)."""
    parts = [f'"{k}"{spaces}:{spaces}{json.dumps(v)}' for k, v in members]
    return ("{" + spaces + ("," + spaces).join(parts) + spaces + "}").encode()


def _shuffled(shape: dict, order, again: str | None, other: list[int], listed: str, spaces: str) -> bytes:
    """``shape``'s members in ``order``'s order, and ``again`` once more at the end (the token list ``listed`` as
    ``other``, anything else as "n"): a body as a client may write it, duplicates and all."""
    items = list(shape.items())
    order.shuffle(items)
    if again is not None:
        items.append((again, other if again == listed else "n"))
    return _assemble(items, spaces)


@settings(max_examples=600, deadline=None)
@given(members=_members, extra=st.lists(st.tuples(st.sampled_from(["prompt", "model"]), _prompt), max_size=2),
       spaces=st.sampled_from(["", " ", "\n\t "]), cut=st.integers(0, 400), junk=st.sampled_from(["", "]", "}", ",", '"', "[", "x"]))
def test_a_body_read_in_place_reads_as_the_whole_body_decoded(members, extra, spaces, cut, junk):
    items = list(members.items()) + extra
    body = _assemble(items, spaces)
    assert _read(body, True) == _read(body, False)
    broken = body[:cut] + junk.encode() + body[cut:]  # mostly invalid JSON now: the same error either way
    assert _read(broken, True) == _read(broken, False)


_ids = st.lists(st.integers(0, 40), min_size=1, max_size=12)
_shapes = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "m\\n", "é"]), "prompt": _ids | st.lists(_ids, min_size=1, max_size=2)},
    optional={"cache_salt": st.text(max_size=3) | st.none(), "stream": st.booleans() | st.none() | st.integers(0, 1),
              "max_tokens": st.integers(-1, 5) | st.none(), "max_completion_tokens": st.integers(0, 5) | st.none(),
              "messages": st.just([]), "x": _json})


@settings(max_examples=400, deadline=None)
@given(shape=_shapes, order=st.randoms(use_true_random=False), again=st.sampled_from([None, "prompt", "model"]),
       other=_ids, spaces=st.sampled_from(["", " ", "\n"]))
def test_bodies_of_every_routing_field_read_in_place_read_as_decoded_whole(shape, order, again, other, spaces):
    """Bodies shaped as clients send them (the fields routing reads, in any order, some twice): each field's
    meaning, a salt above all (its prompt is keyed another way), the same either way."""
    body = _shuffled(shape, order, again, other, "prompt", spaces)
    assert _read(body, True) == _read(body, False)


def test_a_token_prompt_is_read_in_place_and_only_then():
    body = msgspec.json.encode({"model": "m", "prompt": list(range(9)), "max_tokens": 3, "stream": True})
    calls = []
    saved = openai._decoder

    class Spy:
        def decode(self, doc):
            calls.append(len(doc))
            return saved.decode(doc)

    openai._decoder = Spy()
    try:
        got = openai.read_routable(body, **ARGS)
        assert got.request.keys and got.request.n_tokens == 9 and got.stream and got.max_tokens == 3
        assert calls == [len(body) - len(json.dumps(list(range(9)), separators=(",", ":"))) + 2]  # the prompt not in it
        calls.clear()
        openai.read_routable(msgspec.json.encode({"model": "m", "prompt": "text"}), **ARGS)
        assert len(calls) == 1 and calls[0] > 20  # a text prompt: decoded whole
    finally:
        openai._decoder = saved


def test_random_bodies_of_a_large_prompt_agree():
    rng = random.Random(5)
    for _ in range(50):
        p = [rng.randrange(0, 30000) for _ in range(rng.randrange(0, 60))]
        body = json.dumps({"prompt": p, "model": "m", "max_tokens": rng.choice([None, 1, 5])},
                          indent=rng.choice([None, 1])).encode()
        assert _read(body, True) == _read(body, False)


def _keyed(body: bytes, c: bool):
    saved = request._member_span
    if not c:
        request._member_span = None
    try:
        got = request.parse_keyed(body, max_tokens=64, hash_seed="", block_size=4, max_pods=3)
        return None if got is None else ("ok", got.model, got.keys, got.n_tokens, got.pods, got.head,
                                         got.max_staleness_ms)
    except BadRequest as exc:
        return ("error", exc.message)
    finally:
        request._member_span = saved


_predict_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "m\\n", ""]), "token_ids": _ids | st.lists(_ids, max_size=2) | _json},
    optional={"pods": st.lists(st.sampled_from(["a", "b", "c@dp1"]), max_size=4) | st.none(),
              "max_staleness_ms": st.integers(-1, 9) | st.none(), "prompt": st.just("x") | st.none(),
              "cache_salt": st.just("s"), "mm_items": st.just([]), "unknown": st.just(1)})


@settings(max_examples=400, deadline=None)
@given(shape=_predict_bodies, order=st.randoms(use_true_random=False), again=st.sampled_from([None, "token_ids", "model"]),
       other=_ids, spaces=st.sampled_from(["", " ", "\n"]), cut=st.integers(0, 300),
       junk=st.sampled_from(["", "]", "}", ",", '"', "["]))
def test_a_predict_body_read_in_place_reads_as_decoded_whole(shape, order, again, other, spaces, cut, junk):
    """/v1/cache/predict and /route's fast path (``parse_keyed``): the same KeyedRequest, None (the ordinary way
    decides) or refusal with the token list read in place as with the whole body decoded."""
    body = _shuffled(shape, order, again, other, "token_ids", spaces)
    assert _keyed(body, True) == _keyed(body, False)
    broken = body[:cut] + junk.encode() + body[cut:]
    assert _keyed(broken, True) == _keyed(broken, False)
