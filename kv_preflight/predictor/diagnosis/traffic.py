"""What the predictions made so far add up to, for ``kv-preflight diagnose fleet``: pure counting, bounded.

``p``, the fleet's cache ceiling under perfect affinity, is the best pod's cached tokens over the prompt
tokens of the predictions made; prefix families are the chains sharing their first request key (one
key per model and first block). Counting them costs a few dict operations per prediction; the families
tracked are bounded (MAX_FAMILIES), later new ones only counted as untracked, so a flood of distinct
prompts cannot grow memory. ``/stats`` serves the totals; the diagnosis takes two readings and subtracts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_FAMILIES = 1024
FAMILIES_SHOWN = 64


@dataclass
class Traffic:
    predictions: int = 0
    prompt_tokens: int = 0
    best_cached_tokens: int = 0
    untracked: int = 0  # predictions of families beyond MAX_FAMILIES
    families: dict[str, list[Any]] = field(default_factory=dict)  # first key -> [model, predictions]

    def observe(self, model: str, first_key: int | None, prompt_tokens: int, best_cached: int) -> None:
        self.predictions += 1
        self.prompt_tokens += prompt_tokens
        self.best_cached_tokens += best_cached
        if first_key is None:
            return
        key = str(first_key)
        fam = self.families.get(key)
        if fam is not None:
            fam[1] += 1
        elif len(self.families) < MAX_FAMILIES:
            self.families[key] = [model, 1]
        else:
            self.untracked += 1

    def as_dict(self, top: int = FAMILIES_SHOWN) -> dict[str, Any]:
        busiest = sorted(self.families.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
        return {"predictions": self.predictions, "prompt_tokens": self.prompt_tokens,
                "best_cached_tokens": self.best_cached_tokens, "untracked": self.untracked,
                "families_tracked": len(self.families),
                "families": [{"first_key": k, "model": m, "predictions": n} for k, (m, n) in busiest]}
