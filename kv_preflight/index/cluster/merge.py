"""Valkey Cluster: the shards' answers to one lookup made one (pure). Which chain positions no shard answered
(``Unanswered``), whether a shard's first round says all a walk needs (``sent_bitmaps``), whether a pod may be
bisected (``pod_bisectable``), and each pod's prefix from every shard's answer (``merge_shards``: it ends at the
first key any shard lacks it on). kv_preflight/index/cluster/lookup.py asks the shards; tests/unit/test_cluster_merge.py
and test_gap_rules.py test these alone."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from kv_preflight.index.entries import PodMatch, text
from kv_preflight.index.presence import BitsReply, TierRuns, tier_in_runs


class Unanswered(set):
    """The chain positions no shard answered for, and why the first of them was not: the error a lookup
    raises when none answered says what the shards said (a timeout on a loaded host, a connection refused),
    not only that they were silent."""

    why = ""

    def note(self, positions: Iterable[int], why: BaseException | str) -> None:
        self.update(positions)
        if not self.why:
            self.why = why if isinstance(why, str) else (f"{type(why).__name__}: {why}" if str(why)
                                                          else type(why).__name__)

    def none_answered(self, n_keys: int) -> bool:
        return bool(self) and len(self) == n_keys

    def error(self) -> RedisConnectionError:
        return RedisConnectionError(f"no shard of the cluster answered the lookup ({self.why or 'no reason given'})")


def sent_bitmaps(res: BitsReply) -> bool:
    """Whether a shard's round-1 reply says all a walk needs of its keys (pure): their bitmaps (kind 0), or that
    no pod holds its first key in its prefix group (kind 1 naming no pod: every prefix ends at or before that
    key, so none of its keys is walked past, nor read by a group's rule, which stops where the prefix does)."""
    return res.kind == 0 or (res.kind == 1 and not res.counts and not res.moved)


def pod_bisectable(meta: Sequence[Any], outbox: Iterable[Any]) -> bool:
    """Whether a lookup may bisect a pod, from its meta ``HMGET orphan_keys gap_entry orphan_at batches`` and
    its outbox's fields (pure): its keys are closed under "parent" now (orphan count known and 0, written at
    the pod's last batch: a writer of an earlier build keeps no count), and no outbox entry is left from a
    step taken while they were not (entries are numbered in order; "gap_entry" is the last such one), so
    every version of the pod a shard may show is closed too."""
    count, gap_entry, at, batches = (text(v) if v is not None else None for v in meta)
    if count != "0" or at != (batches or "0"):
        return False
    if not gap_entry:
        return True
    last = int(gap_entry)
    return all(int(text(f).split("|", 1)[0]) > last for f in outbox)


def merge_shards(n: int, shards: Sequence[tuple[list[int], Mapping[str, tuple[int, str | TierRuns]]]],
                 read: dict[int, dict[str, str]], cut: int, skip: Container[str] = ()
                 ) -> tuple[list[PodMatch], set[tuple[str, int]]]:
    """Per pod, its prefix of an ``n``-key chain from the shards' answers (pure).

    ``shards``: per shard, the chain positions of its keys (ascending) and, per pod, how many of them it
    holds from the first and its tier at the last of those, or its tier runs along them (a walked pod:
    ``TierRuns``); ``read``: keys read whole (position -> pod -> tier); ``cut``: the first position
    nobody answered for; ``skip``: pods left out. A pod's prefix ends at the first position where some
    source lacks it: a shard at the key after its count (at its first key if the shard does not name the
    pod), a key read whole that does not list it, or ``cut``. Its tier is that of the source holding its
    last key; when that source is a shard whose count runs past it with no runs (only if a pod's keys
    are not a prefix, e.g. a batch half applied) the pair (pod, position) is returned, to be read whole.
    """
    pods: set[str] = set()
    for _, held in shards:
        pods.update(held)
    for at in read.values():
        pods.update(at)
    pods.difference_update(skip)
    missing = sorted(read)
    out: list[PodMatch] = []
    tiers_wanted: set[tuple[str, int]] = set()
    for pod in pods:
        end = cut
        for idx, held in shards:
            c = held.get(pod, (0, ""))[0]
            if c < len(idx) and idx[c] < end:
                end = idx[c]
        for i in missing:
            if i >= end:
                break
            if pod not in read[i]:
                end = i
                break
        if end <= 0:
            continue
        last = end - 1
        tier = read.get(last, {}).get(pod)
        if tier is None:
            for idx, held in shards:
                c, t = held.get(pod, (0, ""))
                j = bisect_left(idx, last, 0, c)
                if j < c and idx[j] == last:  # this shard owns `last`
                    if not isinstance(t, str):  # a walked pod's runs: its tier at every key it holds here
                        tier = tier_in_runs(t, j)
                    else:
                        tier = t
                        if j != c - 1:  # and holds the pod past it: not a prefix, its tier there is unknown
                            tiers_wanted.add((pod, last))
                    break
        out.append(PodMatch(pod, end, tier or "gpu"))
    return out, tiers_wanted


__all__ = ["Unanswered", "merge_shards", "pod_bisectable", "sent_bitmaps"]
