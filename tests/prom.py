"""Read one sample from the Prometheus text format, whatever the label order."""
from __future__ import annotations

import re


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the first ``name`` sample whose labels include ``labels`` (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(got.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
