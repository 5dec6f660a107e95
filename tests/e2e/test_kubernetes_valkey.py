"""The Kubernetes cluster overlay's Valkey pieces, run for real in Docker: no Kubernetes runs here, but
the rendered StatefulSet's container arguments (nodes announcing ``valkey-N.valkey``) and the
``valkey-cluster-init`` Job's script are what matter most and can run as they are. Six nodes under their
pod DNS names on one Docker network, the Job's script makes them a cluster, and the kv-preflight image
(simulated engine, ingester, predictor, demo) works on it through the URL the ConfigMap gives.

Gated like tests/e2e/test_compose.py (KVPF_DOCKER_SETUP); kubectl renders the overlay.
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.e2e.test_compose import IMAGE, Project, clean_env, docker  # noqa: F401  (docker: the fixture)
from tests.unit.test_kubernetes import by_kind, render

pytestmark = pytest.mark.e2e


def sh(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check:
        assert out.returncode == 0, f"{' '.join(args)[:300]}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_cluster_overlay_valkey_runs_and_kv_preflight_works_on_it(docker):
    objs = render("cluster")
    valkey = by_kind(objs, "StatefulSet")["valkey"]
    container = valkey["spec"]["template"]["spec"]["containers"][0]
    job = by_kind(objs, "Job")["valkey-cluster-init"]["spec"]["template"]["spec"]["containers"][0]
    url = by_kind(objs, "ConfigMap")["kv-preflight"]["data"]["KVPF_VALKEY_URL"]
    service = valkey["spec"]["serviceName"]
    Project(f"kvpf-e2e-k8simg-{os.getpid()}", clean_env()).compose("build", "engine-a", timeout=900)

    tag = f"kvpf-e2e-k8s-{os.getpid()}"
    names: list[str] = []
    sh("docker", "network", "create", tag)
    try:
        for n in range(valkey["spec"]["replicas"]):
            pod = f"valkey-{n}"
            # what the kubelet does with $(POD_NAME); the pod's DNS name is POD.SERVICE
            args = [a.replace("$(POD_NAME)", pod) for a in container["args"]]
            names.append(f"{tag}-{pod}")
            sh("docker", "run", "-d", "--name", names[-1], "--network", tag, "--network-alias", f"{pod}.{service}",
               container["image"], *args)
        init = sh("docker", "run", "--rm", "--network", tag, job["image"], *job["command"], *job["args"], timeout=300)
        assert "[OK] All 16384 slots covered" in init.stdout, init.stdout
        slots = sh("docker", "exec", names[0], "valkey-cli", "cluster", "slots").stdout
        assert re.search(rf"valkey-\d\.{service}", slots), "nodes announce their pod DNS names"

        # The whole pipeline in one container on that network, given the ConfigMap's URL.
        script = (f"export KVPF_VALKEY_URL={url}; "
                  "kv-preflight simulate --pod sim-k --model sim-model --blocks 512 >/tmp/sim.log 2>&1 & "
                  "kv-preflight ingest --engine http://127.0.0.1:8000 >/tmp/ing.log 2>&1 & "
                  "kv-preflight serve --port 8080 --engine-url sim-model=http://127.0.0.1:8000 >/tmp/srv.log 2>&1 & "
                  "python -c \"import time, urllib.request as u\n"
                  "for _ in range(600):\n"
                  "    try: u.urlopen('http://127.0.0.1:8080/health', timeout=1); break\n"
                  "    except Exception: time.sleep(0.2)\"; "
                  "kv-preflight demo --engine-url http://127.0.0.1:8000 --model sim-model; rc=$?; "
                  "[ $rc = 0 ] || tail -20 /tmp/ing.log /tmp/srv.log; exit $rc")
        names.append(f"{tag}-kvpf")
        demo = sh("docker", "run", "--rm", "--name", names[-1], "--network", tag, "--entrypoint", "sh", IMAGE,
                  "-c", script, timeout=300, check=False)
        m = re.search(r"(\d+)/(\d+) predictions exact; (\d+) requests hit the cache", demo.stdout)
        assert demo.returncode == 0 and m and m.group(1) == m.group(2) and int(m.group(3)) > 0, \
            f"{demo.stdout}\n{demo.stderr[-3000:]}"
        # llm-d's request keys (decimal names) per master: spread over all three (every master also holds slot
        # markers of ours, whatever the index holds)
        keys = [len(sh("docker", "exec", name, "valkey-cli", "--scan", "--pattern", "[0-9]*").stdout.split())
                for name in names[:-1]
                if sh("docker", "exec", name, "valkey-cli", "role").stdout.split()[0] == "master"]
        assert len(keys) == 3 and all(k > 0 for k in keys), keys
    finally:
        for name in names:
            subprocess.run(["docker", "rm", "-f", "-v", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "network", "rm", tag], capture_output=True, timeout=60)
    left = sh("docker", "ps", "-a", "-q", "--filter", f"name={tag}").stdout.split()
    assert not left, f"containers left: {left}"
