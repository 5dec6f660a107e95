"""Shared fixtures: a real valkey-server (and Valkey Cluster) per test session, flushed before each test that
asks for it; and the two phases of scripts/test.

With pytest-xdist every worker is a session of its own, so each has its own servers on its own ports
(cluster nodes from a port range of its own). A test that cannot run beside another carries
``@pytest.mark.serial(reason=...)``; ``--phase parallel`` deselects those, ``--phase serial`` keeps only them
(scripts/test runs the first with ``-n``, the second without). Without ``--phase`` everything runs.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import redis

from kv_preflight.cli.valkey_server import ValkeyServer

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "tests" / "e2e"
FIXTURES = Path(os.environ.get("KVPF_FIXTURES", REPO.parent / "shared" / "fixtures"))
BUNDLED_FIXTURES = REPO / "tests" / "fixtures"


def fixture_path(name: str) -> Path:
    """Fixtures are vendored under tests/fixtures so a clone without ../shared still tests."""
    p = BUNDLED_FIXTURES / name
    return p if p.exists() else FIXTURES / name


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" in os.environ:
        _cluster_ports_of_this_worker()
        _listen_ports_of_this_worker()


def _cluster_port_shares() -> int:
    """cluster_port()'s range is cut in one share per worker and one more, the last, for the clusters that
    ``kv-preflight up --cluster`` starts in a process of its own (``up_cluster_ports``)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) + 1


def _cluster_ports_of_this_worker() -> None:
    """Cluster nodes keep their ports across restarts (the fault tests), so a port another worker's
    ``cluster_port()`` could draw while such a node is down must not be in that worker's range: in this
    process ``ValkeyCluster`` draws from this worker's share of cluster_port's range alone."""
    from kv_preflight.cli import valkey_cluster as vc

    first, last = vc.CLUSTER_PORTS
    span = (last - first) // _cluster_port_shares()
    lo = first + xdist_worker() * span
    vc.cluster_port = functools.partial(vc.cluster_port, lo, lo + span)


def up_cluster_ports() -> tuple[int, int]:
    """[lo, hi): the share of cluster_port()'s range no worker draws from, for a test's ``up --cluster`` (one
    such test at a time: tests/integration/test_up.py has the only one)."""
    from kv_preflight.cli import valkey_cluster as vc

    first, last = vc.CLUSTER_PORTS
    span = (last - first) // _cluster_port_shares()
    return last - span, last


def _listen_ports_of_this_worker() -> None:
    """Two workers drawing free ports from one range could both draw a port before either binds it; each
    draws from its own share instead (test modules import ``free_port`` after this runs)."""
    from kv_preflight.cli import valkey_server as vs

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    first, last = vs.LISTEN_PORTS
    span = (last - first) // max(workers, 1)
    lo = first + xdist_worker() * span
    vs.free_port = functools.partial(vs.free_port, lo, lo + span)
    os.environ["KVPF_LISTEN_PORTS"] = f"{lo}-{lo + span}"  # and the servers an `up` it starts draws for itself


def pytest_addoption(parser):
    parser.addoption("--phase", choices=("parallel", "serial"), default=None,
                     help="parallel: only tests without the serial mark (run them with -n); serial: only those")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.path)).is_relative_to(E2E) and not item.get_closest_marker("serial"):
            # each starts a real vLLM (CPU) or the compose stack: two at once would starve each other
            item.add_marker(pytest.mark.serial(reason="a real vLLM or Docker stack, which takes the machine"))
    phase = config.getoption("--phase")
    if phase is None:
        return
    keep, drop = [], []
    for item in items:
        (keep if (item.get_closest_marker("serial") is not None) == (phase == "serial") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if phase == "serial":
        items.sort(key=_serial_order)


def _serial_order(item) -> int:
    """The serial phase's order: first the tests that are serial for their timing (they mostly wait, and the
    real vLLMs tests/e2e/conftest.py starts beside them, at a lower CPU priority, take what they leave), then the
    compose stacks, then the modules that use the real vLLMs (by then started). A stable sort: file order within."""
    if not Path(str(item.path)).is_relative_to(E2E):
        return 0
    return 2 if getattr(getattr(item, "module", None), "VLLM_ENGINES", ()) else 1


def xdist_worker() -> int:
    """This process's pytest-xdist worker number (gw3: 3), 0 outside xdist."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)


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
