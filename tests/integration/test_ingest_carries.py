"""A pod whose engine blocks end mid request key (E=24 or E=8 beside request blocks of 16: SGLang pages,
vLLM's --block-size 24) keeps what they left unkeyed in its state log, so an ingester killed with SIGKILL between
a parent and its child leaves the next one able to key the child: the pod stays exact, not flagged. Real
processes: a valkey-server (or a Valkey Cluster), ``kv-preflight simulate`` and ``kv-preflight ingest``."""
from __future__ import annotations

import asyncio
import signal
import time

import pytest

from kv_preflight.cli.valkey_server import free_port
from kv_preflight.index.index import Index
from kv_preflight.index.transfer import export_blocks
from tests.e2e.harness import spawn, stop
from tests.integration.ingest_campaign import engine_truth, reference_keys
from tests.integration.sim import SimEngine

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def caught_up(ix: Index, engine: SimEngine, timeout_s: float = 30.0) -> list:
    """The engine's batches, once the index's seq of its pod is the engine's last."""
    deadline = time.monotonic() + timeout_s
    while True:
        published = engine.published()
        info = await ix.meta.pod_info(engine.pod)
        seq = int(info.seqs.get("0", info.seqs.get(0, -1))) if info.seqs else -1
        if published and seq == len(published) - 1:
            return published
        assert time.monotonic() < deadline, f"index seq {seq}, engine's {len(published) - 1}"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("topology", ["single", "cluster"])
@pytest.mark.parametrize("block_size", [24, 8])
async def test_a_child_of_a_block_ending_mid_key_is_keyed_after_its_ingester_was_killed(request, tmp_path, topology,
                                                                                      block_size):
    url = request.getfixturevalue("valkey_url" if topology == "single" else "cluster_url")
    pod = f"carry-{block_size}"
    engine = SimEngine(pod, f"http://127.0.0.1:{free_port()}", free_port(), free_port(), log=str(tmp_path / "sim.log"),
                       blocks=64, block_size=block_size).start()
    ix = Index.from_url(url, timeout_s=5.0, cluster=topology == "cluster")

    def ingester(n: int):
        return spawn(["ingest", "--valkey-url", url, "--engine", engine.url, "--private", "--block-size", "16"],
                     str(tmp_path / f"ing-{n}.log"), env={"KVPF_DISCOVERY_INTERVAL_S": "0.5"})

    ing = ingester(1)
    try:
        prompt = list(range(1000, 1000 + 3 * block_size + 5))  # three full blocks: 72 or 24 tokens, each mid key
        engine.complete(prompt)
        await caught_up(ix, engine)
        ing.send_signal(signal.SIGKILL)  # between the parent, applied, and its child: the carries were only in it
        ing.wait()
        ing = ingester(2)
        engine.complete(prompt + list(range(5000, 5000 + 2 * block_size)))  # its child blocks
        published = await caught_up(ix, engine)
        info = await ix.meta.pod_info(pod)
        assert not info.incomplete, info.incomplete_reason
        ix.writer.forget(pod)
        held = {(s.engine_key, s.tier, s.group): tuple(s.request_keys) async for s in export_blocks(ix.writer, pod)}
        assert set(held) == engine_truth(published)
        ref = reference_keys(published, "sim")
        assert {k: rks for k, rks in held.items()} == {k: ref[k[0]] for k in held}
        stored = [ev for b in published for ev in b.events if type(ev).__name__ == "BlockStored"]
        assert len(stored) >= 2 and stored[-1].parent_block_hash == stored[0].block_hashes[-1]  # a child of it
        assert sum(len(rks) for rks in held.values()) == (len(prompt) - 5 + 2 * block_size) // 16
    finally:
        stop(ing, kill=True)
        engine.stop(kill=True)
        await ix.close()
