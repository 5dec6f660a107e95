"""A run's rows: each figure beside its target and its baseline, printed as it comes and tabled at the end."""
from __future__ import annotations

from typing import Any


def fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} us"


def without_answers(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "first"}


class Results:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}
        self.failed_checks: list[str] = []

    def add(self, row: str, figure: str, target: str, baseline: str, ratio: float | None, met: bool | None,
            **data: Any) -> None:
        self.rows.append({"row": row, "figure": figure, "target": target, "baseline": baseline, "ratio": ratio,
                          "met": met, **data})
        verdict = "" if met is None else ("  [meets target]" if met else "  [MISSES target]")
        r = f"  x{ratio:.1f}" if ratio else ""
        print(f"  {row}: {figure} (target {target}; baseline {baseline}{r}){verdict}", flush=True)

    def table(self) -> str:
        head = "| row | figure | target | baseline | speed-up | target met |\n|---|---|---|---|---|---|\n"
        lines = []
        for r in self.rows:
            met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
            ratio = f"x{r['ratio']:.1f}" if r["ratio"] else ""
            lines.append(f"| {r['row']} | {r['figure']} | {r['target']} | {r['baseline']} | {ratio} | {met} |")
        return head + "\n".join(lines)

