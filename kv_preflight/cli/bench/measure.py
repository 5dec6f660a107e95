"""What the rows measure with: a call's median time, a Valkey's CPU seconds, and the machine and the code a run
measured (its CPU, its speed of the moment, the checkout's commit), recorded with every run."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from kv_preflight.keys.chain import HAS_C_EXTENSION


def machine() -> dict[str, Any]:
    cpu = ""
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    mem = subprocess.run(["free", "-m"], capture_output=True, text=True).stdout
    vk = subprocess.run(["valkey-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": cpu, "nproc": os.cpu_count(), "avx2": " avx2" in flags, "free_m": mem.strip(),
        "python": platform.python_version(), "valkey": vk, "kernel": platform.release(),
        "c_extension": HAS_C_EXTENSION, "loadavg_start": os.getloadavg(),
    }


def cpu_probe() -> float:
    """Milliseconds for a fixed pure-Python loop (median of 5): a VM's speed can move every figure from one
    minute to the next, so each run records it at its start and end, to compare runs."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        sum(i * i for i in range(200_000))
        times.append(time.perf_counter() - t)
    return sorted(times)[2] * 1000


def source_commit() -> str | None:
    """The checkout's commit (``-dirty`` with local changes), so a kept run names the code it measured; None
    outside a git checkout (an installed wheel)."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def timeit(fn, *, min_time: float = 0.3, repeat: int = 5) -> float:
    """Median seconds per call over ``repeat`` rounds of at least ``min_time`` each."""
    fn()
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t >= min_time / 4:
            break
        n *= 2
    rounds = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t) / n)
    return statistics.median(rounds)


def valkey_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

