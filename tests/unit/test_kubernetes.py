"""deploy/kubernetes/ rendered with ``kubectl kustomize`` and checked offline: every object against the
Kubernetes JSON schemas (kubernetes-validate, strict: unknown fields fail), then what a schema cannot see:
selectors that select, ports and probes that exist, commands the CLI accepts, options the config knows.
No cluster runs here; docs/kubernetes.md says what this does not cover.

kubectl comes from scripts/install-kubectl (called by scripts/setup). Without it these tests skip with a
reason; under KVPF_REQUIRE_E2E=1 (CI) that skip is a failure.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import click
import kubernetes_validate
import pytest
import yaml

from kv_preflight.cli.main import cli
from kv_preflight.config import ENV_PREFIX, Config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("single", "cluster")
# The oldest release the manifests claim (autoscaling/v2 and policy/v1 are GA from 1.23) and the newest
# the installed schemas know.
K8S_VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path:
        return path
    reason = "kubectl is not installed (scripts/install-kubectl); the Kubernetes manifests are not rendered"
    if os.environ.get("KVPF_REQUIRE_E2E") == "1":
        pytest.fail(reason + " but KVPF_REQUIRE_E2E=1")
    pytest.skip(reason)


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def pod_specs(objs: list[dict]):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield o, o["spec"]["template"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(rendered, version):
    overlay, objs = rendered
    assert objs
    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message[:300]} "
                          f"at {'.'.join(map(str, exc.path))}")
    assert not errors, f"{overlay}, Kubernetes {version}:\n" + "\n".join(errors)


@pytest.mark.parametrize("container", [{"name": "c", "image": "i", "imag": "i"},   # a misspelt field
                                       {"name": "c", "image": "i", "ports": [{"containerPort": "80"}]}],  # a wrong type
                         ids=["unknown-field", "wrong-type"])
def test_the_validator_rejects_a_bad_object(container):
    """The check above can fail."""
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}},
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [container]}}}}
    good = {**container}
    good.pop("imag", None)
    good.pop("ports", None)
    kubernetes_validate.validate({**bad, "spec": {**bad["spec"], "template": {**bad["spec"]["template"],
                                 "spec": {"containers": [good]}}}}, K8S_VERSIONS[0], strict=True)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[0], strict=True)


def test_the_pieces_the_issue_asks_for_are_there(rendered):
    overlay, objs = rendered
    deployments = by_kind(objs, "Deployment")
    assert {"kv-preflight-predictor", "kv-preflight-ingester", "kv-preflight-gateway"} <= set(deployments)
    for name in ("kv-preflight-predictor", "kv-preflight-gateway"):
        hpa = by_kind(objs, "HorizontalPodAutoscaler")[name]
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    pdbs = by_kind(objs, "PodDisruptionBudget")
    assert {"kv-preflight-predictor", "kv-preflight-ingester", "kv-preflight-gateway"} <= set(pdbs)
    valkey = by_kind(objs, "StatefulSet")["valkey"]
    args = valkey["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    if overlay == "single":
        assert valkey["spec"]["replicas"] == 1 and "--cluster-enabled" not in args
    else:
        assert valkey["spec"]["replicas"] == 6 and args[args.index("--cluster-enabled") + 1] == "yes"
        assert args[args.index("--cluster-require-full-coverage") + 1] == "no"
        init = by_kind(objs, "Job")["valkey-cluster-init"]["spec"]["template"]["spec"]["containers"][0]
        script = " ".join(init["args"])
        assert "--cluster-replicas 1" in script and "for n in 0 1 2 3 4 5" in script
    engines = by_kind(objs, "Service")["kv-preflight-engines"]
    assert engines["spec"]["clusterIP"] == "None", "DNS discovery needs the engines' headless Service"


def test_selectors_select_and_ports_exist(rendered):
    overlay, objs = rendered
    templates = {o["metadata"]["name"]: t for o, t in pod_specs(objs)}
    for name, o in {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}.items():
        labels = templates[name]["metadata"]["labels"]
        assert o["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    for pdb in by_kind(objs, "PodDisruptionBudget").values():
        sel = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(sel <= t["metadata"]["labels"].items() for t in templates.values()), pdb["metadata"]["name"]
    for name, svc in by_kind(objs, "Service").items():
        if name == "kv-preflight-engines":
            # selects the user's engine pods, which carry only their own labels and this one
            assert svc["spec"]["selector"] == {"kv-preflight.io/engine": "true"}
            continue
        sel = svc["spec"]["selector"].items()
        matched = [t for t in templates.values() if sel <= t["metadata"]["labels"].items()]
        assert matched, f"{overlay}: Service {name} selects no pod"
        ports = {p.get("name") for t in matched for c in t["spec"]["containers"] for p in c.get("ports", [])}
        numbers = {p["containerPort"] for t in matched for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports | numbers, f"{overlay}: Service {name} targets a port no pod has"
    for sts in by_kind(objs, "StatefulSet").values():
        assert sts["spec"]["serviceName"] in by_kind(objs, "Service")


def test_probes_and_scrape_annotations(rendered):
    overlay, objs = rendered
    for o, t in pod_specs(objs):
        if o["kind"] == "Job":
            continue
        annotations = t["metadata"].get("annotations", {})
        for c in t["spec"]["containers"]:
            assert "readinessProbe" in c and "livenessProbe" in c, f"{o['metadata']['name']}/{c['name']}"
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                get = c.get(probe, {}).get("httpGet")
                if get:
                    assert get["port"] in ports or get["port"] in ports.values()
            if c["image"].startswith("kv-preflight"):
                assert annotations.get("prometheus.io/scrape") == "true"
                assert int(annotations["prometheus.io/port"]) in ports.values()
                assert annotations["prometheus.io/path"] == "/metrics"
    predictor = by_kind(objs, "Deployment")["kv-preflight-predictor"]["spec"]["template"]["spec"]["containers"][0]
    assert predictor["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_kv_preflight_pods_run_as_non_root(rendered):
    _, objs = rendered
    for o, t in pod_specs(objs):
        ctx = t["spec"].get("securityContext", {})
        assert ctx.get("runAsNonRoot") is True and ctx.get("runAsUser", 0) != 0, o["metadata"]["name"]


def _command(args: list[str]) -> tuple[str, dict]:
    name, *rest = args
    ctx = click.Context(cli, info_name="kv-preflight")
    cmd = cli.get_command(ctx, name)
    assert cmd is not None, f"no such command {name!r}"
    return name, cmd.make_context(name, list(rest), parent=ctx).params


def test_commands_are_real_cli_invocations_and_options_are_known(rendered, monkeypatch):
    overlay, objs = rendered
    fields = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Config)}
    config = by_kind(objs, "ConfigMap")["kv-preflight"]["data"]
    assert set(config) <= fields, f"unknown options: {set(config) - fields}"
    for k, v in config.items():  # the ConfigMap loads as every process loads it
        monkeypatch.setenv(k, v)
    assert Config.load().valkey_url == config["KVPF_VALKEY_URL"]
    seen = set()
    for o, t in pod_specs(objs):
        for c in t["spec"]["containers"]:
            if not c["image"].startswith("kv-preflight"):
                continue
            name, params = _command(c["args"])
            seen.add(name)
            if name in ("serve", "gateway"):
                assert params["host"] == "0.0.0.0"
            if name == "ingest":
                assert params["engines_from"] and params["metrics_host"] == "0.0.0.0"
    assert "serve" in seen
    assert "ingest" in seen
    assert "gateway" in seen
