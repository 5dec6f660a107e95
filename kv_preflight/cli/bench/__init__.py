"""``scripts/bench``: every performance figure of kv-preflight, next to a straightforward baseline.

Run ``python -m kv_preflight.cli.bench`` (or ``scripts/bench``, or ``kv-preflight bench``); see docs/benchmarks.md.
"""
