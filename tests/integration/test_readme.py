"""Every command in README.md's code blocks, run against a live stack.

The README's first command starts the stack (`kv-preflight up --demo`, what `scripts/up --demo` runs
after its set-up, on free ports through KVPF_PORT and KVPF_DATA_DIR); every curl and command is then run
as printed, with localhost:8080 pointed at that stack. A command that cannot run here is in SKIPPED with
the reason; a command that is in neither table fails the test, so a new README command is run or
explicitly skipped, never silently unchecked. The curls `up` prints are run too ("a curl that works as
printed").
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.integration.up_procs import reaped

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# Pages whose sample /v1/cache/predict answer must have a live answer's fields (they lacked `freshness`).
SAMPLE_PAGES = (README, REPO / "docs" / "api.md")

# Fenced blocks that hold no shell commands, by their first line.
NOT_SHELL = {
    " write path                                              read path": "the architecture diagram",
}
# Commands that start the stack the others run against.
STACK = "scripts/up --demo"
# Commands run against the stack as printed (localhost:8080 pointed at it): how each one's answer is checked.
ANSWER = "You are a support assistant of a bookshop. Answer briefly and politely. Customer question: where is my order placed on Monday last week?"
RUN = {
    ". .data/env": "source",
    "curl -s $KVPF_STACK_ENGINE_0/v1/completions -H 'content-type: application/json' -d '{\"model\": \"sim-model\", "
    "\"prompt\": \"You are a support assistant of a bookshop. Answer briefly and politely. Customer question: where is "
    "my order placed?\", \"max_tokens\": 1}'": "completion",
    "curl -s $KVPF_STACK_ENGINE_1/v1/completions -H 'content-type: application/json' -d '{\"model\": \"sim-model\", "
    "\"prompt\": \"You are a support assistant of a bookshop. Answer in one word.\", \"max_tokens\": 1}'": "completion",
    "curl -s localhost:8080/v1/cache/predict -H 'content-type: application/json' -d '{\"model\": \"sim-model\", "
    f"\"prompt\": \"{ANSWER}\"}}'": "the sample",
    f'.venv/bin/kv-preflight predict --prompt "{ANSWER}"': "cli prediction",
}
# Fields of the sample answer that differ from run to run: time since the ingester was last current, and since the
# engine's last batch (present once the pod's ingester has reported that batch in its lease, within a second).
TIMING = ("staleness_ms", "index_lag_ms")
SKIPPED = {
    "scripts/test": "runs the whole test suite, this test included",
    "vllm serve MODEL --enable-prefix-caching --enable-prompt-tokens-details --kv-events-config "
    "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\"replay_endpoint\":"
    "\"tcp://*:5558\",\"topic\":\"kv@POD@MODEL\"}'": "a real vLLM; the e2e tests start one through KVPF_VLLM_UP",
    "kv-preflight ingest --valkey-url redis://valkey:6379/0 --engine http://POD:8000":
        "a deployment's host names (valkey, POD); `up` runs the same ingest against its engines",
}


def readme_commands(text: str) -> list[str]:
    """Each shell command of each fenced block (continuation lines joined); in a transcript, the $ lines."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        lines = body.splitlines()
        if lang == "json" or not lines or lines[0] in NOT_SHELL:
            continue
        joined = re.sub(r"\\\n\s*", "", body).splitlines()
        if any(line.startswith("$ ") for line in joined):
            joined = [line[2:] for line in joined if line.startswith("$ ")]
        out += [" ".join(line.split()) for line in joined if line.strip()]
    return out


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    cmds = readme_commands(README.read_text())
    unclassified = [c for c in cmds if c != STACK and c not in RUN and c not in SKIPPED]
    assert not unclassified, f"README commands neither run nor skipped by tests/integration/test_readme.py: {unclassified}"
    stale = [c for c in [*RUN, *SKIPPED] if c not in cmds]
    assert not stale, f"no longer in README.md: {stale}"
    assert STACK in cmds


def _check_prediction(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert "error" not in body and isinstance(body["predicted_cached_tokens"], int), body
    return body


def sample_answers(page: Path) -> list[dict]:
    """The page's sample predict answers: its json blocks that hold ``predicted_cached_tokens``."""
    blocks = re.findall(r"^```json\n(.*?)^```", page.read_text(), re.S | re.M)
    return [json.loads(b) for b in blocks if '"predicted_cached_tokens"' in b]


def test_the_sample_answers_are_json():
    """A sample that no longer parses could not be compared with a live answer below."""
    for page in SAMPLE_PAGES:
        assert sample_answers(page), f"{page.name} has no sample predict answer to compare"


def assert_samples_match(live: dict) -> None:
    """Each page's sample answer has exactly a live answer's top-level fields, so none can drift again (the
    samples lacked ``freshness``, which every answer carries)."""
    for page in SAMPLE_PAGES:
        for sample in sample_answers(page):
            assert sorted(sample) == sorted(live), f"{page.name}'s sample answer: {sorted(sample)} vs live {sorted(live)}"


def without_timing(answer: dict) -> dict:
    """The answer with its timing fields' values blanked (their presence kept)."""
    out = json.loads(json.dumps(answer))
    for fresh in (out.get("freshness") or {}).get("pods", {}).values():
        for name in TIMING:
            if name in fresh:
                fresh[name] = "..."
    return out


def test_readme_commands_run_against_a_live_stack(tmp_path):
    """Issue 42, item 4: the README's "One answer" curls could not reproduce the answer shown (the first sent
    10 tokens, under one block; the 137-token prompt behind it was never given). Now each command of the README
    runs as printed, in order, in one shell per command from the directory `up` runs in (`. .data/env` first),
    and the predict curl answers exactly the README's sample, timing fields aside."""
    port = free_port()
    with reaped(tmp_path) as marked:  # the stack, even if a step fails half-way
        env = dict(marked, KVPF_PORT=str(port), KVPF_WORKERS="1")
        for name in [k for k in env if k.startswith("KVPF_") and k not in ("KVPF_PORT", "KVPF_WORKERS")]:
            if name != "KVPF_TEST_STACK":
                del env[name]
        log = tmp_path / "up.out"
        # STACK as scripts/up runs it after `scripts/setup` (which installs .venv and valkey-server), from a
        # directory of its own: its ./.data is what the README's commands read
        (tmp_path / ".venv").symlink_to(REPO / ".venv")
        args = [sys.executable, "-m", "kv_preflight", "up", *STACK.split()[1:]]
        with open(log, "w") as fh:
            up = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while "Ctrl-C stops everything" not in log.read_text():
                assert up.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            printed = log.read_text()
            assert "12/12 predictions exact" in printed and f"127.0.0.1:{port}" in printed
            (sample,) = sample_answers(README)
            shell = {k: v for k, v in env.items() if not k.startswith("KVPF_")}
            ran = set()
            for cmd in readme_commands(README.read_text()):
                if cmd not in RUN:
                    continue
                check = RUN[cmd]
                ran.add(cmd)
                script = (". .data/env; " if "$KVPF_" in cmd else "") + cmd.replace("localhost:8080", f"127.0.0.1:{port}")
                deadline = time.monotonic() + 30
                while True:
                    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                                         cwd=tmp_path, env=shell)
                    assert out.returncode == 0, (cmd, out.stdout, out.stderr)
                    if check != "the sample":
                        break
                    live = json.loads(out.stdout)
                    if without_timing(live) == without_timing(sample) or time.monotonic() > deadline:
                        break
                    time.sleep(0.3)  # the engines' events are being applied, the leases renewed
                if check == "completion":
                    assert json.loads(out.stdout)["usage"]["prompt_tokens"] > 0, out.stdout
                elif check == "the sample":
                    assert without_timing(live) == without_timing(sample), (live, sample)
                    assert_samples_match(live)
                elif check == "cli prediction":
                    assert out.stdout.startswith("model sim-model: 112 of 137 tokens cached on sim-0"), out.stdout
                else:
                    assert check == "source" and not out.stderr, out.stderr
            assert ran == set(RUN), f"README commands not run: {set(RUN) - ran}"
            # "prints the URLs and a curl that works as printed"
            shown = re.findall(r"^\s+(curl .*?)(?=^\s+curl |^\s+\(|\Z)", printed.split("try:", 1)[1], re.S | re.M)
            assert len(shown) == 2, printed
            for cmd in shown:
                out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)
                assert out.returncode == 0 and "error" not in json.loads(out.stdout), out.stdout + out.stderr
            os.killpg(up.pid, signal.SIGINT)
            assert up.wait(timeout=120) == 0
        finally:
            if up.poll() is None:
                os.killpg(up.pid, signal.SIGKILL)
        assert log.read_text().rstrip().endswith("stopped."), log.read_text()
