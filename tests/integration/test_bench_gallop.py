"""The benchmark's galloping lookup (kv_preflight/cli/bench/gallop.py) answers as the exact walk where every
pod's blocks form a prefix of the chain, which is all it claims."""
from __future__ import annotations

import pytest

from kv_preflight.cli.bench.gallop import gallop
from tests.integration.contract import apply, chain, request_keys

pytestmark = [pytest.mark.integration, pytest.mark.anyio]


async def test_gallop_equals_the_linear_walk_on_prefixes(ix):
    for n, pod in enumerate(["pod-a", "pod-b", "pod-c"]):
        await apply(ix, pod, 0, chain(pod, range(1, 2 + 7 * n)))
    keys = request_keys(range(1, 30))
    for head in (keys, keys[:5], keys[:1]):
        for pods in (None, ["pod-b"]):
            want = sorted((m.pod_id, m.blocks, m.tier) for m in await ix.lookup(head, pods, mode="linear"))
            assert sorted((m.pod_id, m.blocks, m.tier) for m in await gallop(ix.client, head, pods)) == want
    assert sorted(m.blocks for m in await gallop(ix.client, keys)) == [1, 8, 15]
    assert await gallop(ix.client, []) == []
