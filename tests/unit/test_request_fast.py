"""The token_ids fast path decides exactly as parse_request + request_keys, or steps aside."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.predictor.errors import BadRequest
from kv_preflight.predictor.request import parse_keyed, parse_request
from kv_preflight.keys.chain import request_keys

KW = dict(max_tokens=1000, hash_seed="s", block_size=16)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=100),
       pods=st.one_of(st.none(), st.lists(st.text(max_size=5), max_size=3)), spaced=st.booleans())
def test_fast_path_equals_the_ordinary_path(tokens, pods, spaced):
    doc = {"model": "m", "token_ids": tokens} | ({"pods": pods} if pods is not None else {})
    body = json.dumps(doc, separators=(", ", ": ") if spaced else (",", ":")).encode()
    keyed = parse_keyed(body, **KW)
    req = parse_request(body, max_tokens=KW["max_tokens"])
    assert keyed is not None
    assert keyed.keys == request_keys(req.token_ids, model="m", hash_seed="s", block_size=16)
    assert (keyed.model, keyed.n_tokens, keyed.pods) == (req.model, len(req.token_ids), req.pods)


@pytest.mark.parametrize("body", [
    b'{"model": "m", "token_ids": []}', b'{"model": "m", "token_ids": [1, -1]}', b'{"model": "m", "token_ids": [1.0]}',
    b'{"model": "m", "token_ids": [true]}', b'{"model": "m", "token_ids": [4294967296]}', b'{"model": "m", "token_ids": null}',
    b'{"model": "m", "token_ids": [1], "prompt": "x"}', b'{"model": "", "token_ids": [1]}', b'{"token_ids": [1]}',
    b'{"model": "m", "token_ids": [1], "pods": "p"}', b'{"model": "m", "token_ids": [01]}', b"{not json", b"",
    b'{"model": "m", "token_ids": [%s]}' % b",".join([b"1"] * 1001),
])
def test_anything_unusual_goes_the_ordinary_way(body):
    assert parse_keyed(body, **KW) is None


def test_the_ordinary_way_still_words_the_errors():
    with pytest.raises(BadRequest, match="too many tokens: 1001"):
        parse_request(b'{"model": "m", "token_ids": [%s]}' % b",".join([b"1"] * 1001), max_tokens=1000)
