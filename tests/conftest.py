"""Shared fixtures: a real valkey-server per test session, flushed before each test that asks for it."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import redis

from kv_preflight.cli.valkey_server import ValkeyServer

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
    from kv_preflight.index.index import Index

    index = Index.from_url(valkey_url)
    yield index
    await index.close()


@pytest.fixture
def anyio_backend():
    return "asyncio"


def load_jsonl(name: str) -> list[dict]:
    with open(fixture_path(name)) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory):
    """A real local Valkey Cluster: 3 masters + 3 replicas on loopback, 2 s node timeout."""
    from kv_preflight.cli.valkey_cluster import ValkeyCluster

    cluster = ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster"), debug_command=True).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(valkey_cluster):
    """The cluster's URL, every primary flushed (and every node back up, after a fault test)."""
    for node in valkey_cluster.nodes:
        if node.proc is None or node.proc.poll() is not None:
            node.start()
    valkey_cluster.wait_ok()
    for node in valkey_cluster.masters_now():
        r = redis.Redis(port=node.port)
        r.flushall()
        r.close()
    return valkey_cluster.url
