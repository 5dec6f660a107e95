"""The bitmap walk (kv_preflight/index/presence.py) against the pure linear walk over llm-d's entries
(entries.longest_prefix), on random layouts: gaps, tiers, pods filters, unnamed numbers."""
from __future__ import annotations

import random

import pytest

from kv_preflight.index.entries import encode_entry, longest_prefix, make_entry
from kv_preflight.index import presence
from kv_preflight.index.presence import numbers, parse_bits_reply, prefix_from_bits, tier_in, tier_in_runs


def bitmap(nums: set[int]) -> bytes:
    """Bit n: byte n // 8, value 1 << n % 8 (what kv_preflight/index/lua/changes.lua writes), trailing zeros trimmed."""
    out = bytearray((max(nums) // 8 + 1) if nums else 0)
    for n in nums:
        out[n // 8] |= 1 << n % 8
    return bytes(out)


def layout(rng: random.Random):
    """Per key: pod -> tiers held; pod names and numbers (sparse, as after forgotten pods)."""
    pods = [f"pod-{i}" for i in range(rng.choice([1, 3, 20, 200]))]
    nums = dict(zip(pods, rng.sample(range(3 * len(pods) + 5), k=len(pods))))
    keys = rng.choice([1, 2, 9, 64])
    held: list[dict[str, set[str]]] = [{} for _ in range(keys)]
    for pod in pods:
        end = rng.randint(0, keys)
        for i in range(end):
            if rng.random() < 0.93:  # gaps
                held[i][pod] = set(rng.sample(["gpu", "cpu", "disk"], k=rng.choice([1, 1, 1, 2])))
    return pods, nums, held


@pytest.mark.parametrize("seed", range(200))
def test_bitmaps_walk_as_the_entries_do(seed):
    rng = random.Random(seed)
    pods, nums, held = layout(rng)
    names = {n: p for p, n in nums.items()}
    fields = [[encode_entry(make_entry(p, t.upper(), 0)) for p, ts in at.items() for t in ts] for at in held]
    per_key = []
    for at in held:
        tiers: dict[str, set[int]] = {}
        for p, ts in at.items():
            for t in ts:
                tiers.setdefault(t, set()).add(nums[p])
        per_key.append({t: bitmap(ns) for t, ns in tiers.items()})
    want = sorted((m.pod_id, m.blocks, m.tier) for m in longest_prefix(fields))
    assert sorted((m.pod_id, m.blocks, m.tier) for m in prefix_from_bits(per_key, names)) == want
    asked = rng.sample(pods, k=max(1, len(pods) // 3))
    want = sorted((m.pod_id, m.blocks, m.tier) for m in longest_prefix(fields, asked))
    wanted = {n: p for n, p in names.items() if p in asked}
    assert sorted((m.pod_id, m.blocks, m.tier) for m in prefix_from_bits(per_key, names, wanted)) == want


@pytest.mark.parametrize("seed", range(200))
def test_one_tier_per_key_walks_in_c_as_the_entries_do(seed):
    """Keys with one tier each (the common case) take the C walk (_speedups.prefix_matches): it must equal the
    entries' walk too, with gaps, pods that stop anywhere, a key nobody holds, sparse and wide numbers."""
    rng = random.Random(1000 + seed)
    n_pods = rng.choice([1, 2, 9, 300, 1000])
    pods = [f"pod-{i}" for i in range(n_pods)]
    nums = dict(zip(pods, rng.sample(range(n_pods + rng.choice([0, 7, 5000])), k=n_pods)))
    names = {n: p for p, n in nums.items()}
    keys = rng.choice([1, 2, 17, 256])
    tier_at = [rng.choice(["gpu", "gpu", "cpu"]) for _ in range(keys)]
    held: list[set[str]] = [set() for _ in range(keys)]
    for pod in pods:
        for i in range(rng.randint(0, keys)):
            if rng.random() < 0.97:
                held[i].add(pod)
    per_key = [{tier_at[i]: bitmap({nums[p] for p in at})} if at else {} for i, at in enumerate(held)]
    assert presence._one_tier(per_key, keys) is not None or presence._speedups is None
    fields = [[encode_entry(make_entry(p, tier_at[i].upper(), 0)) for p in at] for i, at in enumerate(held)]
    want = sorted((m.pod_id, m.blocks, m.tier) for m in longest_prefix(fields))
    assert sorted((m.pod_id, m.blocks, m.tier) for m in prefix_from_bits(per_key, names)) == want
    # the single node's path: the script's reply read as two lists, to the first key nobody holds
    reply: list = [0, 0, 0, b"e", 0]
    for i, bits in enumerate(per_key):
        reply += [tier_at[i].encode(), bits[tier_at[i]]] if bits else [b"", b""]
        if not bits and i > 0:
            break
    if held[0] and presence._speedups is not None:
        tiers, maps = presence.one_tier_reads(reply)
        assert sorted((m.pod_id, m.blocks, m.tier) for m in presence.prefix_of_one_tier(tiers, maps, names)) == want
        # a cluster's: the keys dealt to three shards, each sending its own keys to its first one nobody holds
        owner = [rng.randrange(3) for _ in range(keys)]
        parts = []
        for shard in range(3):
            idx = [i for i in range(keys) if owner[i] == shard]
            sent = []
            for j, i in enumerate(idx):
                sent.append(i)
                if not per_key[i] and j > 0:
                    break
            flat = ([tier_at[i].encode() if per_key[i] else b"" for i in sent],
                    [per_key[i][tier_at[i]] if per_key[i] else b"" for i in sent])
            parts.append((sent, flat))
        tiers, maps = presence.chain_of_one_tier(keys, parts)
        assert sorted((m.pod_id, m.blocks, m.tier) for m in presence.prefix_of_one_tier(tiers, maps, names)) == want
        cut = rng.randint(0, keys)
        got = sorted((m.pod_id, m.blocks, m.tier) for m in presence.prefix_of_one_tier(tiers, maps, names, cut))
        assert got == sorted((m.pod_id, min(m.blocks, cut), m.tier) for m in longest_prefix(fields[:cut]))
    cut = rng.randint(0, keys)
    want = sorted((m.pod_id, min(m.blocks, cut), m.tier) for m in longest_prefix(fields[:cut]))
    got = sorted((m.pod_id, m.blocks, m.tier) for m in prefix_from_bits(per_key, names, cut=cut))
    assert got == want


def test_a_cut_makes_every_prefix_a_lower_bound():
    names = {0: "a", 9: "b"}
    per_key = [{"gpu": bitmap({0, 9})}] * 5
    assert sorted((m.pod_id, m.blocks) for m in prefix_from_bits(per_key, names, cut=2)) == [("a", 2), ("b", 2)]
    assert prefix_from_bits(per_key, names, cut=0) == []


def test_unnamed_numbers_never_count():
    per_key = [{"gpu": bitmap({0, 5})}, {"gpu": bitmap({0, 5})}]
    assert [(m.pod_id, m.blocks) for m in prefix_from_bits(per_key, {0: "a"})] == [("a", 2)]


def test_the_scripts_two_answers_parse():
    # kind 0: two elements a key: one field's name and bitmap; several fields flat and ""; nobody "" and "".
    # A hybrid model's other groups' fields ("<tier>|<group>") are no part of the prefix: they go to `groups`.
    walked = parse_bits_reply([2, 0, 0, b"e1", 0, b"gpu", b"\x01", [b"gpu", b"\x01", b"cpu", b"\x02", b"gpu|1", b"\x04"],
                               b"", b"", b""])
    assert (walked.foreign, walked.moved, walked.kind, walked.epoch, walked.reads) == (
        2, False, 0, "e1", [{"gpu": b"\x01"}, {"gpu": b"\x01", "cpu": b"\x02"}, {}])
    assert walked.groups == [{}, {("gpu", 1): b"\x04"}, {}]
    bisected = parse_bits_reply([0, 1, 1, b"", 1, 7, 40, b"cpu", 9, 3, b"gpu"])
    assert bisected.moved and bisected.counts == [(7, 40, "cpu"), (9, 3, "gpu")] and bisected.epoch == ""
    assert bisected.walked == 1  # pods walked key by key (orphan keys), not bisected
    assert parse_bits_reply([0, 0, 2, b"", 0]).kind == 2
    # only a kind-0 reply whose every key has one tier (or none) is read as two lists
    assert presence.one_tier_reads([2, 0, 0, b"e1", 0, b"gpu", b"\x01", [b"gpu", b"\x01", b"cpu", b"\x01"], b""]) is None
    assert presence.one_tier_reads([2, 0, 0, b"e1", 0, b"gpu|1", b"\x01"]) is None  # another group: not a prefix
    assert presence.one_tier_reads([0, 1, 1, b"", 1, 7, 40, b"cpu"]) is None
    if presence._speedups is not None:
        assert presence.one_tier_reads([0, 0, 0, b"", 0, b"gpu", b"\x03", b"", b""]) == ([b"gpu", b""], [b"\x03", b""])


def test_a_walked_pods_tier_runs_parse():
    """A cluster shard's walk ("w:") sends a walked pod's tier runs where its tier changes along its keys."""
    r = parse_bits_reply([0, 0, 1, b"", 2, 7, 40, [b"gpu", 10, b"cpu", 40], 9, 3, b"gpu"])
    assert r.counts == [(7, 40, "cpu"), (9, 3, "gpu")]  # the tier at the last key, as for any pod
    assert r.runs == {7: (("gpu", 10), ("cpu", 40))}
    assert [tier_in_runs(r.runs[7], j) for j in (0, 9, 10, 39)] == ["gpu", "gpu", "cpu", "cpu"]


def test_a_pods_tier_at_one_key_from_its_bitmaps():
    bits = {"cpu": bitmap({0, 1}), "gpu": bitmap({1, 2}), "disk": bitmap({0, 3})}
    assert [tier_in(bits, num) for num in range(5)] == ["cpu", "gpu", "gpu", "disk", None]


def test_numbers_are_the_set_bits():
    assert numbers(0) == [] and numbers(0b101001) == [0, 3, 5] and numbers(1 << 999) == [999]


def test_the_c_walk_refuses_what_it_cannot_name():
    if presence._speedups is None:
        pytest.skip("no C extension")
    from kv_preflight.index.entries import PodMatch

    with pytest.raises(ValueError):  # a pod held through key 2 needs a tier at key 2
        presence._speedups.prefix_matches([b"\x01", b"\x01"], 2, {0: "a"}, ["gpu"], PodMatch)
    with pytest.raises(TypeError):
        presence._speedups.prefix_matches([b"\x01", "x"], 2, {0: "a"}, ["gpu", "gpu"], PodMatch)
    assert presence._speedups.prefix_matches([b"\x03", b"\x01"], 2, {1: "b"}, ["gpu", "cpu"], PodMatch) == [
        PodMatch("b", 1, "gpu")]  # number 0 has no name: left out


@pytest.mark.parametrize("num", [0, 6, 7, 8, 15, 127, 128, 1000])
def test_a_pods_own_value_is_the_bytes_its_bit_reads_as(num):
    """changes.lua's fast ops write ``mine(num)`` whole and compare against it, so it must be exactly the
    presence value of that bit alone, as bytes (a str would leave as UTF-8: bit 7 as two bytes)."""
    from kv_preflight.index.changes import mine

    assert isinstance(mine(num), bytes)
    assert presence.presence_value(mine(num)) == (1, bitmap({num}))
    assert numbers(presence.as_int(presence.presence_value(mine(num))[1])) == [num]


def test_an_entry_and_a_bit_that_move_together_are_one_command_each():
    from kv_preflight.index.changes import key_ops, mine

    assert key_ops(11, "F", 1, "gpu", 1, 9) == ["E", 11, "F", "B", "kvpf:{11}", "gpu", mine(9)]
    assert key_ops(11, "F", -1, "gpu", -1, 9) == ["e", 11, "F", "b", "kvpf:{11}", "gpu", mine(9)]
    assert key_ops(11, "F", 1, "", 0, 9) == ["E", 11, "F"]  # an entry no bit stands for (speculative)
    # an entry two groups share (llm-d v0.8 entries): the general form, whose count follows the entry
    assert key_ops(11, "F", 0, "gpu|1", 1, 9) == ["K", 11, "kvpf:{11}", "F", 0, "gpu|1", 1, 2, 2]


def test_split_fields_is_bits_of_and_group_bits_of_in_one_pass():
    from kv_preflight.index.presence import bits_of, group_bits_of, split_fields

    flat = [b"gpu", b"\x01", b"gpu|1", b"\x02", "cpu", b"\x04", b"cpu|0", b"\x08", b"gpu|x", b"\x10"]
    assert split_fields(flat) == (bits_of(flat), group_bits_of(flat))
    assert split_fields([]) == ({}, {})


def test_one_tier_of_reads_walks_like_prefix_from_bits():
    """A hybrid fleet's keys, their other groups' fields set apart, one tier each: the C walk over them gives
    what the Python walk gives."""
    import random

    from kv_preflight.index.presence import one_tier_of_reads, prefix_from_bits, prefix_of_one_tier

    rng = random.Random(4)
    names = {n: f"pod-{n}" for n in range(40)}
    lengths = {n: rng.randrange(0, 30) for n in names}
    reads = []
    for k in range(30):
        bitmap = sum(1 << n for n, length in lengths.items() if k < length)
        reads.append({rng.choice(["gpu", "cpu"]): bitmap.to_bytes(5, "little")} if bitmap else {})
    flat = one_tier_of_reads(reads)
    if flat is None:  # no C extension in this build
        return
    key = lambda m: m.pod_id
    assert sorted(prefix_of_one_tier(*flat, names), key=key) == sorted(prefix_from_bits(reads, names), key=key)
    assert one_tier_of_reads([{"gpu": b"\x01", "cpu": b"\x02"}]) is None


def test_a_clusters_group_bitmaps_come_back_in_chain_order_as_far_as_the_longest_prefix():
    """Each shard's other-group bitmaps (``BitsReply.groups``, on its keys' chain positions) put back in chain
    order, exactly as far as the longest prefix reaches: past it no group's rule reads, and a shard's keys past
    its first empty one were never sent (they read as held by no other group)."""
    from kv_preflight.index.presence import chain_group_bits

    rng = random.Random(11)
    for _ in range(200):
        n = rng.randrange(1, 40)
        truth = [{(rng.choice(["gpu", "cpu"]), g): bitmap({rng.randrange(20)}) for g in (1, 2) if rng.random() < 0.5}
                 for _ in range(n)]
        owner = [rng.randrange(3) for _ in range(n)]
        shards = [[i for i in range(n) if owner[i] == s] for s in range(3)]
        longest = rng.randrange(n + 1)
        # a shard sends its keys up to one of them past the longest prefix (its first empty key), no further
        parts = []
        for idx in shards:
            stop = next((j for j, i in enumerate(idx) if i >= longest and rng.random() < 0.5), len(idx))
            parts.append((idx[:stop + 1], [truth[i] for i in idx[:stop + 1]]))
        got = chain_group_bits(parts, longest)
        assert got == truth[:longest]
        assert all(a is not b for a, b in zip(got, truth))  # each key's mapping is its own
    assert chain_group_bits([], 3) == [{}, {}, {}]
    assert chain_group_bits([([0, 2], [{("gpu", 1): b"\x01"}, {("gpu", 1): b"\x02"}])], 2) == [{("gpu", 1): b"\x01"}, {}]
