"""`kv-preflight bench --html`: the page made from a run's document (cli/bench/report.py), pure."""
from __future__ import annotations

import re

from kv_preflight.cli.bench.report import render_html

DOC = {"machine": {"cpu": "test cpu", "nproc": 2, "commit": "abc123", "loadavg_start": [0.5], "seconds": 12.0},
       "rows": [{"row": "request keys, 4K tokens", "figure": "0.1 ms", "target": "<= 0.15 ms", "baseline": "3 ms",
                 "ratio": 30.0, "met": True, "ours_s": 1e-4, "baseline_s": 3e-3},
                {"row": "predict p50 <b>", "figure": "2 ms", "target": "<= 1 ms", "baseline": "9 ms", "ratio": 4.5,
                 "met": False},
                {"row": "memory", "figure": "90 B", "target": "", "baseline": "", "ratio": None, "met": None}],
       "failed_checks": ["the bitmap lookup differed"]}


def test_every_row_is_charted_and_tabled_with_its_verdict():
    page = render_html(DOC)
    assert page.startswith("<!doctype html>") and "<script" not in page and "<link" not in page
    bars = re.findall(r'<div class="bar (met|missed|none)" style="width:([\d.]+)%"', page)
    assert [b[0] for b in bars] == ["met", "missed", "none"]
    assert float(bars[0][1]) > float(bars[1][1]) > float(bars[2][1]) == 0.0  # x30 beyond x4.5, none drawn
    assert "predict p50 &lt;b&gt;" in page and "<b>" not in page
    assert page.count('class="bar ours"') == 1 and "100 µs" in page and "3 ms" in page  # timed both ways: one row
    assert "the bitmap lookup differed" in page and "abc123" in page


def test_a_run_without_failures_says_so():
    page = render_html({**DOC, "failed_checks": []})
    assert "Every correctness check passed." in page
