"""Where engines are discovered: ``--engines-from dns://NAME:PORT`` and ``--engines-from file://PATH``.

DNS: every A/AAAA record of NAME is an engine at ``http://ADDRESS:PORT`` (a Kubernetes headless
Service answers with one record per ready pod). A file: a JSON list of URLs or ``{"url", "pod"}``
objects, or plain URLs one a line (``#`` comments). Both are read again every few seconds by
ingester/fleet_member.py, which holds each change a few seconds before acting on it.

``observe`` returns None when the source could not be read (a DNS timeout, a file half written):
"no answer" keeps the current set, unlike an answer with no engines, which empties it in time.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from kv_preflight.ingester.membership_rules import EngineSpec, address_pod_id

log = logging.getLogger("kvpf.ingester")


@dataclass(frozen=True)
class EnginesFrom:
    spec: str  # as given, for logs and the engines' origin
    kind: str  # "dns" | "file"
    name: str = ""  # dns: the name to resolve
    port: int = 0  # dns: the engines' HTTP port
    path: str = ""  # file: its path


def parse_engines_from(spec: str) -> EnginesFrom:
    parts = urlsplit(spec.strip())
    if parts.scheme == "dns":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not port:
            raise ValueError(f"--engines-from {spec!r}: expected dns://NAME:PORT (the engines' HTTP port)")
        return EnginesFrom(spec=spec, kind="dns", name=parts.hostname, port=port)
    if parts.scheme == "file":
        path = (parts.netloc + parts.path) if parts.netloc not in ("", "localhost") else parts.path
        if not path:
            raise ValueError(f"--engines-from {spec!r}: expected file:///ABSOLUTE/PATH or file://RELATIVE/PATH")
        return EnginesFrom(spec=spec, kind="file", path=path)
    raise ValueError(f"--engines-from {spec!r}: expected dns://NAME:PORT or file://PATH")


def parse_engine_list(text: str, origin: str) -> list[EngineSpec]:
    """A file's engines; ValueError naming the first bad entry. A pod given in the file names the
    engine; otherwise its address does (see EngineSpec)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    else:
        items = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        items = [i for i in items if i]
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            url, pod = item, ""
        elif isinstance(item, dict) and isinstance(item.get("url"), str) and isinstance(item.get("pod", ""), str):
            url, pod = item["url"], item.get("pod", "")
        else:
            raise ValueError(f"entry {i + 1} ({str(item)[:80]}) is not a URL or an object with \"url\" (and \"pod\")")
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname:
            raise ValueError(f"entry {i + 1}: {url[:80]!r} is not an http(s):// URL")
        out.append(EngineSpec(url=url, pod=pod.strip() or address_pod_id(url), origin=origin))
    return out


async def resolve_dns(name: str, port: int) -> list[str] | None:
    """Addresses of ``name`` (A and AAAA), or None if the lookup failed for a reason other than
    "no such name" (which is an answer: no engines)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(name, port, type=socket.SOCK_STREAM), timeout=5.0)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return []
        log.warning("engines: resolving %s failed (%s); keeping the engines known", name, exc)
        return None
    except (OSError, asyncio.TimeoutError) as exc:
        log.warning("engines: resolving %s failed (%s); keeping the engines known", name, exc or "timeout")
        return None
    return sorted({info[4][0] for info in infos})


async def observe(source: EnginesFrom) -> list[EngineSpec] | None:
    if source.kind == "dns":
        addresses = await resolve_dns(source.name, source.port)
        if addresses is None:
            return None
        urls = [f"http://[{a}]:{source.port}" if ":" in a else f"http://{a}:{source.port}" for a in addresses]
        return [EngineSpec(url=u, pod=address_pod_id(u), origin=source.spec) for u in urls]
    try:
        with open(source.path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        log.warning("engines: %s does not exist (yet); keeping the engines known", source.path)
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("engines: %s cannot be read (%s); keeping the engines known", source.path, exc)
        return None
    try:
        return parse_engine_list(text, source.spec)
    except ValueError as exc:
        log.error("engines: %s: %s; keeping the engines known until it is fixed", source.path, exc)
        return None
