"""Valkey instructions per engine block event on the write-path workload (``scripts/callgrind``).

CPU seconds on a shared machine move by tens of percent between runs; the instructions Valkey executes for the
same events do not. This runs the floor row's workload (kv_preflight/cli/bench/floor.py, the quick steady
stream: 8 pods, LRU caches of 2,048 blocks, 20K measured block events) against valkey-servers under
valgrind's callgrind, once through kv-preflight's ingester and once as the floor writer (llm-d's bare layout),
on a single node and on a 3-master cluster (no replicas), and prints instructions per block event summed over
the servers. Only the measured part is counted (instrumentation is switched on after the warm-up), and the
server's timer work (``serverCron``) is left out: it runs by the clock, ten times a second, and valgrind's
slowdown multiplies it by the run's length, not by the work. About a minute; needs valgrind.

``--only gateway`` counts the gateway's instructions per forwarded request (4K-token prompts its one engine holds,
each decided, booked, forwarded and answered): the steady figure behind the bench's gateway rows, whose CPU and
latency figures move with the machine. About a minute.

``--only ingester`` counts the other side: the ingester process's own instructions per block event (its handler
fed the same measured events, the Valkey servers run as usual), on a single node and on the 3-master cluster.
Their ratio is the steady figure of what a cluster adds to the ingester's work (the bench's "one ingester,
cluster" row prints it in CPU seconds, which also hold the kernel's socket work that the cluster's extra round
trips add to and instructions in user space do not count). About four minutes.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

import redis

from kv_preflight.cli.bench.floor import FloorWriter, _ours, block_events, steady_stream
from kv_preflight.cli.valkey_server import free_port, server_binary


def _start(port: int, workdir: str, cluster: bool) -> subprocess.Popen:
    os.makedirs(workdir, exist_ok=True)
    args = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={workdir}/cg.out",
            server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", workdir]
    if cluster:
        args += ["--cluster-enabled", "yes", "--cluster-node-timeout", "60000"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(600):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.2)
    raise RuntimeError(f"valkey-server under valgrind did not start on port {port}")


def _instructions(workdir: str) -> int:
    """The dump's instructions less serverCron's (inclusive), from callgrind_annotate."""
    total = cron = 0
    for path in glob.glob(f"{workdir}/cg.out*"):
        with open(path) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = max(total, int(line.split()[1]))
        out = subprocess.run(["callgrind_annotate", "--inclusive=yes", path], capture_output=True, text=True).stdout
        for line in out.splitlines():  # "21,212,363 ( 6.21%)  ???:serverCron [/usr/bin/valkey-server]"
            if ":serverCron " in line:
                cron = max(cron, int(line.split()[0].replace(",", "")))
    return total - cron


def measure(side: str, cluster: bool, tmp: str) -> float:
    stream = steady_stream(True)
    warm, measured = stream.frames[:stream.warm_frames], stream.frames[stream.warm_frames:]
    events = block_events(measured)
    ports = [free_port() for _ in range(3 if cluster else 1)]
    procs = [_start(p, f"{tmp}/{p}", cluster) for p in ports]
    try:
        if cluster:
            out = subprocess.run([shutil.which("valkey-cli") or "redis-cli", "--cluster", "create",
                                  *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(f"cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
            for _ in range(600):
                if all(redis.Redis(port=p).cluster("info")["cluster_state"] == "ok" for p in ports):
                    break
                time.sleep(0.3)

        def toggle(on: bool) -> None:
            for proc in procs:
                subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(proc.pid)], capture_output=True)

        url = f"redis://127.0.0.1:{ports[0]}"
        if side == "ours":
            asyncio.run(_ours(url, warm, measured, [], on_measure=toggle))
        else:
            async def floor() -> None:
                writer = FloorWriter(url, cluster=cluster)
                await writer.write(warm)
                toggle(True)
                await writer.write(measured)
                toggle(False)
                await writer.client.aclose()
            asyncio.run(floor())
        for proc in procs:
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True)
        time.sleep(1)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
    return sum(_instructions(f"{tmp}/{p}") for p in ports) / events


def _ingester_child(topology: str) -> None:
    """Run under valgrind (``ingester``): the floor row's ingester against a Valkey of ours, instrumentation on for
    the measured part only; prints the measured block events."""
    from pathlib import Path

    from kv_preflight.cli.valkey_cluster import ValkeyCluster
    from kv_preflight.cli.valkey_server import ValkeyServer

    stream = steady_stream(True)
    warm, measured = stream.frames[:stream.warm_frames], stream.frames[stream.warm_frames:]

    def toggle(on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True,
                       check=True, timeout=300)

    with tempfile.TemporaryDirectory() as tmp:
        if topology == "cluster":
            server = ValkeyCluster(Path(tmp) / "c", appendonly=False, replicas=0).start()
        else:
            server = ValkeyServer(Path(tmp) / "s", appendonly=False).start()
        try:
            asyncio.run(_ours(server.url, warm, measured, [], on_measure=toggle))
        finally:
            server.stop()
    print(f"EVENTS {block_events(measured)}", flush=True)


def measure_ingester(topology: str, tmp: str) -> float:
    """The ingester's instructions per block event (``_ingester_child`` under callgrind)."""
    out = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.out",
                          sys.executable, "-m", "kv_preflight.cli.bench.callgrind", "--ingester-child", topology],
                         capture_output=True, text=True, timeout=3600)
    events = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("EVENTS ")]
    if out.returncode != 0 or not events:
        raise RuntimeError(f"the ingester under valgrind failed ({out.returncode}): {out.stderr[-1500:]}")
    total = 0
    with open(f"{tmp}/cg.out") as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                total = max(total, int(line.split()[1]))
    return total / events[0]


def _up(url: str, model: str) -> bool:
    """The gateway answers and lists the model (under valgrind it takes a while to listen at all)."""
    import httpx

    from kv_preflight.cli.bench import gateway as gw
    try:
        return gw._serves(url, model)
    except httpx.HTTPError:
        return False


def measure_gateway(tmp: str, requests: int = 300) -> float:
    """The gateway's instructions per forwarded request: ``kv-preflight gateway`` under callgrind, one engine (the
    bench's echo engine, answering at once) holding the gateway row's 4K-token prompts in the index, requests sent
    one after another (each decided, booked, forwarded and answered), instrumentation on after a warm-up."""
    from pathlib import Path

    import httpx
    import msgspec

    from kv_preflight.cli.bench import gateway as gw
    from kv_preflight.cli.bench.procs import Server, python
    from kv_preflight.cli.valkey_server import ValkeyServer

    vk = ValkeyServer(Path(tmp) / "vk", appendonly=False).start()
    engine = proc = None
    try:
        prompts = gw.speed_prompts(16)
        bodies = [msgspec.json.encode({"model": gw.MODEL, "prompt": p, "max_tokens": 1}) for p in prompts]
        engine_port, port = free_port(), free_port()
        engine = Server([python(), "-m", "kv_preflight.cli.bench.echo_engine", str(engine_port), gw.MODEL, "0"],
                        engine_port, Path(tmp) / "echo.log").ready()
        asyncio.run(gw._fleet(vk.url, {"echo-0": f"http://127.0.0.1:{engine_port}"}, {"echo-0": prompts}))
        # deadlines for valgrind's pace (the gateway's own Valkey and engine timeouts)
        env = {**os.environ, "KVPF_VALKEY_TIMEOUT": "20"}
        proc = subprocess.Popen(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.out",
                                 python(), "-m", "kv_preflight", "gateway", "--valkey-url", vk.url, "--port", str(port),
                                 "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as c:
            deadline = time.monotonic() + 600
            while not _up(url, gw.MODEL):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the gateway under valgrind did not come up")
                time.sleep(1)
            for i in range(60):
                c.post(url + "/v1/completions", content=bodies[i % len(bodies)]).raise_for_status()
            subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], capture_output=True, check=True)
            reasons: dict[str, int] = {}
            for i in range(requests):
                r = c.post(url + "/v1/completions", content=bodies[i % len(bodies)])
                r.raise_for_status()
                reasons[r.headers["x-kvpf-reason"]] = reasons.get(r.headers["x-kvpf-reason"], 0) + 1
            time.sleep(0.5)  # the last releases written
            subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], capture_output=True, check=True)
            subprocess.run(["callgrind_control", "-d", str(proc.pid)], capture_output=True, check=True)
        if reasons != {"best_overlap": requests}:
            raise RuntimeError(f"the gateway decided otherwise than by the prompts it holds: {reasons}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
        if engine is not None:
            engine.stop()
        vk.stop()
    total = 0
    for path in glob.glob(f"{tmp}/cg.out*"):
        with open(path) as f:
            for line in f:
                if line.startswith("totals:"):
                    total += int(line.split()[1])
    return total / requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="single,cluster",
                        help="single, cluster (Valkey's instructions; both by default), ingester (the ingester's own) "
                             "or gateway (the gateway's per forwarded request)")
    parser.add_argument("--ingester-child", choices=("single", "cluster"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ingester_child:
        _ingester_child(args.ingester_child)
        return 0
    unknown = set(args.only.split(",")) - {"single", "cluster", "ingester", "gateway"}
    if unknown:
        parser.error(f"--only takes single, cluster, ingester and/or gateway, not {', '.join(sorted(unknown))}")
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            print(f"{tool} is not installed (valgrind's package provides it)", file=sys.stderr)
            return 2
    figures: dict[tuple[str, str], float] = {}
    if "ingester" in args.only.split(","):
        per = {}
        for topology in ("single", "cluster"):
            with tempfile.TemporaryDirectory() as tmp:
                per[topology] = measure_ingester(topology, tmp)
            print(f"ingester {topology:8s} {per[topology]:>10,.0f} instructions per block event", flush=True)
        print(f"ingester cluster rate / single node rate: {per['single'] / per['cluster']:.2f}x", flush=True)
    if "gateway" in args.only.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"gateway  {measure_gateway(tmp):>10,.0f} instructions per forwarded request (4K-token prompts)",
                  flush=True)
    for topology in [t for t in args.only.split(",") if t not in ("ingester", "gateway")]:
        for side in ("floor", "ours"):
            with tempfile.TemporaryDirectory() as tmp:
                figures[(topology, side)] = measure(side, topology == "cluster", tmp)
            print(f"{topology:8s} {side:6s} {figures[(topology, side)]:>10,.0f} instructions per block event",
                  flush=True)
        ours, floor = figures[(topology, "ours")], figures[(topology, "floor")]
        print(f"{topology:8s} ours / floor: {ours / floor:.2f}x", flush=True)
    if ("single", "ours") in figures and ("cluster", "ours") in figures:
        print(f"cluster / single node: ours {figures[('cluster', 'ours')] / figures[('single', 'ours')]:.2f}x, "
              f"floor {figures[('cluster', 'floor')] / figures[('single', 'floor')]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
