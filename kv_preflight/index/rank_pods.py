"""Data-parallel ranks as pods of the index: each rank of an engine keeps its own cache, so it is indexed apart.

vLLM (and SGLang, TensorRT-LLM) run ``--data-parallel-size N`` as N engine cores behind one HTTP port, each with
its own prefix cache and its own KV-event publisher (port + rank), all under one topic ``kv@<pod>@<model>``; a
request reaches the rank its ``X-data-parallel-rank`` header names, else the engine's own balancer picks one.
Merging the ranks into one pod would predict a prefix cached on rank 0 for a request rank 1 serves, so every rank
is an *index pod* of its own (its seq, pod state, meta, presence bit): rank 0 keeps the pod's name, rank r >= 1
is ``<pod>@dp<r>``. A topic's pod never holds ``@`` (``kv@<pod>@<model>``), nor does a ``pod=`` given on a
source, so the name cannot be taken by a real pod.

llm-d's readers know nothing of ranks: every rank's llm-d entry names the pod itself (``PodIdentifier``), one
entry shared by the ranks holding the block, which stays while any of them does (the siblings' bits,
kv_preflight/index/lua/changes.lua ``G``). With ``ingest --pod-id endpoint`` every rank is already a pod of its
own (``<ip>:<port + rank>``, llm-d-router v0.10's per-rank endpoints) and gets no suffix.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

RANK_SEPARATOR = "@dp"
MAX_RANK = 4095  # far above any data-parallel size run (wide-EP: 8-64 ranks); a bound on names read back
_RANK_POD = re.compile(r"(.+)@dp([1-9][0-9]{0,3})")


def rank_pod(pod: str, rank: int | None) -> str:
    """The index pod of ``pod``'s data-parallel rank ``rank`` (None or 0: the pod itself)."""
    if not rank or rank < 0 or rank > MAX_RANK:
        return pod
    return f"{pod}{RANK_SEPARATOR}{rank}"


def split_rank_pod(name: str) -> tuple[str, int]:
    """(pod, rank) of an index pod: ``vllm-0@dp3`` -> ("vllm-0", 3); any other name is its own pod, rank 0."""
    m = _RANK_POD.fullmatch(name)
    if m is None or int(m.group(2)) > MAX_RANK:
        return name, 0
    return m.group(1), int(m.group(2))


def base_pod(name: str) -> str:
    """The pod an index pod is a rank of (itself for rank 0 and for a pod without ranks)."""
    return split_rank_pod(name)[0] if RANK_SEPARATOR in name else name


def pods_with_ranks(pods: Iterable[str], names: Iterable[str]) -> list[str]:
    """The pods and, for each, the index pods of its ranks among ``names`` (the index pods known), in order:
    a pods filter, a pod retired or forgotten, stands for all its ranks."""
    wanted = list(pods)
    asked = set(wanted)
    ranks = sorted(n for n in names if RANK_SEPARATOR in n and base_pod(n) in asked)
    return list(dict.fromkeys([*wanted, *ranks]))


def family_bits(name: str, nums: dict[str, int]) -> bytes:
    """The bitmap of ``name``'s sibling ranks (every index pod of the same pod but ``name`` itself) among the
    pods numbered in ``nums`` (pod -> number): what changes.lua's ``G`` op is given, so a rank letting go of a
    block deletes the pod's shared llm-d entry only when no sibling's bit is left at that key. Empty for a pod
    with no numbered sibling (the common case: no ``G`` is sent)."""
    base = base_pod(name)
    out = bytearray()
    for other, num in nums.items():
        if other != name and (other == base or (RANK_SEPARATOR in other and base_pod(other) == base)):
            byte = num // 8
            if len(out) <= byte:
                out.extend(bytes(byte + 1 - len(out)))
            out[byte] |= 1 << (num % 8)
    return bytes(out)


__all__ = ["MAX_RANK", "RANK_SEPARATOR", "base_pod", "family_bits", "pods_with_ranks", "rank_pod", "split_rank_pod"]
