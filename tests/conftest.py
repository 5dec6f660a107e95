"""Shared fixtures: a real valkey-server per test session, flushed before each test that asks for it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis

from cli.valkey_server import ValkeyServer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("KVPF_FIXTURES", REPO.parent / "shared" / "fixtures"))
BUNDLED_FIXTURES = REPO / "tests" / "fixtures"


def fixture_path(name: str) -> Path:
    """Fixtures are vendored under tests/fixtures so a clone without ../shared still tests."""
    p = BUNDLED_FIXTURES / name
    return p if p.exists() else FIXTURES / name


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory):
    server = ValkeyServer(tmp_path_factory.mktemp("valkey")).start()
    yield server
    server.stop()


@pytest.fixture
def valkey_url(valkey_server):
    if valkey_server.proc is None or valkey_server.proc.poll() is not None:
        valkey_server.start()
    r = redis.Redis.from_url(valkey_server.url)
    r.flushall()
    r.close()
    return valkey_server.url


@pytest.fixture
async def ix(valkey_url):
    """An Index on the flushed test Valkey."""
    from shared.index import Index

    index = Index.from_url(valkey_url)
    yield index
    await index.close()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def load_jsonl(name: str) -> list[dict]:
    with open(fixture_path(name)) as f:
        return [json.loads(line) for line in f if line.strip()]
