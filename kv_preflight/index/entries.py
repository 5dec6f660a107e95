"""What travels to and from Valkey, as pure values: llm-d's PodEntry fields, a batch's mutations and
their script arguments, and the scripts' replies (apply results, per-pod prefixes).

No I/O here: the backends (kv_preflight/index/) send these, kv_preflight/index/index.py is the interface.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

DEFAULT_TIER = "gpu"


class PodEntry(msgspec.Struct, frozen=True):
    """llm-d's PodEntry; field order is Go's, which the JSON encoding must keep byte for byte."""

    PodIdentifier: str
    DeviceTier: str = DEFAULT_TIER
    Speculative: bool = False
    HasGroup: bool = False
    GroupIdx: int = 0


_entry_json = msgspec.json.Encoder()
_entry_decoder = msgspec.json.Decoder(PodEntry)


def better_tier(tier: str, current: str | None) -> bool:
    """Whether ``tier`` names a pod's tier at a key better than ``current``: a pod with entries on
    several tiers there counts on gpu, else on the first by name (every lookup mode agrees)."""
    if current is None:
        return True
    if current == DEFAULT_TIER:
        return False
    return tier == DEFAULT_TIER or tier < current


def tier_of(medium: str | None) -> str:
    return medium.lower() if medium else DEFAULT_TIER


def make_entry(pod_id: str, medium: str | None, group_idx: int | None) -> PodEntry:
    return PodEntry(
        PodIdentifier=pod_id,
        DeviceTier=tier_of(medium),
        HasGroup=group_idx is not None,
        GroupIdx=group_idx or 0,
    )


def encode_entry(entry: PodEntry, entry_format: str = "json") -> str:
    if entry_format == "v08":
        return f"{entry.PodIdentifier}@{entry.DeviceTier}" + ("[speculative]" if entry.Speculative else "")
    return _entry_json.encode(entry).decode()


def parse_entry(field_value: str | bytes) -> PodEntry | None:
    """Either form llm-d has written; None for a field no llm-d version would write."""
    text = field_value.decode("utf-8", "replace") if isinstance(field_value, bytes) else field_value
    if text.startswith("{"):
        try:
            return _entry_decoder.decode(text)
        except msgspec.DecodeError:
            return None
    pod, sep, tier = text.partition("@")
    if not sep or not pod:
        return None
    speculative = False
    bracket = tier.find("[")
    if bracket != -1:
        speculative = "speculative" in tier[bracket:]
        tier = tier[:bracket]
    return PodEntry(PodIdentifier=pod, DeviceTier=tier or DEFAULT_TIER, Speculative=speculative)




class StoreBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    entry_field: str
    request_keys: tuple[int, ...]
    group: int = 0  # the engine's KV-cache group (hybrid models hold one hash once per group)
    # The event had no parent: a store of a hash the pod already holds is then vLLM's
    # re-announcement of a reused block (kv_cache_report_mode "full"), not a second copy.
    parentless: bool = False
    # The request key before request_keys[0] in its chain (request_keys[j]'s is request_keys[j-1]):
    # CHAIN_ROOT when the block starts a chain (its parent is the chain root, not a request key);
    # None when not known (index import): the pod's orphan count is then unknown (PodState.restore).
    parent: int | None = None


CHAIN_ROOT = -1  # StoreBlock.parent of a block that starts its chain


class Carry(msgspec.Struct, frozen=True, gc=False):
    """What a stored block left unkeyed, where its engine block size is not a multiple of the request keys'
    (SGLang pages, TensorRT-LLM's tokens_per_block, vLLM's --block-size 24): the tokens after its last whole
    request key (``tokens``, maybe none: the child still needs to know there are none), the extra-key ids of the
    engine blocks they came from, and the salt of a prompt whose first request key is not complete yet. A
    child's first key needs them (ingester/bridge.py), and nothing else in the index holds them, so the pod's
    state keeps one per held block that has one, and its log persists them (kv_preflight/index/pod_log.py)."""

    tokens: tuple[int, ...]
    ids: tuple[str, ...] = ()
    salt: str | None = None


class RemoveBlock(msgspec.Struct, frozen=True):
    engine_key: int
    tier: str
    group: int = 0


def block_slot(tier: str, group: int | None) -> str:
    """The reverse-index key suffix of a block: its tier, and its KV-cache group when not 0."""
    return f"{tier}|{group}" if group else tier


class ClearPod(msgspec.Struct, frozen=True):
    pass


class MarkIncomplete(msgspec.Struct, frozen=True):
    """Flag the pod incomplete in the same script that applies the batch (so a batch applied
    whose reply was lost, then answered "dup" on retry, still leaves its flag)."""

    reason: str


Mutation = StoreBlock | RemoveBlock | ClearPod | MarkIncomplete


def encode_mutations(mutations: Iterable[Mutation]) -> list[str | int]:
    """Flat script arguments: ``nf field..`` (the batch's distinct PodEntry fields, each sent
    once), then ops ``S ek tier fi n rk.. parent`` (fi: 1-based into the fields; ``A`` instead of
    ``S`` for a parentless store; parent: the request key before rk 1, "" for the chain root, "?"
    when not known) / ``R ek tier`` / ``C`` / ``I reason``."""
    fields: dict[str, int] = {}
    ops: list[str | int] = []
    for m in mutations:
        if isinstance(m, StoreBlock):
            fi = fields.get(m.entry_field)
            if fi is None:
                fi = fields[m.entry_field] = len(fields) + 1
            parent = "?" if m.parent is None else "" if m.parent == CHAIN_ROOT else m.parent
            ops += ["A" if m.parentless else "S", m.engine_key, block_slot(m.tier, m.group), fi, len(m.request_keys),
                    *m.request_keys, parent]
        elif isinstance(m, RemoveBlock):
            ops += ["R", m.engine_key, block_slot(m.tier, m.group)]
        elif isinstance(m, MarkIncomplete):
            ops += ["I", m.reason]
        else:
            ops.append("C")
    return [len(fields), *fields, *ops]


def text(v: Any) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def apply_result(reply: Sequence[Any]) -> "ApplyResult":
    status, last, foreign, detail = reply[:4]
    return ApplyResult(text(status), int(last), int(foreign), text(detail), text(reply[4]) if len(reply) > 4 else "")


@dataclass(frozen=True)
class ApplyResult:
    status: str  # applied | dup | gap | restart | corrupt (never applied: a forged seq, a foreign-typed pod key)
    last_seq: int
    foreign_writes: int = 0  # writes that hit a key of a foreign type (skipped; the pod is flagged)
    detail: str = ""  # why, for corrupt and foreign writes
    gen: str = ""  # the pod's generation after the answer (kv_preflight/index/writer.py)


@dataclass(frozen=True)
class Lookup:
    """A lookup's answer: per pod, its prefix; ``unanswered_from``: on a cluster with a shard down
    (and no replica to take over), the first key (block index, 0-based) whose shard did not answer:
    counts are then lower bounds, never silently short."""

    matches: list["PodMatch"]
    unanswered_from: int | None = None
    # Each key's bitmaps of a hybrid model's other KV cache groups ((tier, group) -> bitmap), from the first
    # key on, at least as far as the longest match, when the lookup read every key's presence anyway (the
    # fleet-wide reply: a single node's, or every cluster shard's); None: not read (the reader asks
    # ``ReadSide.group_presence``, a round trip of its own).
    group_bits: list[dict[tuple[str, int], bytes]] | None = None
    unanswered_why: str = ""  # what the first silent shard said (a timeout, a refused connection), for the log

    @property
    def partial(self) -> bool:
        return self.unanswered_from is not None


class PodMatch(msgspec.Struct, frozen=True, gc=False):
    """A pod's prefix of a chain (a Struct: a lookup makes one per pod, 1,000 on a fleet-wide prefix;
    untracked by the garbage collector, as it holds only a str and ints: a thousand tracked objects per
    prediction set off a collection every request or two, the largest share of a prediction's time)."""

    pod_id: str
    blocks: int  # consecutive request-key blocks from the start of the chain
    tier: str


def longest_prefix(fields_per_key: Sequence[Sequence[str | bytes]], pods: Iterable[str] | None = None) -> list[PodMatch]:
    """Pure twin of the lookup script, for the pipeline path (Valkey Cluster) and tests."""
    wanted = set(pods) if pods else None
    alive: dict[str, str] | None = None
    counts: dict[str, int] = {}
    tiers: dict[str, str] = {}
    for i, fields in enumerate(fields_per_key, start=1):
        present: dict[str, str] = {}
        for f in fields:
            entry = parse_entry(f)
            if entry is None or entry.Speculative:
                continue
            if wanted is not None and entry.PodIdentifier not in wanted:
                continue
            if better_tier(entry.DeviceTier, present.get(entry.PodIdentifier)):
                present[entry.PodIdentifier] = entry.DeviceTier
        alive = present if alive is None else {p: t for p, t in present.items() if p in alive}
        if not alive:
            break
        for pod in alive:
            counts[pod] = i
            tiers[pod] = alive[pod]
    return [PodMatch(p, n, tiers[p]) for p, n in counts.items()]


def parse_lookup_reply(flat: Sequence[Any], head: int = 1) -> tuple[list[PodMatch], int]:
    """The scripts' reply: the number of foreign-typed keys read (as misses), ``head - 1`` more
    items (lookup.lua's moved flag), then pod triples."""
    out = []
    for i in range(head, len(flat), 3):
        pod, n, tier = flat[i], flat[i + 1], flat[i + 2]
        out.append(PodMatch(pod.decode() if isinstance(pod, bytes) else pod, int(n),
                            tier.decode() if isinstance(tier, bytes) else tier))
    return out, int(flat[0]) if flat else 0




__all__ = [
    "CHAIN_ROOT", "DEFAULT_TIER", "ApplyResult", "better_tier", "Carry", "ClearPod", "Lookup", "MarkIncomplete", "Mutation", "PodEntry", "PodMatch",
    "RemoveBlock", "StoreBlock", "apply_result", "block_slot", "encode_entry", "encode_mutations",
    "longest_prefix", "make_entry", "parse_entry", "parse_lookup_reply", "text", "tier_of",
]
