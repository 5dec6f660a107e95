"""What gateways keep in Valkey beside the index (kv_preflight/index/routed.py), on a real valkey-server and a
real Valkey Cluster: bookings booked, renewed, released, and expired with the gateway that stopped renewing."""
from __future__ import annotations

import pytest

from kv_preflight.index.index import Index
from kv_preflight.index.routed import Booked, RoutedStore
from tests.integration.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

PODS = [f"pod-{i}" for i in range(12)]  # on a cluster, their hash tags spread them over the three shards


@pytest.fixture(params=["single", "cluster"])
async def store(request, valkey_url):
    url = valkey_url if request.param == "single" else request.getfixturevalue("cluster_url")
    index = Index.from_url(url)
    yield RoutedStore(index.client)
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
