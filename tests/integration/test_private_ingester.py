"""A one-off ingester (issue 27, finding 8), with real processes: a valkey-server, simulated engines, a fleet
ingester, then ``kv-preflight ingest --engine X`` beside it. Joining the fleet, it says so at start and names
each engine it ingests with where it learnt of it; ``--private`` ingests only its own engine, outside the
fleet (its lease, marked private, says only how fresh its pods are: the fleet neither gives it engines nor
loses any to it)."""
from __future__ import annotations

import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from tests.e2e.harness import spawn, stop, wait_log
from tests.integration.sim import sim_engine
from tests.integration.test_fleet import FAST, FAST_ENV, owners, until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_one_off_ingester_says_what_it_joined_and_private_stays_out(valkey_url, tmp_path):
    a = sim_engine("sim-pa", tmp_path).start()
    b = sim_engine("sim-pb", tmp_path).start()
    ix = Index.from_url(valkey_url)
    fleet = spawn(["ingest", "--valkey-url", valkey_url, "--engine", a.url, "--engine", b.url, *FAST,
                   "--ingester-id", "fleet-1"], str(tmp_path / "fleet.log"), env=FAST_ENV)
    procs = [fleet]
    try:
        async def both_ingested():  # by the fleet: a private ingester's lease says what it ingests, outside it
            o = {url: [i for i in ingesters if i != "private-1"] for url, ingesters in (await owners(ix)).items()}
            return o.get(a.url) == ["fleet-1"] and o.get(b.url) == ["fleet-1"]

        await until(both_ingested, "fleet-1 ingesting both engines")
        mistyped = f"http://127.0.0.1:{free_port()}"
        log = str(tmp_path / "oneoff.log")
        oneoff = spawn(["ingest", "--valkey-url", valkey_url, "--engine", mistyped, *FAST, "--ingester-id", "oneoff"],
                       log, env=FAST_ENV)
        procs.append(oneoff)
        text = wait_log(log, "joining the fleet of ingesters", oneoff)
        assert f"given --engine {mistyped}" in text and "--private" in text
        text = wait_log(log, "ingested here", oneoff)
        text = wait_log(log, "from ingester fleet-1's list", oneoff)  # what it took, and from whom
        stop(oneoff)

        log = str(tmp_path / "private.log")
        private = spawn(["ingest", "--valkey-url", valkey_url, "--engine", a.url, "--private", *FAST,
                         "--ingester-id", "private-1"], log, env=FAST_ENV)
        procs.append(private)
        wait_log(log, "private ingester", private)
        wait_log(log, f"engine {a.url}: ingesting pod(s) ['sim-pa']", private)
        async def vouching():
            lease = (await ix.fleet.fleet_view()).ingesters.get("private-1")
            return lease is not None and "sim-pa" in lease.pods and lease

        # its lease vouches for its pods' freshness (issue 40: a pod no lease covers degrades the answers that use
        # it), marked private: invisible to the fleet's sharing
        assert (await until(vouching, "the private ingester's lease listing its pod")).private
        assert await both_ingested()  # the fleet kept both engines
        assert "sim-pb" not in open(log).read()  # and gave it nothing
    finally:
        for p in procs:
            stop(p)
        a.stop()
        b.stop()
        await ix.close()
