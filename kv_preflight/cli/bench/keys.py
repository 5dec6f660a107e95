"""Row ``keys``: request keys from tokens, the C routine against cbor2 and pure-Python FNV."""
from __future__ import annotations

from kv_preflight.cli.bench.measure import timeit
from kv_preflight.cli.bench.prompts import C, MODEL
from kv_preflight.cli.bench.results import Results
from kv_preflight.cli.bench.workload import tokens
from kv_preflight.keys.chain import request_keys, request_keys_reference


def bench_keys(res: Results, quick: bool) -> None:
    print("request keys (C routine vs cbor2 + pure-Python FNV)", flush=True)
    toks = tokens(32768, 1)
    for n, target_ms in ((4096, 0.15), (32768, 1.0)):
        t = toks[:n]
        ours = timeit(lambda: request_keys(t, model=MODEL), min_time=0.2 if quick else 0.5)
        base = timeit(lambda: request_keys_reference(t, model=MODEL), min_time=0.2, repeat=3)
        assert request_keys(t, model=MODEL) == request_keys_reference(t, model=MODEL)
        res.add(f"request keys, {n // 1024}K tokens ({n // C} blocks)",
                f"{ours * 1e3:.3f} ms ({n / ours / 1e6:.0f}M tokens/s)", f"<= {target_ms} ms",
                f"{base * 1e3:.1f} ms", base / ours, ours * 1e3 <= target_ms,
                ours_s=ours, baseline_s=base, tokens=n)

