"""``kv-preflight bench --html FILE``: one run's rows as a self-contained page with charts.

The same approach as ``diagnose fleet --html`` (cli/diagnose.py): inline CSS, no script, no link, so the file
opens anywhere and can be kept beside the run's JSON. Pure: the page is made from the document ``--json-file``
writes (``render_html(json.load(f))`` renders a kept run too).

Two charts: each row's speed-up over its baseline, on a log scale (green: the row meets its target, red: it
misses it, grey: no target), and, for the rows that time one operation both ways (``ours_s`` and
``baseline_s``), the two times side by side. Then the table as the terminal prints it, the failed checks,
and the machine the run was made on.
"""
from __future__ import annotations

import html
import math
from typing import Any

MAX_DECADES = 4  # the speed-up chart spans 1x to 10^4x


def _speedup_width(ratio: float | None) -> float:
    """A bar's width in percent for a speed-up, on a log scale from 1x (a sliver) to 10^MAX_DECADES x (full)."""
    if not ratio or ratio <= 0:
        return 0.0
    return max(1.0, min(100.0, math.log10(max(ratio, 1.0)) / MAX_DECADES * 100 + 1))


def _verdict(met: bool | None) -> str:
    return "none" if met is None else "met" if met else "missed"


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


def render_html(doc: dict[str, Any]) -> str:
    esc = html.escape
    rows = doc.get("rows") or []
    m = doc.get("machine") or {}
    speed = []
    for r in rows:
        ratio = r.get("ratio")
        label = "n/a" if not ratio else f"x{ratio:.1f}"
        speed.append(f'<tr><th>{esc(str(r["row"]))}</th><td class="chart"><div class="bar {_verdict(r.get("met"))}" '
                     f'style="width:{_speedup_width(ratio):.1f}%"></div></td><td>{label}</td>'
                     f'<td>{esc(str(r.get("target", "")))}</td></tr>')
    timed = [r for r in rows if isinstance(r.get("ours_s"), (int, float)) and isinstance(r.get("baseline_s"), (int, float))]
    pairs = []
    for r in timed:
        top = max(r["ours_s"], r["baseline_s"]) or 1.0
        pairs.append(f'<tr><th rowspan="2">{esc(str(r["row"]))}</th><td>ours</td><td class="chart"><div class="bar ours" '
                     f'style="width:{max(0.5, r["ours_s"] / top * 100):.1f}%"></div></td><td>{_seconds(r["ours_s"])}</td></tr>'
                     f'<tr><td>baseline</td><td class="chart"><div class="bar base" style="width:'
                     f'{max(0.5, r["baseline_s"] / top * 100):.1f}%"></div></td><td>{_seconds(r["baseline_s"])}</td></tr>')
    cells = []
    for r in rows:
        ratio = "" if not r.get("ratio") else f"x{r['ratio']:.1f}"
        met = "" if r.get("met") is None else "yes" if r["met"] else "no"
        cells.append(f"<tr><td>{esc(str(r['row']))}</td><td>{esc(str(r.get('figure', '')))}</td>"
                     f"<td>{esc(str(r.get('target', '')))}</td><td>{esc(str(r.get('baseline', '')))}</td>"
                     f"<td>{ratio}</td><td class=\"{_verdict(r.get('met'))}\">{met}</td></tr>")
    table = "".join(cells)
    failed = doc.get("failed_checks") or []
    checks = ("<h2>Failed checks</h2><ul>" + "".join(f"<li>{esc(c)}</li>" for c in failed) + "</ul>") if failed else \
        "<p>Every correctness check passed.</p>"
    load = m.get("loadavg_start") or [None]
    machine = (f"{esc(str(m.get('cpu', '?')))}, {esc(str(m.get('nproc', '?')))} cores; commit "
               f"{esc(str(m.get('commit') or 'unknown'))}; load average at start {load[0]}; "
               f"{m.get('seconds', 0):.0f} s")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>kv-preflight bench</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;margin:1em 0}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}} td.chart{{width:24em}}
.bar{{height:1em}} .met{{background:#3a7}} .missed{{background:#c33}} .none{{background:#999}}
.ours{{background:#3a7}} .base{{background:#999}} td.met,td.missed,td.none{{background:none}}
td.missed{{color:#c33;font-weight:bold}}
</style></head><body>
<h1>kv-preflight bench</h1>
<p>{machine}. Other work on the machine skews every figure (docs/benchmarks.md).</p>
<h2>Speed-up over the baseline</h2>
<p>Log scale, 1x to 10<sup>{MAX_DECADES}</sup>x; green: meets its target, red: misses it, grey: no target.</p>
<table><tr><th>row</th><th>speed-up</th><th></th><th>target</th></tr>{''.join(speed)}</table>
<h2>Time per operation, ours and the baseline's</h2>
<table><tr><th>row</th><th></th><th>time</th><th></th></tr>{''.join(pairs) or '<tr><td colspan="4">no row timed both ways</td></tr>'}</table>
<h2>Rows</h2>
<table><tr><th>row</th><th>figure</th><th>target</th><th>baseline</th><th>speed-up</th><th>target met</th></tr>{table}</table>
{checks}
</body></html>
"""


__all__ = ["render_html"]
