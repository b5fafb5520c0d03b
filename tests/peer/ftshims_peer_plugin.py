"""pytest plugin of the peer runs (tests/peer/run.py): records each test id's outcome, and stands in, identically in
both modes, for the names a vendored test tree imports that the installed release no longer has.

Loaded with ``-p ftshims_peer_plugin`` (its folder on PYTHONPATH, the checkout's root not: the vendored trees are a
package named ``tests`` too). Environment:

* ``FTSHIMS_PEER_OUTCOMES`` — where to write ``{test id: {"outcome": ..., "message": ...}}`` (JSON) at the end;
* ``FTSHIMS_PEER_STUBS`` — a JSON object ``{"module": ["name", ...]}``: names to define in those modules, before any
  test module is imported, when the installed module lacks them. A stubbed ``is_*_available`` answers False; any
  other name is a placeholder that raises if called. The runner prints the names it stubbed.
"""

from __future__ import annotations

import importlib
import json
import os

_OUTCOMES: dict = {}
_STUBBED: list = []


def _placeholder(module: str, name: str):
    def stub(*args, **kwargs):
        raise RuntimeError(f"{module}.{name} is gone from the installed release (a peer-run stand-in)")

    stub.__name__ = name
    return stub


def pytest_configure(config):
    if os.environ.get("FTSHIMS_PEER_CPU_BF16") == "1":
        training_args = importlib.import_module("transformers.training_args")
        if hasattr(training_args, "is_torch_bf16_gpu_available"):
            training_args.is_torch_bf16_gpu_available = lambda: True
            _STUBBED.append("transformers.training_args.is_torch_bf16_gpu_available (True: CPU bf16 autocast)")
    stubs = json.loads(os.environ.get("FTSHIMS_PEER_STUBS") or "{}")
    for module_name, names in stubs.items():
        module = importlib.import_module(module_name)
        for name in names:
            if hasattr(module, name):
                continue
            value = (lambda *a, **k: False) if name.startswith("is_") and name.endswith("_available") else \
                _placeholder(module_name, name)
            setattr(module, name, value)
            _STUBBED.append(f"{module_name}.{name}")


def _selected(test_id: str, select: list) -> bool:
    for entry in select:
        if entry.endswith("*"):
            if test_id.startswith(entry[:-1]):
                return True
        elif test_id == entry or test_id.startswith(entry + "::"):
            return True
    return False


def pytest_collection_modifyitems(session, config, items):
    select = json.loads(os.environ.get("FTSHIMS_PEER_SELECT") or "null")
    if select is None:
        return
    kept = [item for item in items if _selected(item.nodeid, select)]
    dropped = [item for item in items if not _selected(item.nodeid, select)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _message(report) -> str:
    text = getattr(report, "longreprtext", "") or ""
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])
    lines = [line for line in text.splitlines() if line.startswith("E ")] or text.splitlines()[-1:]
    return (lines[0][2:].strip() if lines and lines[0].startswith("E ") else (lines[0] if lines else ""))[:300]


def pytest_runtest_logreport(report):
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": None, "message": "", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 3)
    if report.when == "setup":
        if report.failed:
            entry.update(outcome="error", message=_message(report))
        elif report.skipped:
            entry.update(outcome="skipped", message=_message(report))
    elif report.when == "call":
        if hasattr(report, "wasxfail"):
            entry.update(outcome="xfailed" if report.skipped else "xpassed", message=str(report.wasxfail)[:300])
        else:
            entry.update(outcome=report.outcome, message=_message(report) if not report.passed else "")
    elif report.when == "teardown" and report.failed and entry["outcome"] == "passed":
        entry.update(outcome="error", message="teardown: " + _message(report))


def pytest_collectreport(report):
    if report.failed:
        _OUTCOMES[report.nodeid] = {"outcome": "collection error", "message": _message(report)}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FTSHIMS_PEER_OUTCOMES")
    if path:
        with open(path, "w") as handle:
            json.dump({"outcomes": _OUTCOMES, "stubbed": _STUBBED}, handle, indent=0, sort_keys=True)
