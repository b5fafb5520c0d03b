"""``python -m ftshims.doctor --checkpoint DIR [--reload] [--json]``: the offline re-check of a checkpoint
(:mod:`ftshims.checkpoint.offline`), rendered in the doctor's formats. Exit code: 0 sound, 1 a finding (an error or
a warning), 2 unusable (not a directory, or nothing a save writes)."""

from __future__ import annotations

import json
from typing import Tuple

MARK = {"error": "ERROR", "warning": "WARN ", "info": "info "}


def run(directory: str, form: str = "text", reload: bool = False, tolerance: float = 0.0) -> Tuple[str, int]:
    from ..checkpoint.offline import inspect

    report = inspect(directory, reload=reload, tolerance=tolerance)
    code = int(report["summary"]["exit_code"])
    if form == "json":
        return json.dumps({"schema": 1, "checkpoint": report}, indent=2, default=str) + "\n", code
    return render(report, markdown=form == "markdown"), code


def render(report, markdown: bool = False) -> str:
    summary, facts = report["summary"], report["facts"]
    layout = facts.get("layout") or {}
    verdict = {0: "sound", 1: "FINDINGS", 2: "UNUSABLE"}[summary["exit_code"]]
    lines = [f"{'# ' if markdown else ''}ftshims checkpoint check: {report['directory']}: {verdict}", ""]
    if layout:
        held = [what for what, there in (("weights", layout.get("weights")), ("adapter", layout.get("adapter")),
                                         ("optimizer", layout.get("optimizer")), ("scheduler", layout.get("scheduler")),
                                         ("RNG", layout.get("rng")), ("trainer_state", layout.get("trainer_checkpoint")),
                                         ("DeepSpeed", layout.get("deepspeed"))) if there]
        lines.append(f"holds: {', '.join(held) or 'nothing a save writes'}; global step {layout.get('global_step')}; "
                     f"{facts.get('tensors', 0)} tensors")
    if facts.get("manifest"):
        m = facts["manifest"]
        lines.append(f"manifest: {m['files']} files hashed by {m['written_by']} at step {m['global_step']}")
    if facts.get("reload"):
        r = facts["reload"]
        lines.append("reload: logits " + ("bit-identical to the reference" if r["identical"]
                                          else f"differ by up to {r['max_abs_diff']:.3g} (tolerance {r['tolerance']:g})"))
    lines.append("")
    for finding in report["findings"]:
        prefix = "- " if markdown else ""
        lines.append(f"{prefix}{MARK[finding['severity']]} [{finding['code']}] {finding['message']}")
    if not report["findings"]:
        lines.append("no findings")
    lines.append("")
    lines.append(f"{summary['error']} error(s), {summary['warning']} warning(s), {summary['info']} note(s); exit {summary['exit_code']}")
    return "\n".join(lines) + "\n"
