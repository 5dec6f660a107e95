"""scoring/groups.py's one-pass hit for a full-attention group beside a sliding-window one (gpt-oss, Gemma 3),
one pod or a fleet at once, must give what the general rule (engines/hit_rules.longest_hit) gives."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kv_preflight.engines.hit_rules import FULL, SLIDING, GroupSpec, longest_hit
from kv_preflight.predictor.scoring.groups import GroupBits, _window_pair, group_hit

C = 16


@settings(max_examples=400, deadline=None)
@given(per=st.sampled_from([1, 2, 4]), window=st.integers(2, 200), sw_first=st.booleans(),
       prefix_keys=st.integers(0, 40), held=st.lists(st.booleans(), min_size=0, max_size=40),
       prompt_len=st.integers(1, 700), num=st.integers(0, 9))
def test_window_pair_path_equals_the_general_rule(per, window, sw_first, prefix_keys, held, prompt_len, num):
    bs = per * C
    sw, fa = (0, 1) if sw_first else (1, 0)
    groups = {sw: GroupSpec(kind=SLIDING, block_size=bs, sliding_window=window),
              fa: GroupSpec(kind=FULL, block_size=bs)}
    assert _window_pair(tuple(sorted(groups.items())), bs, C) is not None
    # the window group's bit on each request key: a block is held when its last key's bit is set
    presence = []
    for k in range(40):
        block_held = held[k // per] if k // per < len(held) else False
        presence.append({("gpu", sw): ((1 << num) if block_held else 0).to_bytes(2, "little")})
    bits = GroupBits(presence)

    def general(g: int, i: int) -> bool:
        k = (i + 1) * per - 1
        return k < prefix_keys if g == fa else bool(bits(sw, k) >> num & 1)

    assert group_hit(groups, prefix_keys, bits, num, C, bs, prompt_len) == \
        longest_hit(groups, general, prompt_len, bs)


def test_other_layouts_take_the_general_rule():
    full, window = GroupSpec(kind=FULL, block_size=32), GroupSpec(kind=SLIDING, block_size=32, sliding_window=64)
    assert _window_pair(((0, window), (1, full)), 32, C) == (0, 32, 2)
    assert _window_pair(((0, full),), 32, C) is None
    assert _window_pair(((0, window), (1, GroupSpec(kind=FULL, block_size=32, eagle=True))), 32, C) is None
    assert _window_pair(((0, GroupSpec(kind=SLIDING, block_size=64, sliding_window=64)), (1, full)), 32, C) is None
    assert _window_pair(((0, GroupSpec(kind=SLIDING, block_size=24, sliding_window=64)),
                         (1, GroupSpec(kind=FULL, block_size=24))), 24, C) is None


@settings(max_examples=300, deadline=None)
@given(per=st.sampled_from([1, 2]), window=st.integers(2, 120), prompt_len=st.integers(1, 700),
       pods=st.lists(st.tuples(st.integers(0, 40), st.lists(st.booleans(), max_size=40)), min_size=1, max_size=12))
def test_fleet_search_equals_each_pods_own(per, window, prompt_len, pods):
    """apply_groups searches a fleet's window bitmaps once for all its pods: each pod's answer is what its own
    search gives (and the general rule, above)."""
    from kv_preflight.index.entries import PodMatch
    from kv_preflight.predictor.scoring.groups import apply_groups

    bs = per * C
    groups = {0: GroupSpec(kind=SLIDING, block_size=bs, sliding_window=window), 1: GroupSpec(kind=FULL, block_size=bs)}
    presence = []
    for k in range(40):
        bitmap = sum(1 << num for num, (_, held) in enumerate(pods) if k // per < len(held) and held[k // per])
        presence.append({("gpu", 0): bitmap.to_bytes(2, "little")})
    matches = [PodMatch(f"p{num}", prefix, "gpu") for num, (prefix, _) in enumerate(pods)]
    names = {f"p{num}": num for num in range(len(pods))}
    got = apply_groups(matches, {p: groups for p in names}, {p: bs for p in names}, presence, names, C, prompt_len)
    bits = GroupBits(presence)
    want = [group_hit(groups, prefix, bits, num, C, bs, prompt_len) // C for num, (prefix, _) in enumerate(pods)]
    assert [m.blocks for m in got] == want
