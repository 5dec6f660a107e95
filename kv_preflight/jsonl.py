"""JSON-lines files given by users (workloads, tokenizer samples): errors name ``path:line``."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded value) for every non-blank line; ValueError at the first that is not JSON."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc})") from None
