"""Statements in README.md and docs/ that the code can check."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
USAGE = (REPO / "docs" / "usage.md").read_text()  # the README's reference material moved here


def test_bench_only_names_in_the_readme_are_the_valid_ones():
    from kv_preflight.cli.bench.command import ROWS

    line = next(ln for ln in USAGE.splitlines() if "kv-preflight bench [" in ln)
    assert re.search(r"--only ([a-z,]+)", line).group(1).split(",") == list(ROWS)


def test_connecting_vllm_enables_prompt_tokens_details():
    """Without it vLLM returns no cached_tokens, and accuracy/demo read every request as a miss."""
    for text in (README, USAGE):
        block = text.split("## Connecting vLLM", 1)[1].split("```")[1]
        assert "vllm serve" in block and "--enable-prompt-tokens-details" in block


def test_json_is_promised_only_where_it_exists():
    from kv_preflight.cli.env import walk
    from kv_preflight.cli.main import cli

    no_json = sorted(" ".join(p) for p, cmd in walk(cli) if p[0] == "index"
                     and not any("--json" in getattr(o, "opts", ()) for o in cmd.params))
    assert no_json == ["index export"]
    row = next(ln for ln in USAGE.splitlines() if ln.startswith("| `kv-preflight index stats"))
    assert "`--json` for scripts on all but `export`" in row


def test_benchmarks_md_says_up_and_compose_set_the_listpack_value():
    from kv_preflight.cli.valkey_server import ValkeyServer  # noqa: F401  (the args are built in its start())

    assert '"--hash-max-listpack-value", "128"' in (REPO / "kv_preflight" / "cli" / "valkey_server.py").read_text()
    assert '"--hash-max-listpack-value", "128"' in (REPO / "compose" / "docker-compose.yml").read_text()
    text = " ".join((REPO / "docs" / "benchmarks.md").read_text().split())
    assert "nor the compose stack sets it" not in text
    assert "`kv-preflight up` (cli/valkey_server.py, cli/valkey_cluster.py) and the compose stack" in text


def test_the_e2e_launcher_contract_and_the_model_are_documented():
    ops = (REPO / "docs" / "operations.md").read_text()
    assert "## End-to-end tests against a real vLLM" in ops and "KVPF_VLLM_UP" in ops
    for arg in ("--pod", "--port", "--zmq-port", "--replay-port", "--blocks", "--log", "--bind-events", "READY <http-url>"):
        assert arg in ops
    conftest = (REPO / "tests" / "e2e" / "conftest.py").read_text()
    for arg in ("--pod", "--port", "--zmq-port", "--replay-port", "--blocks", "--log", "--bind-events", "READY "):
        assert f'"{arg}' in conftest  # the contract is what the tests call
    assert "2-layer Llama" in USAGE and "KVPF_VLLM_UP" in USAGE and "KVPF_VLLM_UP" in README


def test_the_unit_tests_run_no_engine_and_usage_says_how_long_they_take():
    """Issue 42, item 9: a unit test ran vLLM's coordinator in vLLM's venv (52 s of the 1 min 49 s the unit
    tests took, while docs/usage.md said "well under a minute"). No unit test starts an engine's interpreter
    now (that one is tests/e2e/test_vllm_hit_rules.py), and usage.md gives the measured time."""
    unit = REPO / "tests" / "unit"
    venv = "vllm-cpu" + "-venv"  # (split, so this file does not name it)
    runs_vllm = [p.name for p in unit.glob("test_*.py") if venv in p.read_text()]
    assert not runs_vllm, runs_vllm
    assert "test_longest_hit_equals_vllm_live" in (REPO / "tests" / "e2e" / "test_vllm_hit_rules.py").read_text()
    assert "well under a minute" not in USAGE
    assert "scripts/test tests/unit" in USAGE and re.search(r"unit tests took \d+ min \d+ s", " ".join(USAGE.split()))
    # a count of tests drifts with every commit (it said 1,784 when there were 1,867): usage.md names none
    section = " ".join(USAGE.split("## Tests:", 1)[1].split("\n## ", 1)[0].split())
    assert not re.search(r"\d[\d,]* (unit |integration )?tests\b", section), section


def test_the_durability_page_names_tests_and_functions_that_exist():
    """docs/durability.md points each fault at one mechanism (``Class.function``) and the test proving it
    (``file.py::test``): a renamed test or function must not leave the page pointing at nothing."""
    page = (REPO / "docs" / "durability.md").read_text()
    missing = []
    named_tests = re.findall(r"`((?:tests/[\w/]+/)?\w+\.py)::(\w+)(?:\[[^\]`]*\])?`", page)
    for path, name in named_tests:
        file = REPO / path if path.startswith("tests/") else REPO / "tests" / "integration" / path
        if not file.exists() or not re.search(rf"^(async )?def {name}\(", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    source = "\n".join(p.read_text() for p in (REPO / "kv_preflight").rglob("*.py"))
    named_functions = re.findall(r"`([A-Z]\w+)\.(_?[a-z]\w*)(?:\([^`]*\))?`", page)
    for cls, name in named_functions:
        if not re.search(rf"^class {cls}\b", source, re.M) or not re.search(rf"def {name}\(", source):
            missing.append(f"{cls}.{name}")
    assert len(named_tests) >= 20 and len(named_functions) >= 10, (len(named_tests), len(named_functions))
    assert not missing, missing


def test_the_compose_predict_example_draws_no_warning():
    """The predict curl of the compose quickstart (docs/operations.md and the compose file's header, the same
    line) sends token ids the simulated engines could have made: BOS first, then bytes. Its BERT-style ids
    ([101, 2023, ...]) drew a ``missing_bos`` warning from every predictor that knew the engines' BOS."""
    from kv_preflight.predictor.explain.warnings import hints_from_probe
    from kv_preflight.predictor.explain.rules import bos_findings
    from kv_preflight.simulator import tokenizer

    def bodies(text: str) -> list[str]:
        return re.findall(r"-d '(\{[^']*\"token_ids\"[^']*\})'", text)

    ops = (REPO / "docs" / "operations.md").read_text().split("## The compose stack", 1)[1].split("\n## ", 1)[0]
    header = "\n".join(ln for ln in (REPO / "compose" / "docker-compose.yml").read_text().splitlines()
                       if ln.startswith("#"))
    assert bodies(ops) and bodies(ops) == bodies(header), (bodies(ops), bodies(header))
    body = json.loads(bodies(ops)[0])
    ids = body["token_ids"]
    hints = hints_from_probe(tokenizer.encode("a"), tokenizer.encode("b"))  # what explain learns of the engine
    assert hints.bos_id == tokenizer.BOS and hints.adds_bos
    assert bos_findings(ids, hints.bos_id, hints.adds_bos) == []
    text = tokenizer.decode(ids[1:])
    assert tokenizer.encode(text) == ids and len(ids) > 16, (text, ids)  # a prompt's tokens, a whole block and more


def test_usage_shows_the_options_a_running_stack_fills_as_optional():
    """An option whose default is the running `up` stack's (.data/env), as `explain --model` and `tokenizer check
    --model/--engine-url`, is optional: usage.md's command table shows it in brackets, not as a flag to give."""
    from kv_preflight.cli.env import walk
    from kv_preflight.cli.main import cli

    filled = {(" ".join(p), o.opts[0]) for p, cmd in walk(cli) for o in cmd.params
              if "default: the running `up` stack's" in (getattr(o, "help", None) or "")}
    assert ("explain", "--model") in filled and ("tokenizer check", "--engine-url") in filled
    shown_bare = []
    for line in USAGE.splitlines():
        m = re.match(r"\| `kv-preflight ([a-z][a-z ]*[a-z]) ([-(\[.].*?)` \|", line)
        if not m:
            continue
        synopsis = m.group(2)
        while True:  # drop every [...] group, innermost first: what is left is what the row says to give
            inner = re.sub(r"\[[^\[\]]*\]", "", synopsis)
            if inner == synopsis:
                break
            synopsis = inner
        shown_bare += [(m.group(1), flag) for flag in re.findall(r"--[a-z-]+", synopsis) if (m.group(1), flag) in filled]
    assert not shown_bare, shown_bare
