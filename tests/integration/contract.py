"""What the contract suites share (tests/integration/test_contract_*.py): an Index on each topology, the
backend chosen at connect as a process gets it, and a check that an implementation has every member of the
Protocol it stands behind, with the same parameters (no type checker runs in CI: this is the bar a third
backend meets)."""
from __future__ import annotations

import inspect

import pytest

from kv_preflight.index.entries import CHAIN_ROOT, StoreBlock, encode_entry, make_entry
from kv_preflight.index.index import Index

TOPOLOGIES = ["single", "cluster"]


@pytest.fixture(params=TOPOLOGIES)
async def index(request):
    """A fresh Index on a flushed single node, or on a flushed 3-master Valkey Cluster."""
    url = request.getfixturevalue("valkey_url" if request.param == "single" else "cluster_url")
    ix = Index.from_url(url, timeout_s=5.0, cluster=request.param == "cluster")
    yield ix
    await ix.close()


def conforms(impl: object, protocol: type) -> list[str]:
    """Members of ``protocol`` that ``impl`` lacks, or whose parameters differ (names and kinds, in order)."""
    wrong = []
    members = [n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")]
    for name in members + [n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_")]:
        if not hasattr(impl, name):
            wrong.append(f"{name}: missing")
            continue
        if name in members:
            want = [(p.name, p.kind) for p in inspect.signature(getattr(protocol, name)).parameters.values()][1:]
            got = [(p.name, p.kind) for p in inspect.signature(getattr(impl, name)).parameters.values()]
            if got != want:
                wrong.append(f"{name}: {got} != {want}")
    return wrong


def chain(pod: str, engine_keys: range, request_key_base: int = 1000, tier: str = "gpu") -> list[StoreBlock]:
    """Stores of one chain: engine key k holds request key ``request_key_base + k``, each chained from the one
    before (engine key 1 from the chain's root: a range starting later leaves a gap before it)."""
    field = encode_entry(make_entry(pod, tier.upper(), 0))
    return [StoreBlock(k, tier, field, (request_key_base + k,),
                       parent=CHAIN_ROOT if k == 1 else request_key_base + k - 1)
            for k in engine_keys]


def request_keys(engine_keys: range, request_key_base: int = 1000) -> list[int]:
    return [request_key_base + k for k in engine_keys]


async def apply(index, pod: str, seq: int, mutations, *, model: str = "m", mode: str = "check"):
    return await index.apply_batch(pod_id=pod, rank=0, seq=seq, ts=1.0, model=model, engine_block_size=16,
                                   mutations=mutations, mode=mode)


__all__ = ["TOPOLOGIES", "apply", "chain", "conforms", "index", "request_keys"]
