"""llm-d request keys: the content address of every canonical block of a prompt.

A key is FNV-64a over the canonical CBOR encoding of ``[parent, tokens, extra]``
(llm-d-kv-cache ``ChunkedTokenDatabase``, Go: fxamacker/cbor canonical mode +
hash/fnv). The chain starts at ``root = H(fnv64a(hash_seed), nil, model)``, so two
deployments share keys only when seed, model name and block size all agree.

The C routine in ``_speedups.c`` hashes a whole chain in one call; the Python code
here is the reference it is tested against and the fallback where no compiler was
available at install time.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import cbor2

from kv_preflight.keys.multimodal import with_salt

try:  # built by setup.py when a C compiler is present
    from kv_preflight import _speedups
except ImportError:  # pragma: no cover - exercised when the extension is absent
    _speedups = None

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = 0xFFFFFFFFFFFFFFFF
MAX_TOKEN_ID = 0xFFFFFFFF  # llm-d hashes tokens as []uint32

HAS_C_EXTENSION = _speedups is not None
# Request-key hash algorithms llm-d-router offers (tokenProcessorConfig.hashAlgorithm "cbor-fnv", the
# default, and "xxh64" since router PR #2237, kv_preflight/keys/xxh64.py); our names are these.
HASH_ALGOS = ("fnv64a", "xxh64")


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & MASK64
    return h


def block_hash(parent: int, tokens: Sequence[int] | None, extra: Any = None) -> int:
    """The reference hash of one block (cbor2 canonical + FNV-64a), exactly llm-d's ``hash``."""
    payload = [parent, list(tokens) if tokens is not None else None, extra]
    return fnv64a(cbor2.dumps(payload, canonical=True))


@lru_cache(maxsize=1024)
def root_key(model: str, hash_seed: str = "") -> int:
    """The chain root for a model: ``H(fnv64a(seed), nil, model)``; cached since every request needs it."""
    return block_hash(fnv64a(hash_seed.encode()), None, model)


def mm_extra(mm_hashes: Sequence[Any] | None) -> Any:
    """The ``extra`` element llm-d uses for a block that overlaps multimodal inputs."""
    if not mm_hashes:
        return None
    return [{"Hash": h} for h in mm_hashes]


def _check_tokens(tokens: Sequence[int]) -> None:
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t > MAX_TOKEN_ID:
            raise ValueError(f"token id {t!r} is not an integer in [0, {MAX_TOKEN_ID}]")


KEY_WIDTH = 20  # decimal digits of the largest uint64


def pack_keys(keys: Sequence[int]) -> bytes:
    """Keys as one string the lookup script indexes: each 20 characters, decimal, right-aligned."""
    if _speedups is not None:
        return _speedups.pack_keys(keys)
    return b"".join(b"%20d" % k for k in keys)


def request_keys_reference(
    tokens: Sequence[int],
    *,
    model: str,
    hash_seed: str = "",
    block_size: int = 16,
    parent: int | None = None,
    extra_per_block: Sequence[Any] | None = None,
) -> list[int]:
    """Straightforward per-block cbor2 + FNV: the definition, and the benchmark's baseline."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    _check_tokens(tokens)
    prev = root_key(model, hash_seed) if parent is None else parent
    keys = []
    for i in range(len(tokens) // block_size):
        chunk = tokens[i * block_size : (i + 1) * block_size]
        extra = mm_extra(extra_per_block[i]) if extra_per_block and i < len(extra_per_block) else None
        prev = block_hash(prev, chunk, extra)
        keys.append(prev)
    return keys


def request_keys_json(
    raw: bytes | memoryview | Any,
    *,
    model: str,
    hash_seed: str = "",
    block_size: int = 16,
) -> tuple[list[int], int] | None:
    """Keys and token count straight from the JSON text of a token-id array (e.g. a msgspec.Raw).

    The fast path of a prediction: no Python int per token. None when the C routine is
    absent or the text is anything but a plain array of integers in [0, 2^32-1]; the
    caller then decodes it the ordinary way, which also explains what is wrong.
    """
    if _speedups is None or block_size <= 0:
        return None
    try:
        return _speedups.request_keys_json(root_key(model, hash_seed), raw, block_size)
    except (ValueError, TypeError, OverflowError):
        return None


def request_keys(
    tokens: Sequence[int],
    *,
    model: str,
    hash_seed: str = "",
    block_size: int = 16,
    parent: int | None = None,
    extra_per_block: Sequence[Any] | None = None,
    hash_algo: str = "fnv64a",
) -> list[int]:
    """Keys for every full block of ``tokens``; a partial trailing block gets none.

    ``parent`` continues an existing chain (the engine-event bridge uses it);
    ``extra_per_block[i]`` lists the multimodal hashes overlapping block ``i``.
    Raises ValueError on a token id outside uint32, as llm-d cannot hash it.
    ``hash_algo`` "xxh64" keys as llm-d-router's opt-in XXH64 chain (kv_preflight/keys/xxh64.py).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if hash_algo == "xxh64":
        from kv_preflight.keys import xxh64

        return xxh64.request_keys(tokens, model=model, hash_seed=hash_seed, block_size=block_size, parent=parent,
                                  extra_per_block=extra_per_block)
    prev = root_key(model, hash_seed) if parent is None else parent
    if extra_per_block and any(extra_per_block):
        return _keys_with_extras(tokens, prev, block_size, extra_per_block)
    if _speedups is not None:
        try:
            return _speedups.request_keys(prev, tokens, block_size)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    return request_keys_reference(tokens, model=model, hash_seed=hash_seed, block_size=block_size, parent=prev)


def _keys_with_extras(tokens: Sequence[int], prev: int, block_size: int, extra_per_block: Sequence[Any]) -> list[int]:
    """A chain some of whose blocks carry extra keys: those blocks by the reference hash, the runs of plain
    blocks between them by the C routine (a prompt with one image is mostly text)."""
    if _speedups is None:
        return request_keys_reference(tokens, model="", block_size=block_size, parent=prev,
                                      extra_per_block=extra_per_block)
    _check_tokens(tokens)
    n = len(tokens) // block_size
    keys: list[int] = []
    i = 0
    while i < n:
        extra = extra_per_block[i] if i < len(extra_per_block) else None
        if extra:
            prev = block_hash(prev, tokens[i * block_size:(i + 1) * block_size], mm_extra(extra))
            keys.append(prev)
            i += 1
            continue
        j = i + 1
        while j < n and not (j < len(extra_per_block) and extra_per_block[j]):
            j += 1
        run = _speedups.request_keys(prev, tokens[i * block_size:j * block_size], block_size)
        keys.extend(run)
        prev = run[-1]
        i = j
    return keys


def prompt_request_keys(
    tokens: Sequence[int],
    *,
    model: str,
    hash_seed: str = "",
    block_size: int = 16,
    cache_salt: str | None = None,
    extra_per_block: Sequence[Any] | None = None,
    hash_algo: str = "fnv64a",
) -> list[int]:
    """Keys of a prompt as the ingester keys the engine's blocks of it: ``extra_per_block[i]`` the multimodal
    identifiers of canonical block i (kv_preflight/keys/multimodal.py ``canonical_extras``), the cache salt
    after block 0's (``with_salt``).

    The salt (vLLM's ``cache_salt``) taints the first block only: vLLM 0.32 adds it to the extra keys of the
    block starting at token 0 (kv_cache_utils ``generate_block_hash_extra_keys``) and publishes it there as a
    bare string; llm-d-router folds it into that block's extra features after any multimodal hashes
    (preciseprefixcache ``foldCacheSalt``), so block 0's extra is ``[{"Hash": salt}]`` and every later key
    differs through the chain.
    """
    extras = with_salt(list(extra_per_block) if extra_per_block else None, cache_salt, len(tokens) // block_size)
    return request_keys(tokens, model=model, hash_seed=hash_seed, block_size=block_size, extra_per_block=extras,
                        hash_algo=hash_algo)


salted_request_keys = prompt_request_keys  # a prompt sent with a cache_salt and no multimodal items


def chain_root(model: str, hash_seed: str = "", hash_algo: str = "fnv64a") -> int:
    """The chain root of ``model`` under either algorithm."""
    if hash_algo == "xxh64":
        from kv_preflight.keys import xxh64

        return xxh64.root_key(model, hash_seed)
    return root_key(model, hash_seed)
