"""What gateways keep in Valkey beside the index (kv_preflight/index/routed.py), on a real valkey-server and a
real Valkey Cluster: bookings booked, renewed, released, and expired with the gateway that stopped renewing."""
from __future__ import annotations

import pytest

from kv_preflight.index.index import Index
from kv_preflight.index.routed import Booked, RoutedStore
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

PODS = [f"pod-{i}" for i in range(12)]  # on a cluster, their hash tags spread them over the three shards


@pytest.fixture(params=["single", "single, lean connection", "cluster"])
async def store(request, valkey_url):
    url = request.getfixturevalue("cluster_url") if request.param == "cluster" else valkey_url
    index = Index.from_url(url)
    fast = index.backend.fast if request.param == "single, lean connection" else None
    assert fast is not None or request.param != "single, lean connection"
    yield RoutedStore(index.client, fast)
    await index.close()


async def test_bookings_add_up_per_pod_and_leave_when_released(store):
    for i, pod in enumerate(PODS):
        assert await store.book(pod, "g1:1", 100 + i, 60_000) == Booked(1, 100 + i)
        await store.book(pod, "g1:2", 10, 60_000)
        await store.book(pod, "g1:2", 10, 60_000)  # booked again (a retried write): counted once
    booked = await store.booked(PODS + ["nobody"])
    assert booked["nobody"] == Booked(0, 0)
    assert all(booked[p] == Booked(2, 110 + i) for i, p in enumerate(PODS))
    assert await store.release(PODS[0], "g1:1") == Booked(1, 10)
    assert await store.release(PODS[0], "g1:1") == Booked(1, 10)  # released twice: once
    await store.release(PODS[0], "g1:2")
    assert (await store.booked([PODS[0]]))[PODS[0]] == Booked(0, 0)


async def test_bookings_released_together_leave_in_one_call_per_pod(store):
    """A gateway sends the releases of requests that ended together at once: each pod's in one script call."""
    for i, pod in enumerate(PODS):
        for j in range(3):
            await store.book(pod, f"g1:{j}", 10 * (j + 1), 60_000)
    await store.release_many({pod: ["g1:0", "g1:2", "g1:9"] for pod in PODS})  # g1:9: never booked, nothing
    booked = await store.booked(PODS)
    assert all(booked[p] == Booked(1, 20) for p in PODS)
    await store.release_many({PODS[0]: ["g1:1"], PODS[1]: []})
    assert (await store.booked(PODS[:2])) == {PODS[0]: Booked(0, 0), PODS[1]: Booked(1, 20)}


async def test_a_booking_not_renewed_expires_and_a_renewed_one_stays(store):
    pod = PODS[3]
    await store.book(pod, "dead:1", 500, 300)  # its gateway died: nobody renews it
    await store.book(pod, "live:1", 7, 300)
    await store.book(pod, "live:2", 3, 300)

    async def only_the_renewed_left():
        await store.renew({pod: ["live:1", "live:2", "gone:9"]}, 300)
        return (await store.booked([pod]))[pod] == Booked(2, 10)

    await until(only_the_renewed_left, "the unrenewed booking expired, the renewed ones kept")
    await until(lambda: _is(store, pod, Booked(0, 0)), "every booking expired once nobody renews")


async def _is(store, pod, want):
    return (await store.booked([pod]))[pod] == want


def chain(root: int, n: int, shared: list[int] | None = None) -> list[int]:
    """Request keys of a prompt: ``shared`` (another prompt's first keys), then keys of its own."""
    from kv_preflight.keys.chain import request_keys

    tokens = [root] * (16 * n)
    return (shared or []) + request_keys(tokens, model="m")[len(shared or []):n]


async def test_speculative_keys_count_as_the_prefix_they_share_until_their_ttl(store):
    from kv_preflight.index.routed import keys_blob

    a = chain(1, 10)
    b = chain(2, 10, shared=a[:5])
    pod = PODS[5]
    await store.speculate(pod, keys_blob(a), 400)
    got = await store.read([pod, PODS[6]], keys_blob(b))
    assert got[pod].speculative == 5 and got[PODS[6]].speculative == 0
    assert (await store.read([pod], keys_blob(a[:3])))[pod].speculative == 3
    assert (await store.read([pod], keys_blob(a + chain(3, 2))))[pod].speculative == 10
    assert (await store.read([pod], keys_blob(a)))[pod].approximate == 0  # speculative is not approximate
    await until(lambda: _speculative(store, pod, a, 0), "the speculative keys gone with their TTL")


async def _speculative(store, pod, keys, want):
    from kv_preflight.index.routed import keys_blob

    return (await store.read([pod], keys_blob(keys)))[pod].speculative == want


async def test_approximate_keys_are_kept_to_the_capacity_least_recently_used_first_out(store):
    """A chain's tail goes before its head (a prefix of it stays readable), and the chain used least lately first."""
    import asyncio

    from kv_preflight.index.routed import keys_blob

    pod = PODS[7]
    a, b, c = chain(1, 8), chain(2, 8), chain(3, 4)

    async def held(keys):
        return (await store.read([pod], keys_blob(keys)))[pod].approximate

    assert await store.approximate(pod, keys_blob(a), 12, 60_000) == 8
    await asyncio.sleep(0.01)
    assert await store.approximate(pod, keys_blob(b), 12, 60_000) == 12
    assert (await held(a), await held(b)) == (4, 8)  # a, the older, lost its last 4 blocks
    await asyncio.sleep(0.01)
    await store.approximate(pod, keys_blob(a[:4]), 12, 60_000)  # a used again: b is the least recent now
    await asyncio.sleep(0.01)
    await store.approximate(pod, keys_blob(c), 12, 60_000)
    assert (await held(a), await held(b), await held(c)) == (4, 4, 4)
    await store.forget_approximate([pod])
    assert await held(a) == 0


async def test_a_pods_footprint_is_the_blocks_of_the_other_prefixes_homed_there_within_the_window(store):
    from kv_preflight.index.routed import keys_blob

    pod = PODS[8]
    a, b = chain(1, 4), chain(2, 6)
    await store.home(pod, a[0], 10, 60_000)
    await store.home(pod, b[0], 6, 60_000)
    assert await store.home(pod, a[0], 12, 60_000) == 18  # a homed again, longer: counted once, at its new size
    got = await store.read([pod, PODS[9]], keys_blob(b), 60_000)
    assert (got[pod].footprint, got[PODS[9]].footprint) == (12, 0)  # b's own blocks do not crowd it out
    assert (await store.read([pod], keys_blob(chain(3, 2)), 60_000))[pod].footprint == 18
    assert (await store.read([pod], keys_blob(b), 0))[pod].footprint == 0  # no window: no footprints read
    await store.home(pod, b[0], 6, 200)  # a short window: everything older leaves with it

    async def only_recent():
        return (await store.read([pod], keys_blob(a), 200))[pod].footprint == 0

    await until(only_recent, "the prefixes older than the window gone from the footprint")


async def test_the_read_says_how_long_ago_the_prompts_own_prefix_was_homed_on_each_pod(store):
    """What makes a prefix one gateway just placed pending for every gateway (predictor/routed.py ``pending``)."""
    import asyncio

    from kv_preflight.index.routed import keys_blob

    pod, other = PODS[10], PODS[11]
    a, b = chain(1, 4), chain(2, 4)
    await store.home(pod, a[0], 4, 60_000)
    await asyncio.sleep(0.05)
    got = await store.read([pod, other], keys_blob(a), 60_000)
    assert 50 <= got[pod].homed_ms_ago < 10_000 and got[other].homed_ms_ago == -1
    assert (await store.read([pod], keys_blob(b), 60_000))[pod].homed_ms_ago == -1  # another prefix's home
    assert (await store.read([pod], keys_blob(a), 0))[pod].homed_ms_ago == -1  # no window: homes not read


async def test_new_prefixes_claimed_at_once_spread_and_one_prefix_keeps_its_pod(store):
    """Gateways placing new prefixes at the same moment read the same footprints (none of their homes landed yet)
    and would all pick the same pod; claimed, each counts the placements of the last moment too, and a prefix
    claimed again within the TTL keeps the pod it was given, whatever the second claimant's order."""
    import asyncio

    pods = [f"pod-{i}" for i in range(8)]
    order = [(p, 0) for p in pods]  # every pod empty to every claimant: the same first choice for all
    prefixes = [chain(100 + i, 1)[0] for i in range(8)]
    got = await asyncio.gather(*(store.claim(p, 12, order, 60_000, 60_000) for p in prefixes))
    assert sorted(got) == pods  # eight at once: eight pods
    again = await asyncio.gather(*(store.claim(p, 12, order[::-1], 60_000, 60_000) for p in prefixes))
    assert again == got
    # footprints count: beside the last moment's placements (12 blocks on each pod now), a pod read as 20 blocks
    # fuller takes nothing until the others have as much, whatever the claimant's order put first
    full = [("pod-0", 20), *[(p, 0) for p in pods[1:]]]
    more = await asyncio.gather(*(store.claim(chain(200 + i, 1)[0], 12, full, 60_000, 60_000) for i in range(7)))
    assert sorted(more) == pods[1:]
    # once the moment has passed, only the footprints read count
    first = await store.claim(chain(300, 1)[0], 12, [("pod-1", 0), ("pod-2", 5)], 60_000, 0)
    assert first == "pod-1"
    fleeting = chain(999, 1)[0]
    first = await store.claim(fleeting, 12, order, 200, 0)

    async def lapsed_and_taken_anew():
        return await store.claim(fleeting, 12, [(p, 0) for p in pods if p != first], 200, 0) != first
    await until(lapsed_and_taken_anew, "the claim lapsed with its TTL: the prefix placed anew")


async def test_a_read_of_many_pods_sends_the_prompts_keys_once_on_one_node(store, valkey_url):
    """On one node every pod is read in one script call, so the prompt's keys (2 KB for 4K tokens) go once, not once
    per pod (64 pods were 128 KB and over a millisecond a decision); on a cluster one call per pod, as its slots
    need. Either way each pod's answer is its own, in order: a pod's bookings, speculative and approximate keys and
    footprint never read as another's."""
    import redis as sync_redis

    from kv_preflight.index.routed import keys_blob

    a = chain(7, 12)
    for i, pod in enumerate(PODS):
        await store.book(pod, "g1:1", 10 * (i + 1), 60_000)
        if i % 3 == 0:
            await store.speculate(pod, keys_blob(a[: i + 1]), 60_000)
        if i % 4 == 1:
            await store.approximate(pod, keys_blob(a[: i]), 100, 60_000)
    r = sync_redis.Redis.from_url(valkey_url)
    r.config_resetstat()
    got = await store.read(PODS, keys_blob(a))
    calls = int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    r.close()
    for i, pod in enumerate(PODS):
        assert got[pod].booked == Booked(1, 10 * (i + 1)), pod
        assert got[pod].speculative == (i + 1 if i % 3 == 0 else 0), pod
        assert got[pod].approximate == (i if i % 4 == 1 else 0), pod
    if store.fast is not None:
        assert calls == 1, f"{calls} script calls for {len(PODS)} pods on one node"
