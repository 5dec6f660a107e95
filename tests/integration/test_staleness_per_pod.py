"""One engine down does not age the others, with real processes: a valkey-server, ``kv-preflight serve``, two
``kv-preflight simulate`` engines and one ``kv-preflight ingest --engine A --engine B``. Engine B is killed
(kill -9): its pod's stream goes down and its ingester lists it ``behind`` (then its record says unreachable),
while pod A's answers stay ``current`` with a staleness of about a renewal. Before, the lease's ``current_ms``
stood still while any pod was behind, so A's staleness rose with the clock (a newcomer saw 49 s on ``up``'s
stack, ``exact`` and ``current``)."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop, wait_http
from tests.integration.sim import sim_engine
from tests.integration.test_fleet import FAST, FAST_ENV

pytestmark = [pytest.mark.integration]


def test_a_dead_engine_leaves_the_other_pods_staleness_a_renewals(valkey_url, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    a, b = sim_engine("sim-ok", tmp_path).start(), sim_engine("sim-dead", tmp_path).start()
    procs = [spawn(["serve", "--valkey-url", valkey_url, "--port", str(port)], str(tmp_path / "pred.log")),
             spawn(["ingest", "--valkey-url", valkey_url, "--engine", a.url, "--engine", b.url, *FAST],
                   str(tmp_path / "ing.log"), env=FAST_ENV)]
    body = {"model": "sim", "token_ids": list(range(100, 180)), "pods": ["sim-ok", "sim-dead"]}

    def pods() -> dict:
        r = httpx.post(base + "/v1/cache/predict", json=body, timeout=5)
        return r.json()["freshness"]["pods"] if r.status_code == 200 else {}

    def until(check, what: str, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            got = pods()
            if check(got):
                return got
            assert time.monotonic() < deadline, f"{what}: {got}"
            time.sleep(0.1)

    try:
        wait_http(base + "/health")
        a.complete(body["token_ids"])
        b.complete(body["token_ids"])
        until(lambda p: all(p.get(x, {}).get("state") == "current" for x in ("sim-ok", "sim-dead")), "both current")
        b.stop(kill=True)
        down_at = time.monotonic()
        until(lambda p: p.get("sim-dead", {}).get("state") not in (None, "current"), "sim-dead no longer current")
        time.sleep(max(0.0, 8 - (time.monotonic() - down_at)))
        got = until(lambda p: p.get("sim-ok", {}).get("state") == "current", "sim-ok current")
        elapsed_ms = (time.monotonic() - down_at) * 1000
        # about a renewal (1 s) and a read of the records (1 s); before, the whole time since B went down
        assert got["sim-ok"]["staleness_ms"] < elapsed_ms / 2, (got, elapsed_ms)
        assert got["sim-dead"]["state"] in ("behind", "unreachable"), got
        dead = got["sim-dead"].get("staleness_ms")
        assert dead is None or dead >= elapsed_ms / 2, (got, elapsed_ms)  # the dead pod's own staleness grows
    finally:
        for p in procs:
            stop(p)
        a.stop()
        b.stop()


@pytest.mark.anyio
async def test_both_copies_of_a_pod_say_its_newest_batch(valkey_url, tmp_path):
    """Two ingesters ingesting one engine (``--copies 2``): a batch is applied once, by whichever comes first, and
    the other's is a duplicate; both leases give the pod's newest batch time, so ``index ingesters`` shows one lag
    (a newcomer saw 2.3 s for one copy and 32.5 s for the other)."""
    from kv_preflight.index.index import Index

    engine = sim_engine("sim-2c", tmp_path).start()
    args = ["ingest", "--valkey-url", valkey_url, "--engine", engine.url, "--copies", "2", *FAST]
    procs = [spawn([*args, "--ingester-id", f"copy-{i}"], str(tmp_path / f"ing{i}.log"), env=FAST_ENV)
             for i in range(2)]
    ix = Index.from_url(valkey_url)
    try:
        deadline = time.monotonic() + 30
        while True:  # both copies subscribed (their leases list the pod once its engine is attached)
            leases = (await ix.fleet.fleet_view()).ingesters
            if all("sim-2c" in lease.pods for lease in leases.values()) and len(leases) == 2:
                break
            assert time.monotonic() < deadline, leases
            await asyncio.sleep(0.2)
        for n in range(6):  # batches after both copies subscribed: each applied by one, a duplicate for the other
            engine.complete(list(range(200 + 100 * n, 280 + 100 * n)))
            time.sleep(0.3)
        newest = engine.published()[-1].ts
        deadline = time.monotonic() + 30
        while True:
            leases = (await ix.fleet.fleet_view()).ingesters
            got = {i: lease.batch_ts.get("sim-2c") for i, lease in leases.items()}
            if set(got) == {"copy-0", "copy-1"} and all(ts == newest for ts in got.values()):
                break
            assert time.monotonic() < deadline, (got, newest)
            await asyncio.sleep(0.2)
    finally:
        await ix.close()
        for p in procs:
            stop(p)
        engine.stop()
