"""Which layout an index is written in (``kvpf:layout``, ``version``; the layouts themselves are
kv_preflight/index/layout.py's): every process checks it before reading or writing, an empty index gets ours,
and an older one is refused with the command that migrates it (kv_preflight/index/migrate.py)."""
from __future__ import annotations

from kv_preflight.index.entries import text
from kv_preflight.index.layout import LAYOUT_KEY, LAYOUT_VERSION, V1_PODS_KEY


class LayoutError(RuntimeError):
    """The index was written in another layout version (see kv_preflight/index/layout.py and ``index migrate``)."""


async def check_layout(client) -> str:
    """The layout version, set to ours on an empty index; ``LayoutError`` for any other."""
    found = await client.hget(LAYOUT_KEY, "version")
    if found is None:
        if await v1_writer_seen(client):
            raise LayoutError("this index has layout 1 (kv-preflight 0.1): stop its ingesters and run "
                              "`kv-preflight index migrate --valkey-url URL`")
        await client.hsetnx(LAYOUT_KEY, "version", LAYOUT_VERSION)
        found = await client.hget(LAYOUT_KEY, "version")
    version = text(found)
    if version in ("2", "3"):
        raise LayoutError(f"this index has layout {version} (kv-preflight before layout 4): stop its ingesters and "
                          "run `kv-preflight index migrate --valkey-url URL` (llm-d's keys do not change)")
    if version != LAYOUT_VERSION:
        raise LayoutError(f"this index has layout {version!r}; this kv-preflight reads and writes layout "
                          f"{LAYOUT_VERSION} only")
    return version


async def v1_writer_seen(client) -> bool:
    """Whether a layout-1 writer (kv-preflight 0.1) has written here (its registry exists)."""
    return bool(await client.exists(V1_PODS_KEY))


__all__ = ["LayoutError", "check_layout", "v1_writer_seen"]
