"""The Monitor in a plain training loop (the same detectors), its JSON lines, and the report: a summary on the
console and one self-contained HTML file."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ftshims
from ftshims.monitor import Monitor
from ftshims.monitor.report import main as report_main

from .runs import corpus, default_stack_only

ROOT = Path(__file__).resolve().parents[2]

pytestmark = default_stack_only


def _loop(model, steps, monitor, nan_at=None, accumulate=1, clip=None):
    data = corpus(n=steps * accumulate * 2, seq=16)
    optimizer = monitor.optimizer
    for step in range(1, steps + 1):
        for micro in range(accumulate):
            index = (step - 1) * accumulate + micro
            batch = {k: v[index * 2 : index * 2 + 2] for k, v in data.items()}
            loss = model(**batch).loss / accumulate
            loss.backward()
            monitor.after_backward(loss)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        monitor.after_step()
        optimizer.zero_grad()
        if nan_at == step + 1:  # an inf in one weight: the next step's loss is NaN
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight[3, 5] = float("inf")
    return monitor.close()


def test_custom_loop_localizes_and_writes_jsonl(tmp_path):
    from ftshims import tiny

    ftshims.apply()
    model = tiny.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = tmp_path / "run.jsonl"
    monitor = Monitor(model, optimizer, log=str(log))
    summary = _loop(model, 6, monitor, nan_at=4, accumulate=2, clip=1.0)
    assert [f.code for f in monitor.findings] == ["nonfinite_loss"], [f.line() for f in monitor.findings]
    finding = monitor.findings[0]
    assert finding.step == 4 and finding.detail["module"] == "model.layers.0.mlp.up_proj", finding.detail
    assert "1 finding in 6 steps" in summary
    assert not model._forward_hooks and not model._forward_pre_hooks, "close() removes the hooks"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [r["type"] for r in records]
    assert kinds[0] == "header" and kinds[-1] == "summary" and kinds.count("step") == 6 and kinds.count("finding") == 1
    header = records[0]
    assert header["rank"] == 0 and header["world_size"] == 1 and header["versions"]["torch"]
    if hasattr(ftshims, "fingerprint"):
        assert header["fingerprint"]["hash"] == ftshims.fingerprint()["hash"]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert isinstance(steps[0]["loss"], float) and steps[3]["loss"] == "nan" and isinstance(steps[0]["grad_norm"], float)


def test_report_summary_and_html(tmp_path, capsys):
    from ftshims import tiny

    ftshims.apply()
    model = tiny.tiny_llama()
    log = tmp_path / "run.jsonl"
    monitor = Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3), log=str(log))
    _loop(model, 5, monitor, nan_at=3)
    out = tmp_path / "report.html"
    code = report_main(["report", str(log), "--html", str(out)])
    printed = capsys.readouterr().out
    assert code == 1  # an error-severity finding
    assert "nonfinite_loss at step 3" in printed and "loss: first" in printed and "non-finite at 3 step(s)" in printed
    page = out.read_text()
    assert page.count("<svg") == 2 and "nonfinite_loss" in page and "<polyline" not in page and "<path d=\"M" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "<link" not in page and "@import" not in page  # nothing fetched


def test_report_cli_entry_point(tmp_path):
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"type": "header", "rank": 0, "world_size": 1}) + "\n"
                   + json.dumps({"type": "step", "rank": 0, "step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1}) + "\n")
    result = subprocess.run([sys.executable, "-m", "ftshims.monitor", "report", str(log)], capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "1 steps" in result.stdout and "no findings" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    result = subprocess.run([sys.executable, "-m", "ftshims.monitor", "report", str(bad)], capture_output=True, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 2 and "bad.jsonl:1: not a JSON line" in result.stderr
