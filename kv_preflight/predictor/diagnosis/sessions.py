"""What a log of multi-turn sessions says about prefix reuse: pure, from token lists to a per-session report.

A conversation whose history only grows reuses every earlier turn: turn n's prompt starts with turn
n-1's, so only the new tokens are prefilled. A sliding context window breaks that: once the history is
longer than the window, the front is cut, the overlap between consecutive turns falls to the part kept
in front of the cut (BOS and system prompt), and every turn prefills almost everything again. The
reports say, per session, the shared prefix of consecutive turns, from which turn a window cuts (and how
many tokens), the tokens prefilled per turn against what a stable history would prefill, and what to
change. The cut is found by predictor/explain/rules.py's ``rolling_cut``, the rule ``/v1/cache/explain`` uses.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from kv_preflight.predictor.explain.rules import first_divergence, rolling_cut


class TurnRecord(msgspec.Struct, frozen=True):
    session: str
    turn: int
    model: str
    tokens: list[int]


class TurnReport(msgspec.Struct, frozen=True):
    turn: int
    tokens: int
    shared_prefix: int  # tokens at the front shared with the previous turn (0 for the first)
    prefilled: int  # tokens not covered by that prefix: what this turn recomputes at best
    stable_prefilled: int  # what it would recompute if the history had only grown
    window_cut: int | None = None  # tokens of the previous turn cut out of this one by a window


class SessionReport(msgspec.Struct, frozen=True):
    session: str
    model: str
    turns: list[TurnReport]
    kept_prefix: int  # tokens every turn starts with (BOS, system prompt)
    window_from_turn: int | None  # first turn a sliding window cut the front; None: history only grew
    tokens_prefilled: int
    tokens_prefilled_if_stable: int
    reuse: float  # shared tokens / prompt tokens over turns after the first
    advice: list[str]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    d = first_divergence(a, b)
    return min(len(a), len(b)) if d is None else d


def diagnose_session(records: Sequence[TurnRecord], *, block_size: int = 16) -> SessionReport:
    """One session's turns (any order; sorted by turn here)."""
    turns = sorted(records, key=lambda r: r.turn)
    kept = len(turns[0].tokens)
    for r in turns[1:]:
        kept = min(kept, common_prefix(turns[0].tokens, r.tokens))
    out: list[TurnReport] = []
    window_from = None
    edited_from = None
    prev: TurnRecord | None = None
    for r in turns:
        if prev is None:
            out.append(TurnReport(r.turn, len(r.tokens), 0, len(r.tokens), len(r.tokens)))
            prev = r
            continue
        shared = common_prefix(prev.tokens, r.tokens)
        cut = None
        if shared < len(prev.tokens):
            found = rolling_cut(r.tokens, prev.tokens, shared)
            if found is not None and shared <= kept + block_size:
                cut = found[0]
                window_from = r.turn if window_from is None else window_from
            elif edited_from is None:
                edited_from = r.turn
        # With a stable history this turn would start with the whole previous turn.
        stable = max(0, len(r.tokens) - len(prev.tokens)) if cut is None else \
            max(0, len(r.tokens) + cut - len(prev.tokens))
        out.append(TurnReport(r.turn, len(r.tokens), shared, len(r.tokens) - shared, stable, cut))
        prev = r
    later = out[1:]
    total = sum(t.tokens for t in later)
    reuse = sum(t.shared_prefix for t in later) / total if total else 0.0
    advice = []
    if window_from is not None:
        cuts = [t.window_cut for t in out if t.window_cut]
        advice.append(f"a sliding window cuts the front of the conversation from turn {window_from} on "
                      f"({min(cuts)}-{max(cuts)} tokens per turn): every later turn reuses only the first "
                      f"{kept} tokens; summarize old turns into a stable block instead of truncating, or cut "
                      "rarely and in large steps so several turns share a chain")
    if edited_from is not None:
        advice.append(f"turn {edited_from} rewrites earlier history (not a front cut): keep past turns byte-for-"
                      "byte identical (same whitespace, no re-rendered timestamps or reordered fields)")
    if len(turns) > 1:
        advice.append("send every turn of a session to the same pod (sticky routing, or /v1/cache/route): "
                      "the previous turn's blocks are cached only where it ran")
    return SessionReport(
        session=turns[0].session, model=turns[0].model, turns=out, kept_prefix=kept, window_from_turn=window_from,
        tokens_prefilled=sum(t.prefilled for t in out), tokens_prefilled_if_stable=sum(t.stable_prefilled for t in out),
        reuse=round(reuse, 4), advice=advice)


def diagnose_sessions(records: Iterable[TurnRecord], *, block_size: int = 16) -> list[SessionReport]:
    by_session: dict[str, list[TurnRecord]] = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    return [diagnose_session(rs, block_size=block_size) for _, rs in sorted(by_session.items())]
