"""The prompts the HTTP rows send: prompt sets loaded into the index (each pod holding its own share of each
prompt, the expected answer known) and a run of the load generator (cli/bench/loadgen.py) over one, every first
answer checked against the expected one."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kv_preflight.cli.bench import loadgen
from kv_preflight.cli.bench.procs import python
from kv_preflight.cli.bench.workload import tokens
from kv_preflight.index.entries import CHAIN_ROOT
from kv_preflight.index.index import Index, StoreBlock
from kv_preflight.keys.chain import request_keys
from kv_preflight.predictor.scoring.score import engine_cached_tokens

MODEL = "bench-model"
C = 16  # canonical block
E = 32  # engine block (vLLM on CPU)


class PromptSet:
    def __init__(self, name: str, bodies: list[bytes], expected: list[tuple[int, str | None]]):
        self.name, self.bodies, self.expected = name, bodies, expected


async def load_set(index: Index, name: str, *, n_prompts: int, length: int, n_pods: int, seed: int) -> PromptSet:
    """Prompts whose chains ``n_pods`` pods hold in part: pod i holds about (i + 1) / n_pods of the prefix."""
    import random

    rng = random.Random(seed)
    fractions = [(i + 1) / n_pods for i in range(n_pods)]
    bodies, expected = [], []
    pods = [f"{name}-pod-{i}" for i in range(n_pods)]
    for p in range(n_prompts):
        toks = tokens(length, seed * 1000 + p)
        keys = request_keys(toks, model=MODEL)
        n_engine = len(keys) // (E // C)
        held = {}
        for i, pod in enumerate(pods):
            f = min(1.0, max(0.02, fractions[i] + rng.uniform(-0.04, 0.04) if fractions[i] < 1 else 1.0))
            nb = max(1, int(round(n_engine * f)))
            held[pod] = nb * (E // C)
            fld = index.entry_field(pod, "GPU", 0)
            stores = [StoreBlock(keys[2 * j + 1] ^ 0x5EED, "gpu", fld, (keys[2 * j], keys[2 * j + 1]),
                                 parent=keys[2 * j - 1] if j else CHAIN_ROOT) for j in range(nb)]
            for s in range(0, len(stores), 512):
                await index.apply_batch(pod_id=pod, rank=0, seq=0, ts=0.0, model=MODEL, engine_block_size=E,
                                        mutations=stores[s:s + 512], mode="import")
        best = sorted(((engine_cached_tokens(b, C, E, length), pod) for pod, b in held.items()),
                      key=lambda x: (-x[0], x[1]))[0]
        bodies.append(json.dumps({"model": MODEL, "token_ids": toks}, separators=(",", ":")).encode())
        expected.append(best)
    return PromptSet(name, bodies, expected)


def run_load(port: int, ps: PromptSet, tmp: Path, *, concurrency: int = 1, requests: int | None = None,
             duration_s: float | None = None, warmup: int = 20) -> dict:
    bodies_path = tmp / f"{ps.name}.bodies"
    if not bodies_path.exists():
        loadgen.write_bodies(str(bodies_path), ps.bodies)
    spec = {"host": "127.0.0.1", "port": port, "bodies": str(bodies_path), "concurrency": concurrency,
            "requests": requests, "duration_s": duration_s, "warmup_requests": warmup}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    out = subprocess.run([python(), "-m", "kv_preflight.cli.bench.loadgen", str(spec_path)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    bad = [s for s in result["statuses"] if s != "200"]
    if bad:
        raise RuntimeError(f"non-200 answers from port {port}: {result['statuses']}; first: {list(result['first'].values())[:1]}")
    for k, body in result["first"].items():
        doc = json.loads(body)
        tokens_exp, pod_exp = ps.expected[int(k)]
        if (doc["predicted_cached_tokens"], doc["best_pod"]) != (tokens_exp, pod_exp):
            raise RuntimeError(f"{ps.name}[{k}]: predicted {doc['predicted_cached_tokens']} on {doc['best_pod']}, "
                               f"expected {tokens_exp} on {pod_exp}")
    return result

