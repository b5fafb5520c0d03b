"""Build the doctor's report: a plain, JSON-ready dict whose keys are documented in docs/doctor-json.md.

The report is a fixed set of sections. Each one is produced by a guarded step:
a step that raises (a doctor bug, or a package misbehaving in a way nobody
foresaw) leaves its section at the documented empty value and adds an entry to
``errors``; the other sections and the exit code are still produced.

Sections reserved for doctor v2 — ``probes``, ``advisories``, ``findings`` —
are present and empty in v1, so that v2 fills them without reshaping the
document; :func:`summarize` already turns error-severity findings and present,
unfixed probe bugs into problems (exit code 1).
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from . import flashattn
from .environment import error_text, ftshims_info, platform_info, python_info, torch_info
from .packages import BROKEN, collect_packages, package_names
from .shims import OPT_IN, PATCHED, PATCHED_ON_IMPORT, UNPATCHED, UNVERIFIED, gating_only_rows, run_trial, shim_rows

SCHEMA = "ftshims-doctor"
SCHEMA_VERSION = 1

EXIT_OK = 0
EXIT_UNPATCHED = 1
EXIT_USAGE = 2


@dataclass
class Options:
    """What to check. v2 adds probe and lint inputs here (``probe``, ``model``, ``adapter``, ...)."""

    trial_imports: bool = True
    flash_attn_timeout: float = flashattn.DEFAULT_TIMEOUT_S
    check_flash_attn: bool = True

    def to_dict(self) -> Dict[str, Any]:
        return {
            "trial_imports": self.trial_imports,
            "flash_attn_timeout": self.flash_attn_timeout,
            "check_flash_attn": self.check_flash_attn,
            "probe": False,
        }


def skeleton(options: Options) -> Dict[str, Any]:
    """The report with every section at its empty value: the shape never depends on what failed."""
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ftshims": {"version": None, "location": None, "env": {}},
        "options": options.to_dict(),
        "environment": {"python": {}, "platform": {}, "torch": {"status": None, "error": None}},
        "packages": [],
        "flash_attn": flashattn.not_installed(options.flash_attn_timeout),
        "trial": {"mode": None, "imports": [], "seconds": None},
        "shims": [],
        "probes": {"requested": False, "seconds": None, "results": []},
        "advisories": [],
        "findings": [],
        "summary": {},
        "timing": {"total_s": None, "sections": {}},
        "errors": [],
    }


class _Steps:
    def __init__(self, report: Dict[str, Any]):
        self.report = report

    def run(self, name: str, step: Callable[[], Any], default: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return step()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.report["errors"].append(
                {"section": name, "error": error_text(exc), "traceback": traceback.format_exc(limit=8)}
            )
            return default
        finally:
            sections = self.report["timing"]["sections"]
            sections[name] = round(sections.get(name, 0.0) + time.perf_counter() - start, 3)


def collect(options: Optional[Options] = None, started: Optional[float] = None) -> Dict[str, Any]:
    """Run every check and return the report. Never raises (except KeyboardInterrupt)."""
    options = options or Options()
    started = time.perf_counter() if started is None else started
    report = skeleton(options)
    steps = _Steps(report)

    report["ftshims"] = steps.run("ftshims", ftshims_info, report["ftshims"])
    names = steps.run("packages", lambda: package_names(_registry_packages()), package_names(()))
    report["packages"] = steps.run("packages", lambda: collect_packages(names), [])
    fa_row = _row(report["packages"], "flash-attn")
    fa_version = fa_row.get("version")

    # Started first, collected last: the child's import overlaps the doctor's own imports.
    check = None
    broken = fa_row.get("status") == BROKEN
    if options.check_flash_attn:
        check = steps.run("flash_attn", lambda: flashattn.start(options.flash_attn_timeout, fa_version, broken))
    elif flashattn.is_present(fa_version, broken):
        report["flash_attn"] = flashattn.skipped(fa_version, options.flash_attn_timeout, "flash-attn import check skipped (--no-flash-attn)")
    try:
        env = report["environment"]
        env["python"] = steps.run("environment", python_info, {})
        env["platform"] = steps.run("environment", platform_info, {})
        env["torch"] = steps.run("environment", torch_info, env["torch"])

        trial = steps.run("trial", lambda: run_trial(options.trial_imports))
        if trial is not None:
            report["trial"] = {"mode": trial["mode"], "imports": trial["imports"], "seconds": trial["seconds"]}
            report["shims"] = steps.run("shims", lambda: shim_rows(trial, options.trial_imports), [])
        else:
            report["trial"]["mode"] = "failed; statuses from version gating only"
            report["shims"] = steps.run("shims", gating_only_rows, [])

        if check is not None:
            report["flash_attn"] = steps.run("flash_attn", lambda: check.result(env["torch"]), report["flash_attn"])
    finally:
        if check is not None:
            check.close()

    report["summary"] = steps.run("summary", lambda: summarize(report), _fallback_summary())
    report["timing"]["total_s"] = round(time.perf_counter() - started, 2)
    return report


def _registry_packages():
    from .. import registry

    return registry.packages()


def _row(packages: List[Dict[str, Any]], name: str) -> Dict[str, Any]:
    for row in packages:
        if row.get("name") == name:
            return row
    return {}


def _fallback_summary() -> Dict[str, Any]:
    return {
        "exit_code": EXIT_OK,
        "known_bugs": [],
        "patched_by_apply": [],
        "unpatched": [],
        "unverified": [],
        "opt_in": [],
        "problems": [],
        "warnings": ["the summary could not be computed; see errors"],
        "message": "The doctor could not compute its summary (see errors).",
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def summarize(report: Dict[str, Any]) -> Dict[str, Any]:
    """Problems (each one makes the exit code 1), warnings, counts and the headline message."""
    shims = report["shims"]
    fix = [s for s in shims if s["kind"] != "speed"]
    known = [s["id"] for s in fix if s["affected"]]
    patched = [s["id"] for s in fix if s["verdict"] in (PATCHED, PATCHED_ON_IMPORT)]
    unpatched = [s for s in fix if s["verdict"] == UNPATCHED]
    unverified = [s["id"] for s in fix if s["verdict"] == UNVERIFIED]
    opt_in = [s["id"] for s in shims if s["verdict"] == OPT_IN]

    problems: List[Dict[str, Any]] = []
    for s in unpatched:
        problems.append(
            {"source": "shim", "id": s["id"], "message": f"{s['title']}: affected but {s['status']} ({s['reason']})"}
        )
    failed_steps = {e["section"] for e in report["errors"]}
    if not shims and failed_steps & {"shims", "trial"}:
        # Without statuses the doctor cannot say that no known bug stays unpatched.
        problems.append(
            {"source": "doctor", "id": "shims", "message": "the shims could not be evaluated (see errors); ftshims.apply() would likely fail too"}
        )
    # doctor v2: present and unfixed probe bugs, error-severity findings.
    for result in report["probes"]["results"]:
        if result.get("bug_without_shim") and not result.get("fixed"):
            problems.append({"source": "probe", "id": result.get("shim_id"), "message": result.get("detail", "")})
    for finding in report["findings"]:
        if finding.get("severity") == "error":
            problems.append({"source": "finding", "id": finding.get("rule"), "message": finding.get("message", "")})

    warnings: List[str] = []
    torch = report["environment"]["torch"]
    if torch.get("status") == "import failed":
        warnings.append(f"torch does not import: {torch.get('error')}")
    for row in report["trial"]["imports"]:
        if not row["ok"]:
            warnings.append(f"import {row['module']} failed: {row['error']}")
    if unverified:
        warnings.append(f"could not verify {', '.join(unverified)}: the module it patches did not import")
    gating = {pkg for s in shims for pkg in s["requires"]}
    for row in report["packages"]:
        if row["status"] == BROKEN:
            extra = " (a shim gates on it: it counts as not installed there)" if row["name"] in gating else ""
            warnings.append(f"{row['name']}: {row['detail']}{extra}")
        elif row.get("detail"):
            warnings.append(f"{row['name']}: {row['detail']}")
    fa = report["flash_attn"]
    if fa.get("ok") is False:
        warnings.append(f"flash-attn does not import ({fa['status']}); the flash-attn section says why and how to fix it")
    if report["errors"]:
        warnings.append(f"{_plural(len(report['errors']), 'doctor step')} failed: {', '.join(e['section'] for e in report['errors'])}")

    if not shims and failed_steps & {"shims", "trial"}:
        message = "The shim registry could not be evaluated; see errors."
    elif not known:
        message = f"No known bug of the {_plural(len(fix), 'fix shim')} in the registry affects this stack."
    else:
        message = (
            f"{_plural(len(known), 'known bug')} {'affects' if len(known) == 1 else 'affect'} this stack; "
            f"ftshims.apply() patches {len(patched)} of {len(known)}."
        )
        if unpatched:
            message += f" Unpatched: {', '.join(s['id'] for s in unpatched)}."
        if patched:
            message += " Call ftshims.apply() (or import ftshims.auto) at the top of your training script; the doctor itself patched nothing."
    if opt_in:
        message += f" Opt-in speed shims available: {', '.join(opt_in)} (ftshims.apply(include=[...]))."
    return {
        "exit_code": EXIT_UNPATCHED if problems else EXIT_OK,
        "known_bugs": known,
        "patched_by_apply": patched,
        "unpatched": [s["id"] for s in unpatched],
        "unverified": unverified,
        "opt_in": opt_in,
        "problems": problems,
        "warnings": warnings,
        "message": message,
    }


__all__ = ["Options", "collect", "summarize", "skeleton", "SCHEMA", "SCHEMA_VERSION"]
