"""No Docker engine runs here, so the compose stack is checked statically: it parses, every command is
a real ``kv-preflight`` invocation, and every address it names exists and agrees on ports."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import click
import pytest
import yaml

from kv_preflight.cli.main import cli

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def with_defaults(text: str) -> str:
    """Compose's interpolation with an empty environment: ``${VAR:-default}`` is its default, ``$$`` a ``$``."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m.group(2), text)
    assert not re.search(r"\$\{?\w", text.replace("$$", "")), "a variable without a default"
    return text.replace("$$", "$")


@pytest.fixture(scope="module")
def stack():
    return yaml.safe_load(with_defaults((COMPOSE / "docker-compose.yml").read_text()))


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
        assert cmd in ("simulate", "ingest", "serve", "gateway"), name


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
        if cmd in ("serve", "gateway"):
            assert params["host"] == "0.0.0.0"
            for pair in params["engine_urls"]:
                host = urlsplit(pair.split("=", 1)[1])
                assert host.hostname in engines and host.port == engines[host.hostname]
    env = stack["x-kvpf"]["environment"]["KVPF_VALKEY_URL"]
    assert urlsplit(env).hostname == "valkey" and "valkey" in stack["services"]
    assert "--appendonly" in stack["services"]["valkey"]["command"]


def test_load_balancer_targets_the_predictors_and_the_gateways(stack):
    conf = (COMPOSE / "nginx.conf").read_text()
    upstreams = re.findall(r"server\s+([\w-]+):(\d+);", conf)
    servers = {n: (parse_cli(s["command"])[0], parse_cli(s["command"])[1]["port"]) for n, s in kvpf_services(stack).items()
               if parse_cli(s["command"])[0] in ("serve", "gateway")}
    assert {h for h, _ in upstreams} == set(servers)
    assert {kind for kind, _ in servers.values()} == {"serve", "gateway"}
    for host, port in upstreams:
        assert int(port) == servers[host][1]
    listens = re.findall(r"listen\s+(\d+);", conf)
    assert sorted(listens) == ["8000", "8080"]
    assert {f"8080:8080", "8000:8000"} == set(stack["services"]["lb"]["ports"])


def test_gpu_profile_configures_vllm_events(stack):
    vllm = stack["services"]["vllm-gpu"]
    assert vllm["profiles"] == ["gpu"]
    cfg = vllm["command"][vllm["command"].index("--kv-events-config") + 1]
    assert '"endpoint":"tcp://*:5557"' in cfg and '"replay_endpoint":"tcp://*:5558"' in cfg
    cmd, params = parse_cli(stack["services"]["ingester-gpu"]["command"])
    assert cmd == "ingest" and params["engines"] == ("http://vllm-gpu:8000",)


def test_the_image_is_built_once_and_reused(stack):
    builders = [n for n, s in stack["services"].items() if "build" in s]
    assert builders == ["engine-a"], builders
    image = stack["services"]["engine-a"]["image"]
    for name, svc in kvpf_services(stack).items():
        assert svc["image"] == image
        if name != "engine-a":
            assert svc.get("pull_policy") == "never", f"{name} would look for the local image in a registry"


def test_every_long_running_service_has_a_healthcheck_its_image_can_run(stack):
    for name, svc in stack["services"].items():
        if name == "valkey-cluster-init":  # one-shot: the others wait for it to complete
            continue
        test = svc.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
        text = " ".join(test)
        if svc["image"].startswith("grafana/"):
            # Grafana's official image is Alpine's, busybox wget in it
            assert test[:2] == ["CMD", "wget"] and "http://127.0.0.1:3000/api/health" in text, name
            continue
        assert "curl" not in text and "wget" not in text, f"{name}: the images have no curl or wget"
        if svc.get("image") == "kv-preflight:local":
            assert test[:2] == ["CMD", "python"], name
            cmd, params = parse_cli(svc["command"])
            port = {"simulate": params.get("port"), "serve": params.get("port"), "gateway": params.get("port"),
                    "ingest": params.get("metrics_port")}[cmd]
            assert f"http://127.0.0.1:{port}/" in text, f"{name}: health asked on a port it does not serve"
        elif svc["image"].startswith("valkey/"):
            assert test == ["CMD", "valkey-cli", "ping"]
        elif svc["image"].startswith("prom/"):
            assert test == ["CMD", "promtool", "query", "instant", "http://127.0.0.1:9090", "up"], name
        elif svc["image"].startswith("vllm/"):
            assert test[:2] == ["CMD", "python3"] and "http://127.0.0.1:8000/health" in text
    nginx = (COMPOSE / "nginx.conf").read_text()
    pid = re.search(r"^pid\s+(\S+);", nginx, re.M).group(1)
    assert pid in " ".join(stack["services"]["lb"]["healthcheck"]["test"])


def test_host_port_env_file_and_tokenizer_mount_are_configurable():
    raw = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    assert raw["services"]["lb"]["ports"] == ["${KVPF_LB_PORT:-8080}:8080", "${KVPF_GATEWAY_PORT:-8000}:8000"]
    assert raw["x-kvpf"]["env_file"] == [{"path": "${KVPF_ENV_FILE:-kvpf.env}", "required": False}]
    for name in ("predictor-1", "predictor-2", "gateway-1", "gateway-2"):
        assert raw["services"][name]["volumes"] == ["${KVPF_TOKENIZER_DIR:-./tokenizers}:/tokenizers:ro"]
    assert (COMPOSE / "tokenizers").is_dir(), "the default mount exists, so Docker does not create it as root"
    example = (COMPOSE / "kvpf.env.example").read_text()
    from kv_preflight.config import ENV_PREFIX, Config
    import dataclasses
    fields = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Config)}
    named = set(re.findall(r"^# (KVPF_\w+)=", example, re.M))
    assert named and named <= fields, named - fields


def test_cluster_profile(stack):
    nodes = {n: s for n, s in stack["services"].items() if re.fullmatch(r"valkey-c\d", n)}
    assert len(nodes) == 6
    for name, svc in nodes.items():
        assert svc["profiles"] == ["cluster"]
        cmd = svc["command"]
        for flag, value in (("--cluster-enabled", "yes"), ("--appendonly", "yes"),
                            ("--cluster-require-full-coverage", "no")):
            assert cmd[cmd.index(flag) + 1] == value, name
        assert svc["volumes"] == [f"{name}:/data"]
    init = stack["services"]["valkey-cluster-init"]
    assert set(init["depends_on"]) == set(nodes)
    assert "--cluster-replicas 1" in init["command"][0]
    env = dict(line.split("=", 1) for line in (COMPOSE / "cluster.env").read_text().splitlines()
               if line and not line.startswith("#"))
    assert env["COMPOSE_PROFILES"] == "cluster"
    assert urlsplit(env["KVPF_VALKEY_URL"]).hostname in nodes
    for name, svc in kvpf_services(stack).items():
        cmd, _ = parse_cli(svc["command"])
        if cmd in ("ingest", "serve"):
            dep = svc["depends_on"]["valkey-cluster-init"]
            assert dep == {"condition": "service_completed_successfully", "required": False}, name


def _env_file(name: str) -> dict[str, str]:
    out = {}
    for line in (COMPOSE / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def with_env(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation with ``env`` (an --env-file's values), defaults for the rest."""
    text = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), text)
    return text.replace("$$", "$")


def test_the_cluster_env_starts_no_single_node_and_nothing_waits_for_one():
    """Issue 27, finding 11: with compose/cluster.env the single-node `valkey` still started, and every
    service waited for it."""
    env = _env_file("cluster.env")
    cluster = yaml.safe_load(with_env((COMPOSE / "docker-compose.yml").read_text(), env))
    assert int(cluster["services"]["valkey"]["scale"]) == 0
    single = yaml.safe_load(with_defaults((COMPOSE / "docker-compose.yml").read_text()))
    assert int(single["services"]["valkey"]["scale"]) == 1
    for name, svc in cluster["services"].items():
        dep = (svc.get("depends_on") or {}).get("valkey")
        assert dep is None or dep.get("required") is False, f"{name} waits for the single node"
    assert env["KVPF_VALKEY_URL"].startswith("redis://valkey-c")
    assert "cluster" in env["COMPOSE_PROFILES"]


def test_env_example_shows_the_current_defaults():
    """Finding 11: the example showed KVPF_ROUTE_OVERLOAD_ABS=4 after the default became 6."""
    import dataclasses

    from kv_preflight.config import Config

    defaults = {f.name.upper(): f.default for f in dataclasses.fields(Config)}
    checked = 0
    for line in (COMPOSE / "kvpf.env.example").read_text().splitlines():
        m = re.match(r"#\s*KVPF_(\w+)=(\S+)$", line.strip())
        if not m or m.group(1) not in defaults:
            continue
        default = defaults[m.group(1)]
        if isinstance(default, bool):
            assert m.group(2).lower() in (("true", "1", "yes") if default else ("false", "0", "no")), line
        elif isinstance(default, (int, float)):
            assert float(m.group(2)) == float(default), f"{line}: the default is {default}"
        else:
            continue
        checked += 1
    assert checked >= 5


def test_gpu_profile_pins_the_documented_vllm_and_the_stack_says_how_to_use_and_remove_it(stack):
    image = stack["services"]["vllm-gpu"]["image"]
    assert image == "vllm/vllm-openai:v0.32.0", image
    header = (COMPOSE / "docker-compose.yml").read_text().split("name: kv-preflight", 1)[0]
    assert "curl -s localhost:8080/v1/cache/predict" in header and "down -v" in header


def test_the_observability_profile_scrapes_every_process_and_provisions_the_dashboard(stack):
    """Issue 42, item 6: Prometheus scrapes each process's /metrics where it serves it (predictors on serve
    --port, ingesters on --metrics-port, simulated engines on simulate --port, the gpu profile's vLLM and its
    ingester), and Grafana is given that Prometheus under the uid every dashboard panel names, and the
    dashboard; both only in the `observability` profile, on ports the shell can move."""
    import json

    services = stack["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"], name
    raw = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    assert raw["prometheus"]["ports"] == ["${KVPF_PROMETHEUS_PORT:-9090}:9090"]
    assert raw["grafana"]["ports"] == ["${KVPF_GRAFANA_PORT:-3000}:3000"]
    for svc in ("prometheus", "grafana"):
        for volume in services[svc]["volumes"]:
            assert (COMPOSE / volume.split(":")[0]).is_file(), volume
    serves = {}
    for name, svc in services.items():
        if svc.get("image") == "kv-preflight:local":
            cmd, params = parse_cli(svc["command"])
            serves[name] = params["metrics_port"] if cmd == "ingest" else params["port"]
    serves["vllm-gpu"] = 8000
    scrape = yaml.safe_load((COMPOSE / "observability" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:{port}" for name, port in serves.items()}, targets
    datasource = yaml.safe_load((COMPOSE / "observability" / "grafana" / "datasources.yml").read_text())["datasources"]
    assert len(datasource) == 1 and datasource[0]["url"] == "http://prometheus:9090"
    dashboard = json.loads((COMPOSE / "observability" / "grafana" / "kv-preflight.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(t["datasource"]["uid"] == datasource[0]["uid"] for p in panels for t in p["targets"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    provider = yaml.safe_load((COMPOSE / "observability" / "grafana" / "dashboards.yml").read_text())["providers"][0]
    mounted = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert provider["options"]["path"] + "/kv-preflight.json" in mounted
