"""``python -m ftshims.monitor report run.jsonl [more.jsonl ...] [--html out.html]``.

Prints a summary of the monitor's JSON lines (the run, the loss and gradient
norm, every finding with what explains it); ``--html`` writes one self-contained
file: inline CSS and SVG (the loss and gradient-norm curves, each finding marked
at its step), no script, nothing fetched from the network.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .jsonl import read


def _float(value) -> Optional[float]:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class Run:
    """The records of one rank's file, grouped."""

    def __init__(self, records: List[Dict[str, Any]]):
        self.header = next((r for r in records if r.get("type") == "header"), {})
        self.summary = next((r for r in records if r.get("type") == "summary"), None)
        self.findings = [r for r in records if r.get("type") == "finding"]
        self.skips = [r for r in records if r.get("type") == "skip"]
        self.updates = [r for r in records if r.get("type") == "updates" and _float(r.get("ratio")) is not None]
        self.file = records[0].get("_file", "") if records else ""
        self.rank = self.header.get("rank", records[0].get("rank", 0) if records else 0)
        steps = [r for r in records if r.get("type") == "step"]
        logs = [r for r in records if r.get("type") == "log"]
        self.loss = self._series(steps, "loss") or self._series(logs, "loss")
        self.grad_norm = self._series(steps, "grad_norm") or self._series(logs, "grad_norm")
        self.steps = max([r.get("step", 0) for r in steps + logs] or [0])

    @staticmethod
    def _series(records, key) -> List[Tuple[int, Optional[float], Any]]:
        return [(r["step"], _float(r.get(key)), r.get(key)) for r in records if key in r and r.get(key) is not None]


def load(paths: Sequence[str]) -> List[Run]:
    runs = []
    for path in paths:
        records = read([path])
        if records:
            runs.append(Run(records))
    return runs


def summary_text(runs: List[Run]) -> str:
    lines = []
    for run in runs:
        h = run.header
        versions = ", ".join(f"{k} {v}" for k, v in (h.get("versions") or {}).items())
        fingerprint = (h.get("fingerprint") or {}).get("hash")
        lines.append(f"{run.file}: rank {run.rank} of {h.get('world_size', 1)}, {run.steps} steps, "
                     f"model {h.get('model', '?')}" + (f", ftshims fingerprint {fingerprint}" if fingerprint else ""))
        if versions:
            lines.append(f"  {versions}")
        for name, series in (("loss", run.loss), ("grad norm", run.grad_norm)):
            finite = [v for _, v, _ in series if v is not None]
            bad = [s for s, v, _ in series if v is None]
            if finite:
                text = f"  {name}: first {finite[0]:.4g}, last {finite[-1]:.4g}, min {min(finite):.4g}, max {max(finite):.4g}"
                if bad:
                    text += f"; non-finite at {len(bad)} step(s) from step {bad[0]}"
                lines.append(text)
        if run.updates:
            ratios = [_float(r["ratio"]) for r in run.updates]
            lines.append(f"  update ratio ||dw||/||w|| (median of the sampled tensors, {len(ratios)} sampled steps): "
                         f"first {ratios[0]:.3g}, last {ratios[-1]:.3g}, min {min(ratios):.3g}, max {max(ratios):.3g}")
        if run.skips:
            lines.append(f"  {len(run.skips)} update(s) skipped (policy skip): " + ", ".join(
                f"step {r.get('step')} ({', '.join(r.get('reasons') or [])}; by {r.get('by')})" for r in run.skips[:20])
                + (" ..." if len(run.skips) > 20 else ""))
        if not run.findings:
            lines.append("  no findings")
        for f in run.findings:
            lines.append(f"  [{f.get('severity')}] {f.get('code')} at step {f.get('step')}: {f.get('message')}")
            applied = (f.get("detail") or {}).get("applied") or {}
            if f.get("explains"):
                lines.append("    explains: " + ", ".join(
                    f"{i} ({'applied' if applied.get(i) else 'not applied'})" for i in f["explains"]))
        if run.summary and run.summary.get("ranks"):
            lines.append("  every rank: " + "; ".join(
                f"rank {r}: {', '.join(codes) or 'no findings'}" for r, codes in enumerate(run.summary["ranks"])))
    return "\n".join(lines)


# -- HTML -------------------------------------------------------------------------------------------

WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 760, 230, 64, 16, 24, 36


def _ticks(low: float, high: float, count: int = 5) -> List[float]:
    if high <= low:
        return [low]
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def chart(title: str, series, findings) -> str:
    """An inline SVG line chart of ``series`` [(step, value or None, raw)] with ``findings`` marked at their steps."""
    points = [(s, v) for s, v, _ in series if v is not None]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="{html.escape(title)}"><text x="{LEFT}" y="16" class="t">{html.escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{LEFT}" y="{HEIGHT // 2}">no values recorded</text></svg>')
        return "".join(parts)
    steps = [s for s, _ in points] + [int(f.get("step", 0)) for f in findings]
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    if y1 == y0:
        y0, y1 = y0 - 1.0, y1 + 1.0
    if x1 == x0:
        x1 = x0 + 1

    def x(step):
        return LEFT + (step - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT)

    def y(value):
        return TOP + (y1 - value) / (y1 - y0) * (HEIGHT - TOP - BOTTOM)

    base = HEIGHT - BOTTOM
    parts.append(f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}" class="a"/>'
                 f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{base}" class="a"/>')
    for value in _ticks(y0, y1):
        parts.append(f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" class="yl">{value:.3g}</text>'
                     f'<line x1="{LEFT}" y1="{y(value):.1f}" x2="{WIDTH - RIGHT}" y2="{y(value):.1f}" class="g"/>')
    for step in _ticks(x0, x1):
        parts.append(f'<text x="{x(step):.1f}" y="{base + 16}" class="xl">{int(round(step))}</text>')
    path = " ".join(f"{'M' if i == 0 else 'L'}{x(s):.1f},{y(v):.1f}" for i, (s, v) in enumerate(points))
    parts.append(f'<path d="{path}" class="c"/>')
    for step, value, raw in series:
        if value is None:  # a non-finite value: a cross on the axis
            parts.append(f'<text x="{x(step):.1f}" y="{base - 4}" class="nf"><title>step {step}: {html.escape(str(raw))}'
                         f'</title>&#215;</text>')
    for f in findings:
        step = int(f.get("step", 0))
        label = html.escape(f"step {step}: [{f.get('code')}] {f.get('message', '')}")
        parts.append(f'<g class="m"><title>{label}</title><line x1="{x(step):.1f}" y1="{TOP}" x2="{x(step):.1f}" '
                     f'y2="{base}"/><circle cx="{x(step):.1f}" cy="{TOP + 4}" r="4"/></g>')
    parts.append(f'<text x="{(LEFT + WIDTH) / 2:.0f}" y="{HEIGHT - 4}" class="xl">step</text></svg>')
    return "".join(parts)


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:980px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}
svg{display:block;margin:10px 0;background:#fafafa;border:1px solid #ddd}
.t{font-weight:600;font-size:13px}.a{stroke:#444}.g{stroke:#e4e4e4}.c{fill:none;stroke:#1f5fbf;stroke-width:1.5}
.yl{text-anchor:end;font-size:11px;fill:#555}.xl{text-anchor:middle;font-size:11px;fill:#555}
.m line{stroke:#c62828;stroke-dasharray:4 3}.m circle{fill:#c62828}.nf{fill:#c62828;text-anchor:middle}
table{border-collapse:collapse;width:100%}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
.error{color:#b71c1c;font-weight:600}.warning{color:#8a5a00;font-weight:600}.info{color:#555}
code{background:#f2f2f2;padding:0 3px}pre{white-space:pre-wrap;background:#f6f6f6;padding:8px}
"""


def to_html(runs: List[Run]) -> str:
    body = ["<h1>ftshims training monitor</h1>", f"<pre>{html.escape(summary_text(runs))}</pre>"]
    for run in runs:
        body.append(f"<h2>{html.escape(run.file)} (rank {html.escape(str(run.rank))})</h2>")
        body.append(chart("loss", run.loss, run.findings))
        body.append(chart("gradient norm", run.grad_norm, run.findings))
        if run.findings:
            rows = ["<tr><th>step</th><th>code</th><th>severity</th><th>message</th><th>explains</th></tr>"]
            for f in run.findings:
                applied = (f.get("detail") or {}).get("applied") or {}
                explains = ", ".join(f"<code>{html.escape(i)}</code> ({'applied' if applied.get(i) else 'not applied'})"
                                     for i in f.get("explains") or []) or "nothing known"
                severity = html.escape(str(f.get("severity")))
                rows.append(f"<tr><td>{html.escape(str(f.get('step')))}</td><td><code>{html.escape(str(f.get('code')))}"
                            f"</code></td><td class=\"{severity}\">{severity}</td><td>{html.escape(str(f.get('message')))}"
                            f"</td><td>{explains}</td></tr>")
            body.append("<table>" + "".join(rows) + "</table>")
        else:
            body.append("<p>No findings.</p>")
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>ftshims monitor report</title>"
            f"<style>{STYLE}</style></head><body>" + "".join(body) + "</body></html>\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftshims.monitor", description="The training health monitor's report.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="summarise the monitor's JSON lines (FTSHIMS_MONITOR_LOG)")
    report.add_argument("files", nargs="+", help="JSONL files (one per rank)")
    report.add_argument("--html", metavar="OUT", help="also write one self-contained HTML file")
    args = parser.parse_args(argv)
    try:
        runs = load(args.files)
    except (OSError, ValueError) as exc:
        print(f"ftshims.monitor: {exc}", file=sys.stderr)
        return 2
    print(summary_text(runs))
    if args.html:
        with open(args.html, "w", encoding="utf-8") as handle:
            handle.write(to_html(runs))
        print(f"wrote {args.html}")
    return 1 if any(f.get("severity") == "error" for run in runs for f in run.findings) else 0
