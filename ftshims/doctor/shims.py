"""Every registered shim against the installed stack: is it affected, and what would ``apply()`` do?

The doctor patches nothing for good. Its *trial* is what a training script
does: ``ftshims.apply()``, then the import of every module a deferred shim
waits for (so the post-import hooks install it and its targets are checked
for real), then the status of each shim is read, and every shim the trial
activated is reverted. ``FTSHIMS_DISABLE`` is honoured, as ``apply()`` does.
With ``trial_imports=False`` nothing is imported: deferred shims stay
deferred and the statuses come from version gating alone.

Verdicts (the doctor's reading of a status for an affected shim):

* ``patched`` — ``apply()`` installs it now;
* ``patched on import`` — deferred; installs when its module is imported
  (only without trial imports: the targets were not checked);
* ``unverified`` — the import of its module failed, so it could not be checked;
* ``unpatched`` — a fix shim that ``apply()`` would not install (disabled,
  target missing, failed): the known bug stays. Exit code 1;
* ``opt-in`` — a speed shim; ``apply(include=[...])`` turns it on. Never exit 1;
* ``not affected`` — the installed versions are outside its range.
"""

from __future__ import annotations

import importlib
import logging
import time
import warnings
from typing import Any, Dict, List, Optional

from .. import registry, verdicts
from ..report import APPLIED, DEFERRED, DISABLED, FAILED, TARGET_MISSING
from ..spec import SPEED
from ..versions import explain_mismatch, installed_versions
from .environment import error_text

PATCHED = "patched"
PATCHED_ON_IMPORT = "patched on import"
UNVERIFIED = "unverified"
UNPATCHED = "unpatched"
OPT_IN = "opt-in"
NOT_AFFECTED = "not affected"

VERDICTS = (PATCHED, PATCHED_ON_IMPORT, UNVERIFIED, UNPATCHED, OPT_IN, NOT_AFFECTED)


class _Capture(logging.Handler):
    """Collects ftshims' warnings during the trial so they land in the report, not on stderr."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _import(module_name: str) -> Dict[str, Any]:
    start = time.perf_counter()
    row: Dict[str, Any] = {"module": module_name, "ok": True, "error": None, "seconds": None, "warnings": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            importlib.import_module(module_name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # ImportError, a RuntimeError raised at import, even SystemExit
            row.update(ok=False, error=error_text(exc))
    row["warnings"] = len(caught)
    row["seconds"] = round(time.perf_counter() - start, 3)
    return row


def run_trial(trial_imports: bool = True) -> Dict[str, Any]:
    """``{"mode", "imports", "statuses", "notes", "fingerprint", "seconds"}``: apply, import, read status, revert."""
    from .. import _manager

    start = time.perf_counter()
    logger = logging.getLogger("ftshims")
    capture = _Capture()
    propagate = logger.propagate
    logger.addHandler(capture)
    logger.propagate = False
    imports: List[Dict[str, Any]] = []
    before = {entry.id for entry in _manager.status() if entry.active}
    try:
        report = _manager.apply()
        try:
            if trial_imports:
                wanted: List[str] = []
                for entry in report:
                    if entry.status == DEFERRED:
                        for name in registry.get(entry.id).spec.modules:
                            if name not in wanted:
                                wanted.append(name)
                imports = [_import(name) for name in wanted]
            final = _manager.status()
            notes = {entry.id: list(_manager.notes(entry.id)) for entry in final}
            fingerprint = _manager.fingerprint(final)  # what apply() would record with a run of this environment
        finally:
            newly = [entry.id for entry in _manager.status() if entry.active and entry.id not in before]
            if newly:
                _manager.revert(only=newly)
    finally:
        logger.removeHandler(capture)
        logger.propagate = propagate
    for record in capture.records:
        message = record.getMessage()
        for shim_id in notes:
            if shim_id in message:
                notes[shim_id].append(message)
    return {
        "mode": "apply, import, revert" if trial_imports else "version gating only (--no-import)",
        "imports": imports,
        "statuses": {entry.id: entry for entry in final},
        "notes": notes,
        "fingerprint": fingerprint,
        "seconds": round(time.perf_counter() - start, 3),
    }


def _verdict(spec, affected: bool, status: str, import_failed: Optional[str], trial_imports: bool) -> str:
    if not affected:
        return NOT_AFFECTED
    if not spec.by_default:
        return PATCHED if status == APPLIED else OPT_IN
    if status == APPLIED:
        return PATCHED
    if status == DEFERRED:
        return UNVERIFIED if (import_failed or trial_imports) else PATCHED_ON_IMPORT
    if status in (DISABLED, TARGET_MISSING, FAILED):
        return UNPATCHED
    return UNVERIFIED  # NOT_NEEDED while in range cannot happen; say so rather than guess


def shim_rows(trial: Dict[str, Any], trial_imports: bool) -> List[Dict[str, Any]]:
    imports = {row["module"]: row for row in trial["imports"]}
    rows = []
    for shim in registry.shims().values():
        spec = shim.spec
        versions = installed_versions(spec.requires)
        mismatch = explain_mismatch(spec.requires, versions)
        if mismatch is None and spec.needs_any and not any(installed_versions(spec.needs_any).values()):
            mismatch = f"none of {', '.join(spec.needs_any)} is installed: the bug cannot happen without it"
        affected = mismatch is None
        entry = trial["statuses"].get(spec.id)
        status = entry.status if entry is not None else None
        reason = entry.reason if entry is not None else "no status (the trial did not reach this shim)"
        failed_imports = [imports[m] for m in spec.modules if m in imports and not imports[m]["ok"]]
        import_failed = "; ".join(f"import {row['module']} failed: {row['error']}" for row in failed_imports) or None
        notes = list(trial["notes"].get(spec.id, []))
        if import_failed and status == DEFERRED:
            reason = f"{reason}; {import_failed}"
        range_text = (
            "; ".join(f"{pkg} {versions[pkg]} is inside {spec_}" for pkg, spec_ in spec.requires.items())
            if affected
            else mismatch
        )
        rows.append(
            {
                "id": spec.id,
                "title": spec.title,
                "kind": spec.kind,
                "symptom": spec.symptom,
                "requires": dict(spec.requires),
                "fixed_in": dict(spec.fixed_in),
                "since": spec.since,
                "upstream_report": verdicts.upstream_report(spec) or None,
                "follow_ups": [f.statement for f in spec.follow_ups] or ([spec.follow_ups_checked] if spec.follow_ups_checked else []),
                "refs": list(spec.refs),
                "versions": versions,
                "affected": affected,
                "range": range_text,
                "status": status,
                "reason": reason,
                "patched": list(entry.patched) if entry is not None else [],
                "notes": notes,
                "verdict": _verdict(spec, affected, status, import_failed, trial_imports),
                # what the evidence says this shim delivers where the bug exists (ftshims.verdicts)
                "evidence": verdicts.delivered(spec) if affected else verdicts.ABSENT,
            }
        )
    rows += load_failure_rows()
    return rows


def load_failure_rows() -> List[Dict[str, Any]]:
    """Registered ids whose module did not load: ``failed``/``unpatched`` (the doctor cannot vouch for them)."""
    rows = []
    loaded = registry.shims()
    for shim_id, error in registry.load_errors().items():
        if shim_id in loaded or shim_id not in registry.SHIM_IDS:
            continue  # a stale entry (the registry was reloaded since)
        rows.append(
            {
                "id": shim_id,
                "title": f"{shim_id} (its module did not load)",
                "kind": "fix",
                "symptom": "",
                "requires": {},
                "fixed_in": {},
                "refs": [],
                "versions": {},
                "affected": True,
                "range": "unknown: the shim module did not load, so its range cannot be read",
                "status": FAILED,
                "reason": error,
                "patched": [],
                "notes": [],
                "verdict": UNPATCHED,
                "evidence": verdicts.NOT_RUN,
            }
        )
    return rows


def gating_only_rows(disabled=None) -> List[Dict[str, Any]]:
    """Rows from version gating alone, for when the trial itself could not run (``disabled``: see ``selection``)."""
    from .._manager import selection

    statuses = {}
    for shim in registry.shims().values():
        skip, reason = selection(shim, disabled=disabled)
        statuses[shim.id] = _Gated(skip or DEFERRED, reason if skip else "selected (the trial did not run)")
    return shim_rows({"imports": [], "statuses": statuses, "notes": {}}, trial_imports=False)


class _Gated:
    def __init__(self, status: str, reason: str, patched=()):
        self.status, self.reason, self.patched = status, reason, list(patched)


def served_trial(trial: Dict[str, Any]) -> Dict[str, Any]:
    """:func:`run_trial`'s result as the probe server sends it (statuses as plain dicts) -> its usual form."""
    statuses = {shim_id: _Gated(s["status"], s["reason"], s.get("patched") or ()) for shim_id, s in trial["statuses"].items()}
    return dict(trial, statuses=statuses, mode=f"{trial['mode']}, in a child of the probe server")

