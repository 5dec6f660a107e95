"""API keys: parsing the key file, and the constant-time check in the ASGI middleware."""
from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kv_preflight.predictor.http.auth import ApiKeyAuth, load_api_keys

pytestmark = pytest.mark.anyio


def test_load_api_keys(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops team\nkey-one\n\n  key-two  \n")
    assert load_api_keys(str(f), ["env-key", " "]) == ["env-key", "key-one", "key-two"]
    assert load_api_keys("", []) == []
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no key"):
        load_api_keys(str(empty))
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"))


def test_allowed_compares_every_key():
    auth = ApiKeyAuth(lambda *a: None, ["alpha", "beta"])
    assert auth.allowed(b"Bearer alpha") and auth.allowed(b"bearer beta") and auth.allowed(b"Bearer  beta ")
    for bad in (None, b"", b"alpha", b"Bearer ", b"Bearer alph", b"Bearer alphaX", b"Basic YWxwaGE="):
        assert not auth.allowed(bad)
    with pytest.raises(ValueError):
        ApiKeyAuth(lambda *a: None, [])


async def test_middleware_guards_all_but_health():
    rejected = []
    inner = Starlette(routes=[Route("/health", lambda r: PlainTextResponse("ok")),
                              Route("/x", lambda r: PlainTextResponse("x"))])
    app = ApiKeyAuth(inner, ["k"], on_reject=lambda: rejected.append(1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 200
        r = await c.get("/x")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json() == {"error": "missing or invalid API key: send Authorization: Bearer <key>"}
        assert (await c.get("/x", headers={"authorization": "Bearer k"})).text == "x"
        assert (await c.get("/x", headers={"authorization": "Bearer wrong"})).status_code == 401
    assert len(rejected) == 2
