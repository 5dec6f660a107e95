"""A pod whose engine restarted starts exact, whatever its history of retirement (issue 27, finding 1).

Real processes: a valkey-server, ``kv-preflight simulate`` engines and ``kv-preflight ingest``. The history
is `scripts/up` run three times on one data directory: two engines (no traffic), then one (the other pod
retired: its engine left discovery), then two again, the retired pod's engine a new process on a new port.
"""
from __future__ import annotations

import pytest

from kv_preflight.cli.accuracy import shared_prefix_workload
from kv_preflight.index.index import Index
from kv_preflight.index.transfer import held_blocks
from tests.e2e.harness import spawn, stop
from tests.integration.sim import sim_engine
from tests.integration.test_fault_accuracy import blind
from tests.integration.test_fleet import FAST, FAST_ENV, until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_pod_of_a_new_engine_is_exact_after_retirement(valkey_url, tmp_path):
    a = sim_engine("sim-a", tmp_path).start()
    b = sim_engine("sim-b", tmp_path).start()
    ix = Index.from_url(valkey_url)

    async def state(pod, want):
        rec = (await ix.fleet.fleet_view()).pods.get(pod)
        return rec if rec is not None and rec.state == want else None

    def ingester(n, *engines):
        args = ["ingest", "--valkey-url", valkey_url, *FAST, "--ingester-id", f"run-{n}"]
        for e in engines:
            args += ["--engine", e.url]
        return spawn(args, str(tmp_path / f"ing-{n}.log"), env=FAST_ENV)

    procs = []
    try:
        # 1. both engines, no traffic: records, no seq
        procs.append(ingester(1, a, b))
        await until(lambda: state("sim-b", "live"), "sim-b live")
        stop(procs[-1])
        b.stop()
        # 2. sim-a only: sim-b's engine left discovery, it is retired (entries cleared, flagged)
        procs.append(ingester(2, a))
        rec = await until(lambda: state("sim-b", "retired"), "sim-b retired")
        assert "left discovery" in rec.reason
        stop(procs[-1])
        # 3. sim-b again, a new engine process on a new port: it starts from seq 0 with an empty cache
        b2 = sim_engine("sim-b", tmp_path).start()
        procs.append(ingester(3, a, b2))
        await until(lambda: state("sim-b", "live"), "sim-b live again")
        blind(b2.url, shared_prefix_workload(n=3, seed=5, block=16))

        last = len(b2.published()) - 1  # the engine's own account: every batch it has sent

        async def caught_up():
            info = await ix.meta.pod_info("sim-b")
            return info if info.seqs.get("0") == last and not info.pending_effects else None

        info = await until(caught_up, f"sim-b's batches up to seq {last}")
        assert not info.incomplete, info.incomplete_reason
        # and what the index holds is what the new engine published, nothing of the old one's
        held = len(await held_blocks(ix.writer, "sim-b"))
        assert held == info.blocks > 0
        b2.stop()
    finally:
        for p in procs:
            stop(p)
        a.stop()
        b.stop()
        await ix.close()


async def test_pod_retired_before_its_first_event_is_exact_when_its_engine_returns(valkey_url, tmp_path):
    """The same engine URL, restarted after its pod was retired as unreachable, never having published:
    no seq to reset it by, and it used to stay flagged for good."""
    engine = sim_engine("sim-quiet", tmp_path).start()
    ing = spawn(["ingest", "--valkey-url", valkey_url, "--engine", engine.url, *FAST, "--retire-after", "2"],
                str(tmp_path / "ing.log"), env=FAST_ENV)
    ix = Index.from_url(valkey_url)

    async def state(want):
        rec = (await ix.fleet.fleet_view()).pods.get("sim-quiet")
        return rec if rec is not None and rec.state == want else None

    try:
        await until(lambda: state("live"), "live")
        engine.stop(kill=True)
        await until(lambda: state("retired"), "retired after --retire-after", timeout=30)
        assert (await ix.meta.pod_info("sim-quiet")).incomplete
        engine.start()
        await until(lambda: state("live"), "live again")
        blind(engine.url, shared_prefix_workload(n=2, seed=3, block=16))

        async def indexed():
            return (await ix.meta.pod_info("sim-quiet")).blocks

        await until(indexed, "entries")
        info = await ix.meta.pod_info("sim-quiet")
        assert not info.incomplete, info.incomplete_reason
    finally:
        stop(ing)
        engine.stop()
        await ix.close()
