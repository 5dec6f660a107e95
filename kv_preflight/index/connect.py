"""Which backend a Valkey URL gets: a Valkey Cluster (asked with ``INFO cluster`` unless told) gets redis-py's
cluster client and kv_preflight/index/cluster/; a single node gets redis-py and, where the URL allows it, the
lean connection (kv_preflight/index/resp.py) for the hot paths, behind kv_preflight/index/single.py."""
from __future__ import annotations

import logging
from typing import Any

from kv_preflight.index import resp, scripts
from kv_preflight.index.backend import IndexBackend
from kv_preflight.index.cluster import TAKEOVER_MS, ClusterBackend, cluster_client, probe_cluster
from kv_preflight.index.resp import FastConnection
from kv_preflight.index.single import SingleNodeBackend

log = logging.getLogger("kvpf.index")


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
    client = resp.redis_client(url, timeout_s=timeout_s, resend_scripts=lookups)
    fast = FastConnection.from_url(url, timeout_s=timeout_s,
                                   resend_scripts=lookups | {resp.script_sha(scripts.APPLY)})
    return client, SingleNodeBackend(client, fast)


__all__ = ["TAKEOVER_MS", "connect"]
