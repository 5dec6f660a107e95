"""The Valkey commands of what routing knows from the requests it sent (docs/gateway.md): gateways write these
keys, and every gateway reads them beside its lookup. The ingester never touches them, and they never touch
llm-d's keys or the presence bits (the index's write path is the ingester's alone).

Per pod, in the pod's slot (``{<pod>}``: each script runs on one shard of a Valkey Cluster as on one node):

* **bookings** (``lua/booked.lua``): the requests in flight there and their cost in tokens. A gateway books a
  request when it forwards it, renews its bookings while they run, releases each when it ends; a gateway that
  dies leaves bookings that expire after their TTL. Every operation drops the expired ones first, so the
  totals ``(n, tokens)`` are those of live bookings.
* **speculative keys** (``lua/routed_chain.lua``): a routed prompt's request keys, live for a short TTL, so the
  blocks it is about to cache count on its pod before the engine's events say so.
* **approximate keys** (the same script): for an engine that publishes no events, every prompt routed there, kept
  to its KV capacity, least recently used first out: what it probably holds.
* **homes** (``lua/homes.lua``): the prefixes routed there within the placement window and their blocks, the
  pod's footprint: what a new prefix is placed by (predictor/scoring/placement.py keeps the same per process;
  this is every gateway's, so N gateways agree where the room is).

Fleet-wide, one slot: **placement claims** (``lua/placing.lua``): a new prefix's pod, claimed for
``--route-pending``. Gateways placing new prefixes at the same moment read the same state (every pod empty and
idle, before any home or booking lands) and would all pick the same pod: the claim counts the placements of the
last moment beside the footprints each read, and gives every request of one new prefix the same pod.

``read`` answers all of it for a prompt's keys and a set of pods in one round trip (``lua/routed_read.lua``: one
call for every pod on a single node, one per pod pipelined on a cluster). Key names come from kv_preflight/index/layout.py. A gateway makes
up to four such calls per request (read, book, speculate, release; releases go a few at a time): on a single
node they go on the index's lean connection (kv_preflight/index/resp.py) when it has one, redis-py's Python per
command being most of their cost.
"""
from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from kv_preflight.index import scripts
from kv_preflight.index.backend import evalsha_pipeline
from kv_preflight.index.layout import (placement_claim_keys, pod_approximate_key, pod_booking_keys, pod_home_keys,
                                      pod_routed_keys, pod_speculative_key)
from kv_preflight.index.resp import FastConnection

# Scores count milliseconds from here (Valkey's clock), so a key's position fraction keeps 1e-5 ms of precision
# in a double for decades: a chain's keys, written in one ms, still sort ancestors first.
EPOCH_MS = 1_735_689_600_000  # 2025-01-01
MAX_SPECULATIVE = 1 << 20  # speculative keys one pod keeps at most (about 100 bytes each); the soonest to expire go


def keys_blob(request_keys: Sequence[int]) -> bytes:
    """Request keys as the scripts take them: 8 bytes each, big-endian, one string."""
    return struct.pack(f">{len(request_keys)}Q", *request_keys)


class Booked(msgspec.Struct, frozen=True):
    """A pod's live bookings: requests in flight there through the gateways, and their summed cost in tokens."""

    requests: int = 0
    tokens: int = 0


class PodRouted(msgspec.Struct, frozen=True):
    """What was routed to one pod, for one prompt: its bookings, and how many of the prompt's first request keys
    it holds speculatively and approximately."""

    booked: Booked = Booked()
    speculative: int = 0
    approximate: int = 0
    footprint: int = 0  # blocks of other prefixes homed there within the window
    homed_ms_ago: int = -1  # when the prompt's own prefix was last homed there (-1: not within the window)


def _book(pod: str, booking: str, tokens: int, ttl_ms: int) -> list[tuple[str, tuple[Any, ...]]]:
    return [(pod, ("book", booking, max(0, int(tokens)), int(ttl_ms)))]


def _releases(bookings: Mapping[str, Sequence[str]]) -> list[tuple[str, tuple[Any, ...]]]:
    return [(pod, ("release", *ids)) for pod, ids in bookings.items() if ids]


def _booked(calls: Sequence[tuple[str, Sequence[object]]]) -> tuple[list[tuple[str, str]], list[Sequence[object]]]:
    """booked.lua's keys and arguments, one call per (pod, arguments)."""
    return [pod_booking_keys(p) for p, _ in calls], [a for _, a in calls]


def _speculate(pod: str, blob: bytes, ttl_ms: int, max_keys: int) -> tuple[list[tuple[str]], list[tuple[Any, ...]]]:
    return [(pod_speculative_key(pod),)], [("speculative", EPOCH_MS, blob, int(ttl_ms), int(max_keys))]


def _approximate(pod: str, blob: bytes, capacity_blocks: int, idle_ms: int) -> tuple[list[tuple[str]], list[tuple[Any, ...]]]:
    return [(pod_approximate_key(pod),)], [("approximate", EPOCH_MS, blob, max(1, int(capacity_blocks)), int(idle_ms))]


def read_replies(pods: Sequence[str], replies: Sequence[Any]) -> dict[str, PodRouted]:
    """``RoutedStore.read``'s answer from its script's replies: six numbers per pod, in ``pods``' order, in one
    reply (one call for every pod) or one reply per pod."""
    flat = replies[0] if len(replies) == 1 else [x for r in replies for x in r]
    if len(flat) != 6 * len(pods):
        raise ResponseError(f"the routed read answered {len(flat)} numbers for {len(pods)} pods")
    return {p: PodRouted(Booked(int(flat[i]), int(flat[i + 1])), int(flat[i + 2]), int(flat[i + 3]),
                         int(flat[i + 4]), int(flat[i + 5])) for p, i in zip(pods, range(0, len(flat), 6))}


def _read(pods: Sequence[str], blob: bytes, window_ms: int,
          together: tuple[str, ...] | None) -> tuple[list[tuple[str, ...]], list[tuple[Any, ...]]]:
    """routed_read.lua's keys and arguments: every pod in one call (``together``, their keys flattened: one node,
    the prompt's keys sent once), else one call per pod (a cluster: a script's keys share one slot)."""
    args = (EPOCH_MS, blob, int(window_ms))
    if together is not None:
        return [together], [args]
    return [pod_routed_keys(p) for p in pods], [args] * len(pods)


READ_KEYS_KEPT = 256  # sets of pods whose flattened read keys a store keeps (``RoutedStore._together``)


class RoutedStore:
    def __init__(self, client, fast: FastConnection | None = None):
        self.client, self.fast = client, fast
        self._booked = client.register_script(scripts.BOOKED)
        self._chain = client.register_script(scripts.ROUTED_CHAIN)
        self._read = client.register_script(scripts.ROUTED_READ)
        self._homes = client.register_script(scripts.HOMES)
        self._placing = client.register_script(scripts.PLACING)
        # a set of pods' read keys, flattened: a route's candidates are mostly the same from one request to the next,
        # and naming 64 pods' six keys each was a third of the read's Python
        self._read_keys: dict[tuple[str, ...], tuple[str, ...]] = {}

    def _together(self, pods: Sequence[str]) -> tuple[str, ...] | None:
        """Every pod's read keys in one call's order, on one node (the lean connection); None: one call per pod."""
        if self.fast is None:
            return None
        named = tuple(pods)
        keys = self._read_keys.get(named)
        if keys is None:
            if len(self._read_keys) >= READ_KEYS_KEPT:
                self._read_keys.clear()
            keys = self._read_keys[named] = tuple(k for p in pods for k in pod_routed_keys(p))
        return keys

    async def _eval(self, script, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> list[Any]:
        """One EVALSHA per (keys, args), written at once: on the lean connection, else pipelined by redis-py (a
        cluster client sends each to its key's shard)."""
        if self.fast is not None:
            return await self.fast.evalsha_many(script.sha, script.script, [list(a) for a in args],
                                                [tuple(k) for k in keys])
        return await evalsha_pipeline(self.client, script, keys, args)

    def _eval_now(self, script, keys: Sequence[Sequence[str]], args: Sequence[Sequence[Any]]) -> "asyncio.Future | None":
        """``_eval``'s replies as a future, written now, no task: on the lean connection when it is open (the
        gateway's writes beside each request); None: ``_eval`` it is."""
        if self.fast is None:
            return None
        return self.fast.evalsha_now(script.sha, script.script, [list(a) for a in args], [tuple(k) for k in keys])

    def book_now(self, pod: str, booking: str, tokens: int, ttl_ms: int) -> "asyncio.Future | None":
        """``book``, written now (``_eval_now``)."""
        return self._eval_now(self._booked, *_booked(_book(pod, booking, tokens, ttl_ms)))

    def release_now(self, bookings: Mapping[str, Sequence[str]]) -> "asyncio.Future | None":
        """``release_many``, written now (``_eval_now``)."""
        calls = _releases(bookings)
        return self._eval_now(self._booked, *_booked(calls)) if calls else None

    async def _booked_calls(self, calls: Sequence[tuple[str, Sequence[object]]]) -> list[Booked]:
        """One script call per (pod, arguments), pipelined (a cluster client sends each to its pod's shard)."""
        if not calls:
            return []
        replies = await self._eval(self._booked, *_booked(calls))
        return [Booked(int(n), int(tokens)) for n, tokens in replies]

    async def book(self, pod: str, booking: str, tokens: int, ttl_ms: int) -> Booked:
        return (await self._booked_calls(_book(pod, booking, tokens, ttl_ms)))[0]

    async def renew(self, bookings: Mapping[str, Iterable[str]], ttl_ms: int) -> None:
        """Move the expiry of these bookings (pod -> booking ids) to now + ``ttl_ms``: they still run."""
        calls = [(pod, ("renew", int(ttl_ms), *ids)) for pod, ids in bookings.items() if ids]
        await self._booked_calls(calls)

    async def release(self, pod: str, booking: str) -> Booked:
        return (await self._booked_calls([(pod, ("release", booking))]))[0]

    async def release_many(self, bookings: Mapping[str, Sequence[str]]) -> None:
        """Release these bookings (pod -> booking ids): one script call per pod, written at once."""
        await self._booked_calls(_releases(bookings))

    async def read(self, pods: Iterable[str], blob: bytes = b"", window_ms: int = 0) -> dict[str, PodRouted]:
        """Each pod's bookings, its hold of the prompt whose keys ``blob`` holds, and (``window_ms`` > 0) its
        footprint and when the prompt's prefix was last homed there, in one round trip (per shard on a cluster)."""
        pods = list(dict.fromkeys(pods))
        if not pods:
            return {}
        replies = await self._eval(self._read, *_read(pods, blob, window_ms, self._together(pods)))
        return read_replies(pods, replies)

    def read_now(self, pods: Sequence[str], blob: bytes = b"", window_ms: int = 0) -> "asyncio.Future | None":
        """``read``'s replies (``read_replies`` makes them its answer) as a future, written now, no task: on the
        lean connection when it is open (else None: ``read`` it is). ``pods``: distinct."""
        if not pods:
            return None
        return self._eval_now(self._read, *_read(pods, blob, window_ms, self._together(pods)))

    async def home(self, pod: str, prefix: int, blocks: int, window_ms: int) -> int:
        """``prefix`` (a prompt's first request key) homed on ``pod`` now, ``blocks`` long; the pod's footprint."""
        return (await self._eval(self._homes, [pod_home_keys(pod)],
                                 [(keys_blob([prefix]), max(0, int(blocks)), int(window_ms))]))[0]

    async def claim(self, prefix: int, blocks: int, order: Sequence[tuple[str, int]], ttl_ms: int,
                    moment_ms: int) -> str:
        """The pod a new prefix (``blocks`` long) is placed on, claimed for ``ttl_ms``: of ``order`` ((pod, its
        footprint as the caller read it), the caller's preference first), the one with the fewest blocks counting
        the placements of the last ``moment_ms`` there too; or the pod a live claim of ``prefix`` already names."""
        flat = [x for pod, footprint in order for x in (pod, int(footprint))]
        reply = (await self._eval(self._placing, [placement_claim_keys()],
                                  [(keys_blob([prefix]), int(ttl_ms), int(moment_ms), int(blocks), *flat)]))[0]
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    async def booked(self, pods: Iterable[str]) -> dict[str, Booked]:
        return {p: r.booked for p, r in (await self.read(pods)).items()}

    async def speculate(self, pod: str, blob: bytes, ttl_ms: int, max_keys: int = MAX_SPECULATIVE) -> int:
        """The prompt's keys live on ``pod`` for ``ttl_ms``; how many speculative keys the pod holds now."""
        return (await self._eval(self._chain, *_speculate(pod, blob, ttl_ms, max_keys)))[0]

    def speculate_now(self, pod: str, blob: bytes, ttl_ms: int, max_keys: int = MAX_SPECULATIVE) -> "asyncio.Future | None":
        """``speculate``, written now (``_eval_now``)."""
        return self._eval_now(self._chain, *_speculate(pod, blob, ttl_ms, max_keys))

    async def approximate(self, pod: str, blob: bytes, capacity_blocks: int, idle_ms: int) -> int:
        """The prompt's keys used on ``pod`` now; at most ``capacity_blocks`` kept. How many the pod holds now."""
        return (await self._eval(self._chain, *_approximate(pod, blob, capacity_blocks, idle_ms)))[0]

    def approximate_now(self, pod: str, blob: bytes, capacity_blocks: int, idle_ms: int) -> "asyncio.Future | None":
        """``approximate``, written now (``_eval_now``)."""
        return self._eval_now(self._chain, *_approximate(pod, blob, capacity_blocks, idle_ms))

    async def forget_approximate(self, pods: Iterable[str]) -> None:
        """Drop what was guessed for these pods (their events flow now: the index says what they hold)."""
        pods = list(pods)
        if pods:
            async with self.client.pipeline(transaction=False) as pipe:
                for p in pods:
                    pipe.delete(pod_approximate_key(p))
                await pipe.execute()
