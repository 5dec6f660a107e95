"""merge_shards: a pod's prefix from the shards' per-shard answers; Unanswered: the positions no shard answered
for, and why (kv_preflight/index/cluster/lookup.py)."""
from __future__ import annotations

import random

from redis.exceptions import ConnectionError as RedisConnectionError

from kv_preflight.index.cluster import merge_shards
from kv_preflight.index.cluster.merge import Unanswered


def linear(n: int, present: list[dict[str, str]], cut: int) -> dict[str, tuple[int, str]]:
    """The linear walk over per-key presence (pod -> tier), stopping at ``cut``."""
    out = {}
    for pod in set().union(*present) if present else ():
        c = 0
        while c < min(n, cut) and pod in present[c]:
            c += 1
        if c:
            out[pod] = (c, present[c - 1][pod])
    return out


def shard_answer(idx: list[int], present: list[dict[str, str]]) -> dict[str, tuple[int, str]]:
    """What a shard's exact walk answers for its keys ``idx``."""
    out = {}
    for pod in set().union(*(present[i] for i in idx)):
        c = 0
        while c < len(idx) and pod in present[idx[c]]:
            c += 1
        if c:
            out[pod] = (c, present[idx[c - 1]][pod])
    return out


def random_layout(rng: random.Random) -> tuple[int, list[str], list[dict[str, str]], list[list[int]]]:
    """A chain of up to 29 keys, up to 5 pods each holding a key with probability 0.8 on a random tier,
    the keys dealt to 3 shards: (keys, pods, per key pod -> tier, per shard its positions)."""
    n = rng.randrange(1, 30)
    pods = [f"p{i}" for i in range(rng.randrange(1, 6))]
    present = [{p: rng.choice(["gpu", "cpu"]) for p in pods if rng.random() < 0.8} for _ in range(n)]
    owner = [rng.randrange(3) for _ in range(n)]
    return n, pods, present, [[i for i in range(n) if owner[i] == s] for s in range(3)]


def test_random_layouts_merge_to_the_linear_walk():
    rng = random.Random(7)
    for _ in range(400):
        n, pods, present, shards = random_layout(rng)
        read_whole = {i for i in range(n) if rng.random() < 0.1}
        cut = n if rng.random() < 0.7 else rng.randrange(n + 1)
        answers = [(idx, shard_answer(idx, present)) for idx in shards if idx and not set(idx) & read_whole]
        answers += [(idx, {}) for idx in shards if not idx]
        read = {i: present[i] for idx in shards if set(idx) & read_whole for i in idx}
        got, wanted = merge_shards(n, answers, read, cut)
        # tiers the merge cannot know (a shard holding the pod past its last key) it asks for; answer them
        got = {m.pod_id: (m.blocks, present[m.blocks - 1][m.pod_id] if (m.pod_id, m.blocks - 1) in wanted else m.tier)
               for m in got}
        assert got == linear(n, present, cut)


def test_a_prefix_layout_needs_no_second_read():
    present = [{"a": "gpu", "b": "cpu"}, {"a": "gpu", "b": "cpu"}, {"a": "cpu"}, {"a": "gpu"}]
    shards = [[0, 2], [1, 3]]
    got, wanted = merge_shards(4, [(idx, shard_answer(idx, present)) for idx in shards], {}, 4)
    assert sorted((m.pod_id, m.blocks, m.tier) for m in got) == [("a", 4, "gpu"), ("b", 2, "cpu")]
    assert not wanted


def shard_runs(idx: list[int], present: list[dict[str, str]]) -> dict[str, tuple[int, tuple[tuple[str, int], ...]]]:
    """What a shard's walk ("w:") answers for its keys ``idx``: per pod its count and tier runs."""
    out = {}
    for pod, (c, _) in shard_answer(idx, present).items():
        runs: list[tuple[str, int]] = []
        for j in range(c):
            tier = present[idx[j]][pod]
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, j + 1)
            else:
                runs.append((tier, j + 1))
        out[pod] = (c, tuple(runs))
    return out


def test_walked_pods_tier_runs_need_no_read():
    """A shard that walked a pod sends its tier runs: the merge finds its tier at any key it holds there,
    so it asks only for pods some shard bisected (a plain count and the tier at its last key)."""
    rng = random.Random(11)
    asked = 0
    for _ in range(400):
        n, pods, present, shards = random_layout(rng)
        walked = {p for p in pods if rng.random() < 0.5}
        answers = []
        for idx in shards:
            plain, runs = shard_answer(idx, present), shard_runs(idx, present)
            answers.append((idx, {p: runs[p] if p in walked else plain[p] for p in plain}))
        got, wanted = merge_shards(n, answers, {}, n)
        assert not {pod for pod, _ in wanted} & walked
        asked += len(wanted)
        got = {m.pod_id: (m.blocks, present[m.blocks - 1][m.pod_id] if (m.pod_id, m.blocks - 1) in wanted else m.tier)
               for m in got}
        assert got == linear(n, present, n)
        skipped, _ = merge_shards(n, answers, {}, n, skip=walked)
        assert {m.pod_id for m in skipped} == set(got) - walked
    assert asked  # the bisected pods did need reads: the runs are what spares the walked ones


def test_a_shard_that_holds_nobody_at_its_first_key_sent_all_a_walk_needs():
    """lookup_bits.lua's replies (kv_preflight/index/presence.py BitsReply): its keys' bitmaps (kind 0), or no pod
    at its first key (kind 1 naming none: every prefix ends there) let the cluster walk the chain once, group
    bitmaps included; a bisection (kind 1 naming pods), a moved key or "whole" (kind 2) do not."""
    from kv_preflight.index.cluster.merge import sent_bitmaps
    from kv_preflight.index.presence import parse_bits_reply

    assert sent_bitmaps(parse_bits_reply([0, 0, 0, "", 0, "gpu", b"\x03", "", ""]))
    assert sent_bitmaps(parse_bits_reply([0, 0, 1, "", 0]))  # nobody at its first key
    assert sent_bitmaps(parse_bits_reply([1, 0, 1, "", 0]))  # its first key of a foreign type: a miss
    assert not sent_bitmaps(parse_bits_reply([0, 0, 1, "", 0, 3, 7, "gpu"]))  # pod 3 bisected: 7 keys
    assert not sent_bitmaps(parse_bits_reply([0, 1, 1, "", 0]))  # a key moved away: read through the routing
    assert not sent_bitmaps(parse_bits_reply([0, 0, 2, "", 0]))  # entries not ours


def test_unanswered_keeps_the_first_reason_and_says_it_when_no_shard_answered():
    """A lookup no shard answered raises an error that says what the first silent shard said (a timeout on a
    loaded host reads differently from a refused connection), not only that they were silent."""
    u = Unanswered()
    assert not u.none_answered(2)  # everything answered
    u.note([0], TimeoutError())
    assert not u.none_answered(2)  # a lower bound from key 0, not an error
    u.note([1], ConnectionRefusedError(111, "Connection refused"))
    assert u.none_answered(2) and sorted(u) == [0, 1]
    assert str(u.error()) == "no shard of the cluster answered the lookup (TimeoutError)"
    v = Unanswered()
    v.note([0, 1], "no node serves their slots")
    assert str(v.error()) == "no shard of the cluster answered the lookup (no node serves their slots)"
    w = Unanswered()
    w.note([0], RedisConnectionError("Connection reset by peer"))
    assert "(ConnectionError: Connection reset by peer)" in str(w.error())
