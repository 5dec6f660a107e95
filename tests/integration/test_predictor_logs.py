"""What a real `serve` process logs: one start-up line per dependency
(Valkey, each engine, each model's tokenizer) with its state, also when it is down; routine scrapes
write nothing unless an engine's state changes; no httpx line per request, also with --log-json."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kv_preflight.cli.valkey_server import free_port
from tests.e2e.harness import spawn, stop
from tests.integration.sim import sim_engine

pytestmark = pytest.mark.integration

SCRAPE_S = 0.1


def wait_for(log: Path, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{log.read_text()}"
        time.sleep(0.1)


def lines_with(log: Path, text: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if text in line]


def test_dead_valkey_and_dead_engine_are_logged_once_at_start(tmp_path):
    """`serve` with a dead Valkey and a dead engine logged nothing about the engine, ever."""
    dead_engine = f"http://127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    proc = spawn(["serve", "--valkey-url", f"redis://127.0.0.1:{free_port()}/0", "--port", str(free_port()),
                  "--engine-url", f"m={dead_engine}", "--metrics-interval", str(SCRAPE_S)], str(log))
    try:
        wait_for(log, f"start-up: engine {dead_engine}: unreachable")
        time.sleep(30 * SCRAPE_S)  # thirty more scrapes of the dead engine
    finally:
        stop(proc)
    assert len(lines_with(log, "start-up: Valkey redis://127.0.0.1:")) == 1 and "unreachable" in lines_with(log, "start-up: Valkey")[0]
    assert len(lines_with(log, dead_engine)) == 1, log.read_text()
    assert len(lines_with(log, "start-up: tokenizer for m: engine")) == 1, log.read_text()


def test_live_stack_logs_state_changes_only_and_no_httpx_lines(valkey_url, tmp_path):
    engine = sim_engine("sim-log", tmp_path).start()
    log = tmp_path / "serve.log"
    proc = spawn(["serve", "--valkey-url", valkey_url, "--port", str(free_port()), "--engine-url", f"sim={engine.url}",
                  "--metrics-interval", str(SCRAPE_S), "--log-json"], str(log))
    try:
        wait_for(log, f"start-up: engine {engine.url}: up, pod sim-log")
        time.sleep(30 * SCRAPE_S)
        engine.stop()
        wait_for(log, f"engine {engine.url}: pod sim-log: cannot scrape")
        time.sleep(30 * SCRAPE_S)
    finally:
        stop(proc)
        engine.stop()
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert records and not [r for r in records if r["logger"].startswith("httpx")], log.read_text()
    about_engine = [r["msg"] for r in records if engine.url in r["msg"]]
    assert len(about_engine) == 2, about_engine  # up at start-up, then down once
    assert sum(r["msg"].startswith("start-up: Valkey") and "up, index layout" in r["msg"] for r in records) == 1
    assert sum(r["msg"].startswith("start-up: tokenizer for sim") for r in records) == 1
