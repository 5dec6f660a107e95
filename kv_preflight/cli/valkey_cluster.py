"""Start and stop a private Valkey Cluster on loopback: real valkey-server processes in cluster
mode (3 masters with one replica each by default), made a cluster with ``valkey-cli --cluster
create``. Used by ``kv-preflight up --cluster``, the test suite and the benchmark.

``cluster-require-full-coverage no`` keeps the shards that are up answering while one is down (an
answer is then marked partial), and a short node timeout (2 s in tests) makes failover quick.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kv_preflight.cli.valkey_server import ValkeyServer


CLUSTER_PORTS = (20000, 22768)  # [lo, hi): below Linux's ephemeral range, P + 10000 too


def cluster_port(lo: int = CLUSTER_PORTS[0], hi: int = CLUSTER_PORTS[1]) -> int:
    """A free port P in [lo, hi) with P + 10000 free too (the cluster bus). Both below Linux's ephemeral range
    (32768-60999), so a node restarted on its port never meets a port the kernel handed out meanwhile."""
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(lo, hi)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port pair (P, P + 10000) in {lo}-{hi} for a cluster node")


def cli_binary() -> str:
    for name in ("valkey-cli", "redis-cli"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("valkey-cli (or redis-cli) is needed to form a cluster; run scripts/install-valkey")


@dataclass
class ValkeyCluster:
    data_dir: Path
    masters: int = 3
    replicas: int = 1
    node_timeout_ms: int = 2000
    appendonly: bool = True
    debug_command: bool = False
    tied_to_parent: bool = False  # every node, as ValkeyServer's (`up --cluster`)
    tls_cert: Path | None = None  # with tls_key: TLS only, for clients, the cluster bus and replication
    tls_key: Path | None = None
    requirepass: str = field(default="", repr=False)  # every node's (clients and replication); the URL carries it
    nodes: list[ValkeyServer] = field(default_factory=list, repr=False)

    @property
    def url(self) -> str:
        """Any node's URL names the cluster; the first master's (without its database number)."""
        base, sep, query = self.nodes[0].url.partition("?")
        return base.rsplit("/", 1)[0] + sep + query

    @property
    def tls(self) -> bool:
        """TLS only (a cert and its key given), as ValkeyServer decides for each node."""
        return bool(self.tls_cert and self.tls_key)

    def cli(self, *args: str) -> list[str]:
        """A valkey-cli command line for this cluster's nodes (over TLS when it is)."""
        tls = ["--tls", "--cacert", str(self.tls_cert)] if self.tls else []
        auth = ["-a", self.requirepass, "--no-auth-warning"] if self.requirepass else []
        return [cli_binary(), *tls, *auth, *args]

    def _node(self, i: int, port: int) -> ValkeyServer:
        d = self.data_dir.resolve() / f"node-{i}"
        tls = ("--tls-cluster", "yes", "--tls-replication", "yes") if self.tls else ()
        auth = ("--masterauth", self.requirepass) if self.requirepass else ()  # a replica AUTHs to its master
        return ValkeyServer(d, port=port, appendonly=self.appendonly, debug_command=self.debug_command,
                            tied_to_parent=self.tied_to_parent, tls_cert=self.tls_cert, tls_key=self.tls_key,
                            requirepass=self.requirepass, extra_args=tls + auth + (
            "--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
            # a replica of a dead master takes over without waiting for an operator
            "--cluster-replica-validity-factor", "0",
            # a (re)joining replica syncs at once, from memory
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
        ))

    def start(self, timeout_s: float = 30.0) -> "ValkeyCluster":
        """Start the nodes; a data directory that already holds this cluster (cluster.json, each
        node's nodes.conf and AOF) brings the same cluster back on the same ports."""
        saved = self.data_dir.resolve() / "cluster.json"
        if not self.nodes and saved.exists():
            ports = json.loads(saved.read_text())["ports"]
            self.nodes = [self._node(i, p) for i, p in enumerate(ports)]
        if self.nodes:  # a restart: same ports, same nodes.conf
            try:
                for n in self.nodes:
                    n.start()
            except Exception:
                self.stop()
                raise
            self.wait_ok(timeout_s)
            return self
        count = self.masters * (1 + self.replicas)
        try:
            for i in range(count):
                self.nodes.append(self._node(i, cluster_port()).start())
        except Exception:
            self.stop()
            raise
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        out = subprocess.run(self.cli("--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                                      "--cluster-yes"), capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            self.stop()
            raise RuntimeError(f"valkey-cli --cluster create failed: {out.stdout[-1500:]} {out.stderr[-500:]}")
        saved.write_text(json.dumps({"ports": [n.port for n in self.nodes]}))
        self.wait_ok(timeout_s)
        return self

    def info(self, node: ValkeyServer, section: str = "cluster") -> str:
        return subprocess.run(self.cli("-p", str(node.port), "cluster", "info" if section == "cluster" else section),
                              capture_output=True, text=True, timeout=10).stdout

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node says cluster_state:ok and every running replica is in sync."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            if running and all("cluster_state:ok" in self.info(n) for n in running) and self._replicas_online(running):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the cluster did not reach cluster_state:ok with its replicas in sync in {timeout_s}s")

    def _replicas_online(self, running: list[ValkeyServer]) -> bool:
        for n in running:
            info = subprocess.run(self.cli("-p", str(n.port), "info", "replication"), capture_output=True,
                                  text=True, timeout=10).stdout
            if "role:slave" in info and "master_link_status:up" not in info:
                return False
            if "role:master" in info and ("state=wait_bgsave" in info or "state=send_bulk" in info):
                return False
        return True

    def masters_now(self) -> list[ValkeyServer]:
        """The nodes that are masters right now (after failovers, not the ones created as such)."""
        out = []
        for n in self.nodes:
            if n.proc is None or n.proc.poll() is not None:
                continue
            role = subprocess.run(self.cli("-p", str(n.port), "role"), capture_output=True, text=True,
                                  timeout=10).stdout.split()
            if role and role[0] == "master":
                out.append(n)
        return out

    def node_at(self, port: int) -> ValkeyServer:
        return next(n for n in self.nodes if n.port == port)

    def replicas_of(self, master: ValkeyServer) -> list[ValkeyServer]:
        """The nodes replicating ``master`` now (from CLUSTER NODES, as the master sees it)."""
        out = subprocess.run(self.cli("-p", str(master.port), "cluster", "nodes"), capture_output=True,
                             text=True, timeout=10).stdout.splitlines()
        ids = {line.split()[0]: line for line in out}
        mine = next(line.split()[0] for line in out if "myself" in line.split()[2])
        ports = [int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in ids.values()
                 if line.split()[3] == mine]
        return [n for n in self.nodes if n.port in ports]

    def hold_replicas(self, master: ValkeyServer | None = None) -> list[ValkeyServer]:
        """A replica outage: every replica of the cluster (or of ``master`` alone) stopped (SIGSTOP) and cut off
        from its master, so no write is confirmed by a replica from here on. Returns them, for ``release_replicas``."""
        masters = self.masters_now() if master is None else [master]
        held = [r for m in masters for r in self.replicas_of(m)]
        for n in held:
            os.kill(n.proc.pid, signal.SIGSTOP)
        for m in masters:  # a stopped replica's link stays open until its master's timeout: closed now
            subprocess.run(self.cli("-p", str(m.port), "client", "kill", "type", "replica"), capture_output=True,
                           timeout=10, check=True)
        return held

    @staticmethod
    def release_replicas(held: list[ValkeyServer]) -> None:
        """The held replicas running again (those still alive): they reconnect and sync."""
        for n in held:
            if n.proc is not None and n.proc.poll() is None:
                os.kill(n.proc.pid, signal.SIGCONT)

    def stop(self, kill: bool = False) -> None:
        for n in self.nodes:
            n.stop(kill=kill)


__all__ = ["ValkeyCluster", "cli_binary", "cluster_port"]
