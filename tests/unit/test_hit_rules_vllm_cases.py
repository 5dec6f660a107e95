"""kv_preflight/engines/hit_rules.py against vLLM 0.32 itself: every case in
tests/fixtures/vllm-0.32-hit-cases.json was answered by vLLM's own coordinator and managers
(tests/fixtures/build_hit_cases.py, run under vLLM's venv), over full attention, sliding windows, chunked local
attention and Mamba, alone and mixed, with and without EAGLE. The rule must give vLLM's tokens on every case, and
so must the scoring path (predictor/scoring/groups.py) where a pod's full-attention group is its prefix group.
Fresh random cases answered by vLLM's coordinator at run time: tests/e2e/test_vllm_hit_rules.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kv_preflight.engines.hit_rules import FULL, KIND_NAMES, GroupSpec, longest_hit
from kv_preflight.index.entries import PodMatch
from kv_preflight.predictor.scoring.groups import apply_groups

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-0.32-hit-cases.json"
DATA = json.loads(FIXTURE.read_text())
BS = DATA["block_size"]
CASES = DATA["cases"]


def specs(case: dict) -> dict[int, GroupSpec]:
    return {i: GroupSpec(KIND_NAMES[g["kind"]], BS, g["window"], g["chunk"], g["eagle"])
            for i, g in enumerate(case["groups"])}


def case_id(i: int) -> str:
    return f"{i}-{CASES[i]['layout']}-eagle-{CASES[i]['eagle']}"


def test_the_cases_cover_every_layout_with_and_without_eagle():
    variants = {(c["layout"], c["eagle"]) for c in CASES}
    layouts = {c["layout"] for c in CASES}
    assert {"full+swa", "full+swa+swa(same)", "full+swa5+swa9", "swa+swa", "full+chunked", "full+mamba",
            "full+swa+mamba", "full", "swa", "mamba", "chunked"} <= layouts
    for layout in layouts - {"full+chunked", "full+chunked+chunked", "chunked"}:  # vLLM refuses EAGLE + chunked
        assert {(layout, "none"), (layout, "all")} <= variants
    assert len(CASES) >= 300
    assert any(c["hit"] for c in CASES) and any(not c["hit"] for c in CASES)


@pytest.mark.parametrize("i", range(len(CASES)), ids=case_id)
def test_longest_hit_equals_vllm(i):
    case = CASES[i]
    held = [set(h) for h in case["held"]]
    got = longest_hit(specs(case), lambda g, b: b in held[g], case["prompt_tokens"], BS)
    assert got == case["hit"], case


SCORED = [i for i, c in enumerate(CASES) if len(c["groups"]) > 1 and c["groups"][0]["kind"] == "full_attention"]


@pytest.mark.parametrize("i", SCORED, ids=case_id)
def test_scoring_path_equals_vllm(i):
    """A pod's answer through apply_groups (the one-pass window search where it applies, else the general rule):
    its prefix is its full-attention group's run, the other groups' blocks are their bits on each request key
    (one request key a block here)."""
    case = CASES[i]
    groups = specs(case)
    assert groups[0].kind == FULL
    held = [set(h) for h in case["held"]]
    num = 3
    presence = [{("gpu", g): ((1 << num) if k in held[g] else 0).to_bytes(1, "little") for g in range(1, len(held))}
                for k in range(max((max(h, default=-1) for h in held), default=-1) + 1)]
    match = PodMatch("pod", len(held[0]), "gpu")
    (got,) = apply_groups([match], {"pod": groups}, {"pod": BS}, presence, {"pod": num}, BS, case["prompt_tokens"])
    assert got.blocks * BS == case["hit"], case
