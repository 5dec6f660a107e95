"""llm-d-router's opt-in ``xxh64`` request keys (``tokenProcessorConfig.hashAlgorithm: "xxh64"``).

llm-d-router PR #2237 (commit c027acfc6e33ed38a4a87a07fd13a28f3a10196f, pkg/kvcache/kvblock/
token_processor.go ``hashXXH64``) hashes each canonical block with one XXH64 digest (seed 0) over the
parent key as 8 bytes little-endian, the token ids as 4 bytes little-endian each, and every extra
string (a multimodal hash, a cache salt) as its byte length in 8 bytes little-endian followed by its
bytes. The chain starts at ``H(xxh64(hash_seed), [], [model])``: the model name in the extra position,
as the CBOR chain passes it. (The release note of #2237 says ``"xxhash"``; the code accepts only
``"xxh64"`` and rejects ``"xxhash"``.)

XXH64 itself is written out here (the reference algorithm, github.com/Cyan4973/xxHash), so the project
needs no binding; tests check it and the chain against the ``xxhash`` package, an independent
implementation (vectors in tests/fixtures/llmd-xxh64-request-keys.json). Pure Python costs ~5 us per
16-token block, so when that package is installed its C digest is used instead (same function).
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import lru_cache

M64 = 0xFFFFFFFFFFFFFFFF
P1 = 0x9E3779B185EBCA87
P2 = 0xC2B2AE3D27D4EB4F
P3 = 0x165667B19E3779F9
P4 = 0x85EBCA77C2B2AE63
P5 = 0x27D4EB2F165667C5


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & M64


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * P2) & M64
    return (_rotl(acc, 31) * P1) & M64


def _merge(acc: int, val: int) -> int:
    acc ^= _round(0, val)
    return (acc * P1 + P4) & M64


def xxh64(data: bytes, seed: int = 0) -> int:
    """XXH64 of ``data`` (unsigned 64-bit)."""
    n = len(data)
    i = 0
    if n >= 32:
        v1, v2, v3, v4 = (seed + P1 + P2) & M64, (seed + P2) & M64, seed & M64, (seed - P1) & M64
        limit = n - 32
        unpack = struct.unpack_from
        while i <= limit:
            a, b, c, d = unpack("<4Q", data, i)
            v1, v2, v3, v4 = _round(v1, a), _round(v2, b), _round(v3, c), _round(v4, d)
            i += 32
        h = (_rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)) & M64
        for v in (v1, v2, v3, v4):
            h = _merge(h, v)
    else:
        h = (seed + P5) & M64
    h = (h + n) & M64
    while i + 8 <= n:
        (k,) = struct.unpack_from("<Q", data, i)
        h ^= _round(0, k)
        h = (_rotl(h, 27) * P1 + P4) & M64
        i += 8
    if i + 4 <= n:
        (k,) = struct.unpack_from("<I", data, i)
        h ^= (k * P1) & M64
        h = (_rotl(h, 23) * P2 + P3) & M64
        i += 4
    while i < n:
        h ^= (data[i] * P5) & M64
        h = (_rotl(h, 11) * P1) & M64
        i += 1
    h ^= h >> 33
    h = (h * P2) & M64
    h ^= h >> 29
    h = (h * P3) & M64
    h ^= h >> 32
    return h


try:  # optional: the same XXH64 in C (the tests compare the two)
    from xxhash import xxh64_intdigest as _digest
except ImportError:  # pragma: no cover - depends on the environment
    _digest = None


def block_key(parent: int, tokens: Sequence[int], extras: Sequence[str] = ()) -> int:
    """One block's key: llm-d-router's ``hashXXH64(parent, tokens, extras)``."""
    parts = [struct.pack("<Q", parent & M64), struct.pack(f"<{len(tokens)}I", *tokens)]
    for s in extras:
        raw = s.encode()
        parts.append(struct.pack("<Q", len(raw)))
        parts.append(raw)
    data = b"".join(parts)
    return _digest(data) if _digest is not None else xxh64(data)


@lru_cache(maxsize=1024)
def root_key(model: str, hash_seed: str = "") -> int:
    """``getInitHash``: the seed's XXH64, then one block with no tokens and the model as its extra."""
    seed = hash_seed.encode()
    return block_key(_digest(seed) if _digest is not None else xxh64(seed), (), (model,))


def request_keys(tokens: Sequence[int], *, model: str, hash_seed: str = "", block_size: int = 16,
                 parent: int | None = None, extra_per_block: Sequence[Sequence[str] | None] | None = None) -> list[int]:
    """Keys of every full block (a partial trailing block gets none); ``extra_per_block[i]`` lists block
    i's extra strings (multimodal hashes, then the cache salt on block 0)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= 0xFFFFFFFF:
            raise ValueError(f"token id {t!r} is not an integer in [0, 4294967295]")
    prev = root_key(model, hash_seed) if parent is None else parent
    keys = []
    for i in range(len(tokens) // block_size):
        extra = extra_per_block[i] if extra_per_block and i < len(extra_per_block) else None
        prev = block_key(prev, tokens[i * block_size:(i + 1) * block_size], extra or ())
        keys.append(prev)
    return keys
