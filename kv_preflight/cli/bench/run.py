"""One bench run: the machine recorded, a private valkey-server started, the rows asked for run one after the
other, the table printed and the document written (--json, --json-file, --html); exit status 1 on a failed check."""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import redis

from kv_preflight.cli.bench.cluster import bench_cluster
from kv_preflight.cli.bench.fleet import bench_fleet
from kv_preflight.cli.bench.ingest import bench_ingest_memory
from kv_preflight.cli.bench.keys import bench_keys
from kv_preflight.cli.bench.measure import cpu_probe, machine, source_commit, timeit
from kv_preflight.cli.bench.predict import bench_http
from kv_preflight.cli.bench.results import Results
from kv_preflight.cli.valkey_server import ValkeyServer


def run(*, quick: bool, only: set[str], as_json: bool = False, json_file: Path | None = None,
        html_file: Path | None = None) -> None:
    t0 = time.perf_counter()
    m = machine()
    m["commit"] = source_commit()
    m["cpu_probe_ms_start"] = cpu_probe()
    print(f"kv-preflight bench on {m['cpu']}, {m['nproc']} cores, load average {m['loadavg_start'][0]:.2f}, "
          f"CPU probe {m['cpu_probe_ms_start']:.1f} ms (a fixed Python loop: lower is a faster moment)", flush=True)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="kvpf-bench-") as d:
        tmp = Path(d)
        vk = ValkeyServer(tmp / "valkey", appendonly=False).start()
        # Valkey 8 frees DEL/FLUSHALL in the background by default: measure memory synchronously.
        rc = redis.Redis.from_url(vk.url)
        for name in ("lazyfree-lazy-user-del", "lazyfree-lazy-user-flush", "lazyfree-lazy-server-del"):
            rc.config_set(name, "no")
        # The memory row is measured at Valkey's default listpack threshold, then at 128 (what
        # ValkeyServer and the compose stack configure) for the side-by-side.
        rc.config_set("hash-max-listpack-value", 64)
        rc.close()
        try:
            if "keys" in only:
                bench_keys(res, quick)
            if "ingest" in only or "memory" in only:
                bench_ingest_memory(res, vk, quick, tmp)
            if "floor" in only:
                from kv_preflight.cli.bench.floor import bench_floor
                bench_floor(res, tmp, quick)
            if "outage" in only:
                from kv_preflight.cli.bench.outage import bench_outage
                bench_outage(res, tmp, quick)
            if "http" in only or "scaling" in only:
                bench_http(res, vk, quick, tmp, "scaling" in only)
            if "cluster" in only:
                bench_cluster(res, vk, quick, tmp)
            if "warnings" in only:
                from kv_preflight.cli.bench.warnings import bench_warnings
                bench_warnings(res, quick, timeit)
            if "fleet" in only:
                from kv_preflight.cli.bench.hybrid import bench_hybrid_fleet

                bench_fleet(res, vk, quick, tmp)
                bench_hybrid_fleet(res, vk, quick, tmp)
            if "route" in only or "lora" in only or "dp" in only:
                from kv_preflight.cli.bench.route import ADAPTERS, bench_route

                if "route" in only:
                    bench_route(res, vk, quick, tmp)
                if "lora" in only:
                    bench_route(res, vk, quick, tmp, ADAPTERS)
                if "dp" in only:
                    bench_route(res, vk, quick, tmp, dp_size=2)
            if "gateway" in only:
                from kv_preflight.cli.bench.gateway import bench_gateway

                bench_gateway(res, vk, quick, tmp)
            if "gateways" in only:
                from kv_preflight.cli.bench.gateway import bench_gateways

                bench_gateways(res, vk, quick, tmp)
        finally:
            vk.stop()
    m["loadavg_end"] = os.getloadavg()
    m["cpu_probe_ms_end"] = cpu_probe()
    m["seconds"] = time.perf_counter() - t0
    print()
    print(res.table())
    print(f"\n{m['seconds']:.0f}s; load average at start {m['loadavg_start'][0]:.2f}, at end {m['loadavg_end'][0]:.2f}; "
          f"CPU probe {m['cpu_probe_ms_start']:.1f} -> {m['cpu_probe_ms_end']:.1f} ms "
          "(other work on this machine, and its speed of the moment, skew every figure)")
    doc = {"machine": m, "rows": res.rows, **res.extra, "failed_checks": res.failed_checks}
    if json_file is not None:
        json_file.write_text(json.dumps(doc, indent=1, default=str))
    if html_file is not None:
        from kv_preflight.cli.bench.report import render_html

        html_file.write_text(render_html(json.loads(json.dumps(doc, default=str))))
        print(f"wrote {html_file}")
    if as_json:
        print(json.dumps(doc, default=str))
    if res.failed_checks:
        print("\nFAILED CHECKS:\n  " + "\n  ".join(res.failed_checks))
        sys.exit(1)

