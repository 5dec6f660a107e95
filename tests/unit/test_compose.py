"""No Docker engine runs here, so the compose stack is checked statically: it parses, every command is
a real ``kv-preflight`` invocation, and every address it names exists and agrees on ports."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest
import yaml

from cli.main import cli

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


@pytest.fixture(scope="module")
def stack():
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def parse_cli(args: list[str]) -> tuple[str, dict]:
    """Resolve args through click exactly as the entry point would, without running anything."""
    name, *rest = args
    ctx = click.Context(cli, info_name="kv-preflight")
    cmd = cli.get_command(ctx, name)
    if cmd is None:
        raise click.UsageError(f"no such command {name!r}")
    return name, cmd.make_context(name, list(rest), parent=ctx).params


def kvpf_services(stack):
    return {n: s for n, s in stack["services"].items() if s.get("image") == "kv-preflight:local"}


def test_every_command_is_a_real_cli_invocation(stack):
    services = kvpf_services(stack)
    assert {"engine-a", "engine-b", "ingester-1", "ingester-2", "predictor-1", "predictor-2"} <= set(services)
    for name, svc in services.items():
        cmd, params = parse_cli(svc["command"])
        assert cmd in ("simulate", "ingest", "serve"), name


def test_bad_command_would_be_caught():
    with pytest.raises(click.UsageError):
        parse_cli(["serve", "--no-such-flag"])


def test_addresses_and_ports_agree(stack):
    services = kvpf_services(stack)
    engines = {}
    for name, svc in services.items():
        cmd, params = parse_cli(svc["command"])
        if cmd == "simulate":
            assert params["host"] == "0.0.0.0", f"{name} must listen beyond loopback inside its container"
            assert "*" in params["zmq_endpoint"], f"{name}: ingesters connect, so the engine binds"
            engines[name] = params["port"]
    for name, svc in services.items():
        cmd, params = parse_cli(svc["command"])
        if cmd == "ingest":
            for url in params["engines"]:
                u = urlsplit(url)
                assert u.hostname in stack["services"], f"{name}: unknown engine {u.hostname}"
                if u.hostname in engines:
                    assert u.port == engines[u.hostname], f"{name}: {url} does not match the engine's port"
        if cmd == "serve":
            assert params["host"] == "0.0.0.0"
            for pair in params["engine_urls"]:
                host = urlsplit(pair.split("=", 1)[1])
                assert host.hostname in engines and host.port == engines[host.hostname]
    env = stack["x-kvpf"]["environment"]["KVPF_VALKEY_URL"]
    assert urlsplit(env).hostname == "valkey" and "valkey" in stack["services"]
    assert "--appendonly" in stack["services"]["valkey"]["command"]


def test_load_balancer_targets_the_predictors(stack):
    conf = (COMPOSE / "nginx.conf").read_text()
    upstreams = re.findall(r"server\s+([\w-]+):(\d+);", conf)
    predictors = {n: parse_cli(s["command"])[1]["port"] for n, s in kvpf_services(stack).items()
                  if parse_cli(s["command"])[0] == "serve"}
    assert {h for h, _ in upstreams} == set(predictors)
    for host, port in upstreams:
        assert int(port) == predictors[host]
    listen = re.search(r"listen\s+(\d+);", conf).group(1)
    assert f"8080:{listen}" in stack["services"]["lb"]["ports"]


def test_gpu_profile_configures_vllm_events(stack):
    vllm = stack["services"]["vllm-gpu"]
    assert vllm["profiles"] == ["gpu"]
    cfg = vllm["command"][vllm["command"].index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:5557"' in cfg and '"replay_endpoint":"tcp://*:5558"' in cfg
    cmd, params = parse_cli(stack["services"]["ingester-gpu"]["command"])
    assert cmd == "ingest" and params["engines"] == ("http://vllm-gpu:8000",)
