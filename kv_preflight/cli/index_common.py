"""What every ``kv-preflight index ...`` command shares: the index opened and its layout checked, one clear line
for every error reaching Valkey, the output as text or JSON."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import click

from kv_preflight.cli.stack_file import no_stack_hint
from kv_preflight.config import Config
from kv_preflight.index.index import Index
from kv_preflight.index.layout_version import LayoutError, check_layout
from kv_preflight.index.pod_log import PodLogError


def _run(coro):
    try:
        return asyncio.run(coro)
    except BrokenPipeError:  # the reader left (`index export | head -2`): click stops quietly, as for any command
        raise
    except (OSError, ConnectionError) as exc:
        raise click.ClickException(f"cannot reach Valkey: {exc}{no_stack_hint('valkey_url')}") from None
    except LayoutError as exc:
        raise click.ClickException(str(exc)) from None
    except PodLogError as exc:  # nothing was written: the error came from reading the pod's log
        pod = exc.pod_id or "P"
        raise click.ClickException(f"{exc}: its blocks are not known, so its entries cannot be exported or cleared "
                                   f"from it; `index clear --pod {pod} --scan` clears them without it "
                                   "(docs/operations.md)") from None
    except Exception as exc:  # redis errors and the like: one clear line, no traceback
        if exc.__class__.__module__.startswith("redis"):
            raise click.ClickException(f"Valkey error: {exc}{no_stack_hint('valkey_url')}") from None
        raise


def _unknown_pods(asked, known, where: str = "the index knows") -> None:
    """``--pod nope`` is an error naming it, not an empty success."""
    missing = sorted(set(asked) - set(known))
    if missing:
        names = ", ".join(sorted(known)[:10]) + (" ..." if len(known) > 10 else "")
        raise click.ClickException(f"unknown pod{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
                                   f"{where} {names or 'no pod'}")


def _emit(as_json: bool, data: Any, human) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def _config(**flags) -> Config:
    """Config.load with a bad value (flag or KVPF_*) as one clear line, naming the variable it came from."""
    try:
        return Config.load(**flags)
    except ValueError as exc:
        hint = no_stack_hint("valkey_url") if str(exc).startswith("valkey_url") else ""
        raise click.UsageError(f"{exc}{hint}") from None


def _index(valkey_url: str | None) -> Index:
    from kv_preflight.index.cluster import probe_cluster

    cfg = _config(valkey_url=valkey_url)
    timeout_s = max(cfg.valkey_timeout_s, 5.0)
    cluster = cfg.cluster_mode()
    if cluster is None:
        # asked here: a node that does not answer is taken for a single node without the service's warning,
        # and the first command then fails with the real cause (refused, auth) as the one error line
        cluster = bool(probe_cluster(cfg.valkey_url, timeout_s))
    return Index.from_url(cfg.valkey_url, timeout_s=timeout_s, entry_format=cfg.entry_format, cluster=cluster)


@contextlib.asynccontextmanager
async def _open(valkey_url: str | None) -> AsyncIterator[Index]:
    """The index, after checking it is of this kv-preflight's layout (else a clear error); closed after."""
    async with _index(valkey_url) as ix:
        await check_layout(ix.client)
        yield ix


valkey_opt = click.option("--valkey-url", default=None, help="Valkey URL (any node of a cluster).  [env KVPF_VALKEY_URL]")
json_opt = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
