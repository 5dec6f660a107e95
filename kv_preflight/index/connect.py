"""What a backend is (``IndexBackend``: the one interface the Index calls for what differs between a single
Valkey node and a Valkey Cluster), and which one a Valkey URL gets: a Valkey Cluster (asked with ``INFO cluster``
unless told) gets redis-py's cluster client and kv_preflight/index/cluster/; a single node gets redis-py and, where
the URL allows it, the lean connection (kv_preflight/index/resp.py) for the hot paths, behind
kv_preflight/index/single.py. The pieces every backend uses: kv_preflight/index/backend.py."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from kv_preflight.index import resp, scripts
from kv_preflight.index.backend import Looked
from kv_preflight.index.cluster import TAKEOVER_MS, ClusterBackend, cluster_client, probe_cluster
from kv_preflight.index.entries import ApplyResult, Lookup
from kv_preflight.index.presence import NamesFor
from kv_preflight.index.resend import redis_client
from kv_preflight.index.resp import FastConnection
from kv_preflight.index.single import SingleNodeBackend
from kv_preflight.index.writer import Prepared

log = logging.getLogger("kvpf.index")


class IndexBackend(Protocol):
    """A topology: how a batch is applied, how a chain is looked up, and its housekeeping. The Index
    (kv_preflight/index/index.py) calls only these, and never asks which backend it has: a new topology
    is one module implementing them."""

    cluster: bool  # for the index's own modules (the pod's key names); callers ask the questions below instead
    label: str  # what a log line calls the topology ("" for a plain single node)
    # True where one part of the index (a shard) can fail while the others answer: a caller then goes on with
    # what answers (the answer says "partial") rather than failing the request
    partial_reads: bool
    gap_walks: int  # pods a default lookup walked key by key rather than bisected (a counter)
    late_reads: int  # default lookups that took a round past the usual ones (a counter; 0 on one node)
    # keys elsewhere than the numbering's that keep its high-water mark (kv_preflight/index/numbering.py
    # give_numbers): a cluster's shards may lose their data one at a time; () on one node
    numbering_copies: tuple[str, ...]
    # the lean connection (kv_preflight/index/resp.py) where the topology and URL have one, for other scripts on
    # the hot path (the gateway's routed state, kv_preflight/index/routed.py); None: redis-py carries everything
    fast: FastConnection | None

    def write_counts(self) -> dict[str, int]:
        """The write path's counters (``Index.write_counts``): each name's count so far; all 0 on one node."""

    def nodes(self) -> list[tuple[str, int]]:
        """(host, port) of every node the client knows beyond the URL's (a cluster's shards and replicas)."""

    async def send(self, preps: Sequence[Prepared]) -> "asyncio.Future[list[ApplyResult]]":
        """Apply planned batches (kv_preflight/index/writer.py), in order; the results come from the future."""

    async def lookup(self, request_keys: Sequence[int], pods: Sequence[str] | None, mode: str) -> tuple[Lookup, int]:
        """Over llm-d's entries (``linear``, ``pipeline``): per pod, its prefix of the chain; and how
        many foreign-typed keys were read as misses."""

    async def lookup_bits(self, request_keys: Sequence[int], names: NamesFor) -> tuple[Lookup | None, int]:
        """The default lookup, over the presence bitmaps; None when a key holds entries that are not ours."""

    async def drain_outbox(self, pod_id: str, *, stale_only: bool) -> int:
        """Finish what a stopped writer left half applied (nothing to do on a single node)."""

    def left_to_drain(self, pod_id: str) -> bool:
        """Whether a batch of this writer's went out with its changes left to a drain that has not run them yet (a
        cluster's writer past its window; never on a single node)."""

    async def drain_outboxes(self, pods: Sequence[str], *, at_once: int) -> dict[str, int | Exception]:
        """``drain_outbox(stale_only=True)`` of each pod, ``at_once`` side by side: per pod the entries run again,
        or the Valkey error that stopped it (other errors raise). A single node has none: ``{}`` at once."""

    async def read_timed(self, fill: Callable[[Any], None]) -> tuple[int, list[Any]]:
        """Valkey's time (ms) and the replies of the reads ``fill`` puts in a pipeline (error replies in place),
        in as few round trips as the topology allows."""

    async def look_at_shards(self, epoch: str) -> Looked:
        """The primaries that came back without their data in ``epoch``, and those whose slot marker was
        evicted (kv_preflight/index/cluster/markers.py); a single node has none: its epoch key says it all."""

    async def mark_shards(self, epoch: str) -> None:
        """Every slot marked in ``epoch`` so a shard's loss from here on shows (nothing to mark on one node)."""

    def forget(self, pods: Iterable[str]) -> None:
        """Drop what this process remembers of these pods' writes (a pod let go, the index's data lost)."""

    async def read_commands(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Read-only commands on the keys they name second, replies in order, error replies in place."""

    async def key_count(self) -> int: ...

    async def memory_usage(self) -> int | None: ...

    async def close(self) -> None: ...


def connect(url: str, *, timeout_s: float = 1.0, cluster: bool | None = None,
            takeover_ms: int = TAKEOVER_MS) -> tuple[Any, IndexBackend]:
    """The client and the backend for a URL. ``cluster``: None asks the node (``INFO cluster``); a node
    that does not answer is taken for a single node, with a warning (``--valkey-cluster yes`` says so up
    front)."""
    if cluster is None:
        cluster = probe_cluster(url, timeout_s)
        if cluster is None:
            log.warning("%s did not answer; taking it for a single node (--valkey-cluster yes if it is a "
                        "cluster)", url.split("@")[-1])
    if cluster:
        client = cluster_client(url, timeout_s=timeout_s)
        return client, ClusterBackend(client, takeover_ms=takeover_ms)
    # Scripts resent once after a lost connection, being safe to run twice (kv_preflight/index/resp.py): the
    # read-only lookups; and on the lean connection the apply, whose seq check answers "dup" to a
    # batch already applied (only the ingester's checked runs go there; "import" goes by redis-py).
    lookups = {resp.script_sha(s) for s in (scripts.LOOKUP_LINEAR, scripts.LOOKUP_BITS)}
    client = redis_client(url, timeout_s=timeout_s, resend_scripts=lookups)
    fast = FastConnection.from_url(url, timeout_s=timeout_s,
                                   resend_scripts=lookups | {resp.script_sha(scripts.APPLY)})
    return client, SingleNodeBackend(client, fast)


__all__ = ["TAKEOVER_MS", "IndexBackend", "connect"]
