"""kv_preflight/engines/hit_rules.py against vLLM 0.32's coordinator now, on random cases: the generator
(tests/fixtures/build_hit_cases.py) runs under vLLM's own venv with a seed per run, vLLM's managers answer each
case, and the rule must give their tokens. The frozen cases (tests/unit/test_hit_rules_vllm_cases.py) run
everywhere; this one needs vLLM installed (about a minute: it imports vLLM and runs its coordinator), so it
is an end-to-end test. KVPF_VLLM_PYTHON names that venv's python (default: where vllm-cpu/up.sh installs it).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from kv_preflight.engines.hit_rules import longest_hit
from tests.unit.test_hit_rules_vllm_cases import BS, FIXTURE, specs

pytestmark = pytest.mark.e2e

VLLM_PYTHON = Path(os.environ.get("KVPF_VLLM_PYTHON") or "/root/.cache/vllm-cpu-venv/bin/python")


def test_longest_hit_equals_vllm_live():
    """Other random cases, answered by vLLM's coordinator now (the generator under vLLM's venv, a seed per run)."""
    if not VLLM_PYTHON.exists():
        reason = f"vLLM's venv is not on this machine ({VLLM_PYTHON}; KVPF_VLLM_PYTHON names it): the frozen cases still run"
        if os.environ.get("KVPF_REQUIRE_E2E") == "1" and os.environ.get("KVPF_VLLM_UP"):
            pytest.fail(reason + " but KVPF_REQUIRE_E2E=1 and KVPF_VLLM_UP is set")
        pytest.skip(reason)
    seed = random.randrange(1 << 30)
    out = subprocess.run([str(VLLM_PYTHON), str(FIXTURE.parent / "build_hit_cases.py"), "--seed", str(seed),
                          "--per-variant", "40"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for case in json.loads(out.stdout)["cases"]:
        held = [set(h) for h in case["held"]]
        got = longest_hit(specs(case), lambda g, b: b in held[g], case["prompt_tokens"], BS)
        assert got == case["hit"], (seed, case)
