"""The compose stack for real: built, brought up under its own project name and host port, checked
through its load balancer against the engines' cached tokens, hurt (an ingester killed, Valkey
restarted), checked again, asked with the curls its quickstart documents, and torn down with the documented
``down -v``, leaving no container and no volume. Then once more on the Valkey Cluster profile.

Needs a Docker engine with Compose v2: KVPF_DOCKER_SETUP names a script that provides one and prints
``DOCKER READY`` (../shared/docker/setup.sh in this workplace). Without it the tests skip with a reason;
CI sets KVPF_REQUIRE_E2E=1, which turns that skip into a failure.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from kv_preflight.cli.valkey_server import free_port
from tests.tokenizer_files import write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
IMAGE = "kv-preflight:local"
pytestmark = pytest.mark.e2e

ENGINES = ("engine-a", "engine-b")
MODEL = "sim-model"


def docker_setup() -> str:
    path = os.environ.get("KVPF_DOCKER_SETUP", "")
    if path and os.access(path, os.X_OK):
        return path
    reason = ("KVPF_DOCKER_SETUP is not set to an executable Docker setup script (e.g. ../shared/docker/setup.sh); "
              "the compose end-to-end tests are skipped")
    if os.environ.get("KVPF_REQUIRE_E2E") == "1":
        pytest.fail(reason + " but KVPF_REQUIRE_E2E=1")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def docker() -> None:
    script = docker_setup()
    out = subprocess.run([script], capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "DOCKER READY" in out.stdout, f"{script} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def clean_env(**extra: str) -> dict[str, str]:
    """The shell's KVPF_* and COMPOSE_* would be interpolated into the compose file: the test sets its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPF_", "COMPOSE_"))}
    env.update(extra)
    return env


@dataclass
class Project:
    name: str
    env: dict[str, str]
    env_file: Path | None = None

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", "-p", self.name, "-f", str(COMPOSE_DIR / "docker-compose.yml")]
        if self.env_file:
            cmd += ["--env-file", str(self.env_file)]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, env=self.env,
                             stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            logs = subprocess.run([*cmd, "logs", "--no-color", "--tail", "40"], capture_output=True, text=True,
                                  env=self.env, timeout=60).stdout
            raise AssertionError(f"docker compose {' '.join(args)} exited {out.returncode}:\n"
                                 f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n--- logs ---\n{logs[-6000:]}")
        return out

    def containers(self) -> list[str]:
        out = subprocess.run(["docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={self.name}"],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.split()

    def down(self) -> None:
        # every profile: a service of a profile not named here is not stopped by `down`
        self.compose("--profile", "*", "down", "-v", "--remove-orphans", "--timeout", "5", timeout=180, check=False)
        assert self.containers() == [], f"containers of {self.name} left behind"

    def demo(self, *engines: str) -> dict[str, dict[str, int]]:
        """``kv-preflight demo`` against each engine, from inside the stack's network (one container for all):
        predictions through the load balancer, each compared with the cached tokens the engine then
        reports; a demo exits 1 on any mismatch."""
        script = "rc=0; " + " ".join(
            f"kv-preflight demo --engine-url http://{e}:8000 --predictor-url http://lb:8080 --model {MODEL} || rc=1;"
            for e in engines) + " exit $rc"
        out = self.compose("run", "--rm", "--no-deps", "--entrypoint", "sh", "engine-a", "-c", script,
                           timeout=300, check=False)
        results = {}
        for block in out.stdout.split("demo: shared-prefix workload against http://")[1:]:
            engine = block.split(":", 1)[0]
            m = re.search(r"(\d+)/(\d+) predictions exact; (\d+) requests hit the cache", block)
            assert m, f"demo against {engine} printed no summary:\n{out.stdout}\n{out.stderr[-3000:]}"
            exact, total, hits = map(int, m.groups())
            results[engine] = {"exact": exact, "requests": total, "hits": hits}
        assert list(results) == list(engines), f"demos did not all run:\n{out.stdout}\n{out.stderr[-3000:]}"
        assert out.returncode == 0 and all(r["exact"] == r["requests"] for r in results.values()), \
            f"predictions through the load balancer differ from the engines' cached tokens:\n{out.stdout}"
        return results


def wait_healthy(url: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy within {timeout_s}s (last: {last})")


def documented_commands(lines: list[str], start: str) -> list[str]:
    """The shell commands beginning with ``start`` in ``lines``, a line ending in a backslash joined with the
    next, as a newcomer pastes them."""
    commands, current = [], ""
    for line in lines:
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1]
            continue
        if current.startswith(start):
            commands.append(current)
        current = ""
    return commands


def compose_section() -> str:
    """docs/operations.md's "The compose stack": what a newcomer runs once the stack is up, and to stop it."""
    text = (ROOT / "docs" / "operations.md").read_text()
    return text.split("## The compose stack", 1)[1].split("\n## ", 1)[0]


def quickstart_curls() -> list[str]:
    """The curls the compose quickstart documents, in docs/operations.md and in the compose file's header;
    the docs' are the header's too, so the two cannot drift apart."""
    docs = documented_commands(compose_section().splitlines(), "curl ")
    header = [line[1:] for line in (COMPOSE_DIR / "docker-compose.yml").read_text().splitlines()
              if line.startswith("#")]
    in_header = documented_commands(header, "curl ")
    assert docs and all(c in in_header for c in docs), (docs, in_header)
    return in_header


def walk_the_documented_quickstart(project: Project, port: int, gateway_port: int) -> None:
    """Issue 27, finding 11: what the docs tell a newcomer to run once the stack is up (the curls) and to stop
    it (``down -v``), run as documented on this project's port and name; the volumes (the index) must go."""
    for curl in quickstart_curls():
        cmd = curl.replace("localhost:8080", f"127.0.0.1:{port}").replace("localhost:8000", f"127.0.0.1:{gateway_port}")
        out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60, env=project.env)
        assert out.returncode == 0 and out.stdout, (cmd, out.stdout, out.stderr)
        if "/ready" in cmd:
            assert out.stdout.strip().startswith("{") and "error" not in out.stdout, out.stdout
        if "/v1/cache/predict" in cmd:
            answer = json.loads(out.stdout)
            assert answer["total_prompt_tokens"] > 0 and "freshness" in answer, answer
        if "/v1/completions" in cmd:  # through a gateway: the engine's answer, the decision in its headers
            assert out.stdout.startswith("HTTP/1.1 200") and "x-kvpf-pod: sim-" in out.stdout, out.stdout
    volumes = project_volumes(project.name)
    assert volumes, f"the stack {project.name} made no volume: nothing for down -v to delete"
    m = re.search(r"`(docker compose -f compose/docker-compose\.yml down -v)`", compose_section())
    assert m, "docs/operations.md no longer documents `docker compose -f compose/docker-compose.yml down -v`"
    down = m.group(1).replace("docker compose", f"docker compose -p {project.name}", 1)
    out = subprocess.run(["sh", "-c", down], cwd=ROOT, capture_output=True, text=True, timeout=180, env=project.env)
    assert out.returncode == 0, (down, out.stdout, out.stderr[-3000:])
    assert project.containers() == [], f"containers of {project.name} left by {down}"
    assert project_volumes(project.name) == [], f"volumes of {project.name} left by {down}: {volumes}"


def project_volumes(name: str) -> list[str]:
    out = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={name}"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def routes_through_the_gateways(gateway: str) -> None:
    """Completions through the balancer's gateways: a prompt's later requests go where its first left its blocks,
    each predicted exactly (the engine's cached tokens), whichever gateway the balancer picks."""
    # token ids: this stack's local tokenizer (KVPF_TOKENIZERS, unchecked) is not the simulated engines' own
    prompt = {"model": MODEL, "prompt": [7000 + i % 97 for i in range(200)], "max_tokens": 2}
    answers = [httpx.post(gateway + "/v1/completions", json=prompt, timeout=30) for _ in range(6)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    later = answers[3:]  # by then the first request's events are in the index
    assert {r.headers["x-kvpf-pod"] for r in later} == {answers[0].headers["x-kvpf-pod"]}
    for r in later:
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-kvpf-reason"] == "best_overlap" and r.headers["x-kvpf-predicted-cached-tokens"] == str(cached)


def test_stack_predicts_exactly_through_its_load_balancer_across_faults(docker, tmp_path):
    port, gateway_port = free_port(), free_port()
    # Item 4 of issue 14: the optional env file and the tokenizer mount reach the predictors.
    tokenizers = tmp_path / "tokenizers"
    write_tokenizer(tokenizers / "sim")
    for p in [tokenizers, *tokenizers.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)  # the image runs as nobody
    env_file = tmp_path / "kvpf.env"
    env_file.write_text(f"KVPF_TOKENIZERS={MODEL}=/tokenizers/sim\nKVPF_TOKENIZER_CHECK=false\n")
    project = Project(f"kvpf-e2e-{os.getpid()}", clean_env(KVPF_LB_PORT=str(port), KVPF_ENV_FILE=str(env_file),
                                                          KVPF_TOKENIZER_DIR=str(tokenizers),
                                                          KVPF_GATEWAY_PORT=str(gateway_port)))
    lb = f"http://127.0.0.1:{port}"
    try:
        up = project.compose("up", "--build", "--detach", "--wait", "--wait-timeout", "300", timeout=900)
        built = set(re.findall(r"\[([\w-]+) internal\] load build definition", up.stdout + up.stderr))
        assert built == {"engine-a"}, f"one build per up --build, by engine-a; built by {built}"
        wait_healthy(lb + "/health")
        tokenization = httpx.get(lb + "/stats", timeout=5).json()["tokenization"]
        assert tokenization[MODEL]["source"] == "local", tokenization

        first = project.demo(*ENGINES)
        assert all(r["hits"] > 0 for r in first.values()), first  # a workload that never hits checks nothing
        wait_healthy(f"http://127.0.0.1:{gateway_port}/health")
        routes_through_the_gateways(f"http://127.0.0.1:{gateway_port}")

        project.compose("kill", "ingester-1")
        project.compose("restart", "valkey", timeout=120)
        wait_healthy(lb + "/health")
        # The same prompts again: every one is now cached on its engine, so an index lost with Valkey's restart,
        # or left behind with the killed ingester, shows as a prediction below the engine's cached tokens.
        again = project.demo(*ENGINES)
        assert all(r["hits"] == r["requests"] for r in again.values()), again
        walk_the_documented_quickstart(project, port, gateway_port)
    finally:
        project.down()


def test_cluster_profile_predicts_exactly(docker):
    port, gateway_port = free_port(), free_port()
    project = Project(f"kvpf-e2e-cl-{os.getpid()}", clean_env(KVPF_LB_PORT=str(port), KVPF_GATEWAY_PORT=str(gateway_port)),
                      env_file=COMPOSE_DIR / "cluster.env")
    lb = f"http://127.0.0.1:{port}"
    try:
        project.compose("up", "--build", "--detach", "--wait", "--wait-timeout", "300", timeout=900)
        wait_healthy(lb + "/health")
        result = project.demo(*ENGINES)
        assert all(r["hits"] > 0 for r in result.values()), result
        # The index really is on the cluster, spread over its masters (llm-d's request keys have no hash tag;
        # counted by their decimal names: every master also holds slot markers of ours, whatever the index holds).
        keys_per_master = []
        for n in range(1, 7):
            role = project.compose("exec", "-T", f"valkey-c{n}", "valkey-cli", "role").stdout.split()[0]
            if role == "master":
                keys_per_master.append(len(project.compose("exec", "-T", f"valkey-c{n}", "valkey-cli", "--scan",
                                                           "--pattern", "[0-9]*").stdout.split()))
        assert len(keys_per_master) == 3 and sum(k > 0 for k in keys_per_master) == 3, keys_per_master
        single = project.compose("ps", "-q", "valkey").stdout.strip()
        assert not single, "the single node is not started with compose/cluster.env (KVPF_SINGLE_VALKEY=0)"
    finally:
        project.down()


@pytest.fixture(scope="module")
def image(docker) -> str:
    Project(f"kvpf-e2e-img-{os.getpid()}", clean_env()).compose("build", "engine-a", timeout=900)
    return IMAGE


def run_in_image(image: str, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", "--entrypoint", cmd[0], image, *cmd[1:]], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_image_runs_as_a_non_root_user(image):
    out = run_in_image(image, "id", "-u")
    assert out.returncode == 0 and out.stdout.strip() not in ("", "0"), out


def test_image_has_no_compiler_and_has_the_c_routine(image):
    probe = ("import shutil, sysconfig; from kv_preflight.keys.chain import HAS_C_EXTENSION; "
             "import kv_preflight.index._write_path; "
             "cc = (sysconfig.get_config_var('CC') or 'cc').split()[0]; "
             "print(HAS_C_EXTENSION, [c for c in (cc, 'cc', 'gcc', 'clang', 'tcc', 'c99') if shutil.which(c)])")
    out = run_in_image(image, "python", "-c", probe)
    assert out.returncode == 0, out
    assert out.stdout.split(None, 1) == ["True", "[]\n"], out.stdout


# A Prometheus for a machine that reaches no image registry (this workplace: the Docker setup builds
# local/debian:bookworm and stand-ins of the stack's base images from it): the official image's entry point
# over Debian's prometheus package. Elsewhere the profile's own image is pulled.
PROMETHEUS_STANDIN = """FROM local/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends prometheus && rm -rf /var/lib/apt/lists/* \\
 && mkdir -p /prometheus && chown nobody /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
"""


def profile_image(service: str) -> str:
    """The image a service of the compose file names, by its default."""

    raw = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())["services"][service]["image"]
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", raw)


def have_image(name: str, standin: str | None = None) -> bool:
    """The image is here, or pulled now, or (no registry) built from ``standin`` on local/debian:bookworm."""
    def run(*cmd: str, timeout: float = 120, **kw) -> bool:
        return subprocess.run(cmd, capture_output=True, timeout=timeout, **kw).returncode == 0

    if run("docker", "image", "inspect", name) or run("docker", "pull", name, timeout=300):
        return True
    if standin is None or not run("docker", "image", "inspect", "local/debian:bookworm"):
        return False
    return run("docker", "build", "-q", "-t", name, "-", input=standin.encode(), timeout=900)


def prom_query(base: str, query: str) -> list[dict]:
    r = httpx.get(base + "/api/v1/query", params={"query": query}, timeout=10).json()
    assert r["status"] == "success", (query, r)
    return r["data"]["result"]


def test_observability_profile_scrapes_every_process_and_answers_the_dashboard(docker, tmp_path):
    """Issue 42: the `observability` profile's Prometheus scrapes every process of the stack (predictors,
    ingesters, engines: each target up), and every query of the Grafana dashboard runs on it without error,
    the main ones with data once the stack has had traffic; Grafana, where its image can be had, is provisioned
    with the dashboard. The stack is the same compose file a user runs, with the profile."""
    prometheus = profile_image("prometheus")
    if not have_image(prometheus, PROMETHEUS_STANDIN):
        pytest.skip(f"{prometheus} can be neither pulled nor built here")
    grafana = profile_image("grafana")
    with_grafana = have_image(grafana)
    port, prom_port, graf_port = free_port(), free_port(), free_port()
    project = Project(f"kvpf-e2e-obs-{os.getpid()}", clean_env(KVPF_LB_PORT=str(port), KVPF_PROMETHEUS_PORT=str(prom_port),
                                                              KVPF_GRAFANA_PORT=str(graf_port)))
    prom = f"http://127.0.0.1:{prom_port}"
    services = ["lb", "ingester-1", "ingester-2", "prometheus", *(["grafana"] if with_grafana else [])]
    try:
        project.compose("--profile", "observability", "up", "--build", "--detach", "--wait", "--wait-timeout", "300",
                        *services, timeout=900)
        wait_healthy(f"http://127.0.0.1:{port}/health")
        project.demo(*ENGINES)
        for i in range(5):
            r = httpx.post(f"http://127.0.0.1:{port}/v1/cache/route", json={"model": MODEL, "token_ids": list(range(40 + i))},
                           timeout=10)
            assert r.status_code == 200, r.text
        # every target of the stack's jobs (predictors twice: /metrics and /metrics/pods; ingesters, gateways,
        # engines) scraped and up; the gpu profile's are not running here
        config = yaml.safe_load((COMPOSE_DIR / "observability" / "prometheus.yml").read_text())
        expected = {(j["job_name"], t) for j in config["scrape_configs"] if j["job_name"] != "gpu"
                    for c in j["static_configs"] for t in c["targets"]}
        assert {"gateway", "ingester", "engine", "predictor", "predictor-pods"} == {j for j, _ in expected}
        deadline = time.monotonic() + 90
        while True:
            targets = httpx.get(prom + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            ours = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in targets
                    if t["labels"]["job"] != "gpu"}
            if set(ours) == expected and set(ours.values()) == {"up"} or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert set(ours) == expected and set(ours.values()) == {"up"}, (ours, expected)
        dashboard = json.loads((COMPOSE_DIR / "observability" / "grafana" / "kv-preflight.json").read_text())
        queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        must_answer = {"max by (state) (kvpf_pods)", "max by (pod) (kvpf_index_pod_memory_bytes)",
                       "sum by (type) (rate(kvpf_ingest_events_total[1m]))",
                       "sum by (reason) (rate(kvpf_route_decisions_total[1m]))",
                       "sum by (freshness) (rate(kvpf_answers_total[1m]))"}
        assert must_answer <= set(queries)
        deadline = time.monotonic() + 60
        while True:  # a rate needs two scrapes after the traffic
            empty = [q for q in must_answer if not prom_query(prom, q)]
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert not empty, empty
        for q in queries:
            prom_query(prom, q)  # every query is valid PromQL over the stack's series
        live = {r["metric"]["state"]: float(r["value"][1]) for r in prom_query(prom, "max by (state) (kvpf_pods)")}
        assert live.get("live") == 2, live
        if with_grafana:
            graf = f"http://127.0.0.1:{graf_port}"
            wait_healthy(graf + "/api/health")
            admin = ("admin", "admin")  # Grafana's first-start admin: the API's reads need a role above Viewer
            found = httpx.get(graf + "/api/dashboards/uid/kv-preflight", timeout=10, auth=admin)
            assert found.status_code == 200 and found.json()["dashboard"]["title"] == "kv-preflight", found.text[:500]
            ds = httpx.get(graf + "/api/datasources/uid/kvpf-prometheus", timeout=10, auth=admin)
            assert ds.status_code == 200 and ds.json()["url"] == "http://prometheus:9090", ds.text[:500]
    finally:
        project.down()
