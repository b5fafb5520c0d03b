"""Build the doctor's report: a plain, JSON-ready dict whose keys are documented in docs/doctor-json.md.

The report is a fixed set of typed sections (:class:`Report`), filled by guarded
steps and turned into the dict once, at the end. A step that raises (a doctor
bug, or a package misbehaving in a way nobody foresaw), or returns something
that is not its section's shape, leaves its section at the documented empty
value and adds an entry to ``errors``; the other sections and the exit code are
still produced.

Besides the environment and the shims, three sections: ``probes`` (``--probe``: every
shim's reproduction run without and with the shim in child processes, see
:mod:`.probes`), ``advisories`` (known-bad version combinations from
:mod:`ftshims.advisories`, when that module is present) and ``findings`` (the
setup lint of ``--model``/``--adapter``/``--tokenizer``/``--deepspeed``/
``--train-config``, see :mod:`ftshims.lint`). :func:`summarize` turns unpatched
present probe bugs and error-severity findings into problems (exit code 1).

Size: the report's typed sections, the guarded steps that fill them, the advisory rows and the summary
(exit code, problems, headline) form one pipeline over one report; the renderers (:mod:`.formats`), the
probes (:mod:`.probes`) and the shim rows (:mod:`.shims`) are their own modules.
"""

from __future__ import annotations

import datetime
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, TextIO

from .. import verdicts
from . import flashattn, frameworks, stacks
from .deepspeed_info import deepspeed_section
from .environment import error_text, ftshims_info, platform_info, python_info, torch_info
from .packages import BROKEN, collect_packages, package_names
from .shims import (
    OPT_IN,
    PATCHED,
    PATCHED_ON_IMPORT,
    UNPATCHED,
    UNVERIFIED,
    gating_only_rows,
    run_trial,
    served_trial,
    shim_rows,
)

SCHEMA = "ftshims-doctor"
from . import SCHEMA_VERSION  # noqa: E402  (defined once, in the package, which imports nothing heavy)

EXIT_OK = 0
EXIT_UNPATCHED = 1


@dataclass
class Options:
    """What to check: the environment, the live probes (``--probe``) and the lint inputs (file paths)."""

    trial_imports: bool = True
    flash_attn_timeout: float = flashattn.DEFAULT_TIMEOUT_S
    check_flash_attn: bool = True
    probe: bool = False
    probe_timeout: float = 30.0
    probe_jobs: Optional[int] = None
    probe_all: bool = False
    progress: Optional[TextIO] = field(default=None, repr=False)  # probe progress lines (the CLI: stderr)
    model: Optional[str] = None
    adapter: Optional[str] = None
    tokenizer: Optional[str] = None
    deepspeed: Optional[str] = None
    train_config: Optional[str] = None

    def lint_requested(self) -> bool:
        return any((self.model, self.adapter, self.tokenizer, self.deepspeed, self.train_config))

    def to_dict(self) -> Dict[str, Any]:
        """Every option but ``progress`` (a stream, not a setting)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "progress"}


# The report's sections, one small type each (docs/doctor-json.md documents the keys). :func:`collect` fills a
# :class:`Report` step by step and turns it into the JSON-ready dict once, at the end (:meth:`Report.to_dict`).
# Sections that are lists of rows (packages, shims, advisories, findings) hold the rows as dicts.


@dataclass
class FtshimsSection:
    version: Optional[str] = None
    location: Optional[str] = None
    env: Dict[str, Any] = field(default_factory=dict)
    env_errors: List[Dict[str, Any]] = field(default_factory=list)


def _torch_unknown() -> Dict[str, Any]:
    # Filled by environment.torch_info (or the probe server's copy of it): many documented keys.
    return {"status": None, "error": None}


def _deepspeed_unknown() -> Dict[str, Any]:
    # Filled by deepspeed_info.deepspeed_section (metadata and torch facts; deepspeed is never imported).
    return {"status": None, "version": None, "accelerator": None, "source": None, "detail": None}


@dataclass
class EnvironmentSection:
    python: Dict[str, Any] = field(default_factory=dict)
    platform: Dict[str, Any] = field(default_factory=dict)
    torch: Dict[str, Any] = field(default_factory=_torch_unknown)
    deepspeed: Dict[str, Any] = field(default_factory=_deepspeed_unknown)


@dataclass
class TrialSection:
    """How the shims were tried: the import mode, each target module's import, the time it took."""

    mode: Optional[str] = None
    imports: List[Dict[str, Any]] = field(default_factory=list)
    seconds: Optional[float] = None
    fingerprint: Dict[str, Any] = field(default_factory=dict)  # ftshims.fingerprint() of the trial apply()


@dataclass
class ProbesSection:
    """``--probe``: each shim's reproduction without and with the shim, and how the probe servers ran."""

    requested: bool = False
    seconds: Optional[float] = None
    results: List[Dict[str, Any]] = field(default_factory=list)
    mode: Optional[str] = None
    jobs: Optional[int] = None
    timeout_s: Optional[float] = None
    servers_started: int = 0
    startup_s: Optional[float] = None
    preloaded: List[str] = field(default_factory=list)
    preload_errors: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class FrameworksSection:
    """Fine-tuning frameworks and patchers installed, their advisories, and the ``--probe`` import check."""

    frameworks: List[Dict[str, Any]] = field(default_factory=list)
    installed: List[str] = field(default_factory=list)
    advisories: List[Dict[str, Any]] = field(default_factory=list)
    probe: Optional[Dict[str, Any]] = None


@dataclass
class TimingSection:
    total_s: Optional[float] = None
    sections: Dict[str, float] = field(default_factory=dict)


@dataclass
class Report:
    """The whole report, starting at its empty values: its shape never depends on what failed."""

    options: Dict[str, Any]
    flash_attn: Dict[str, Any]
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )
    ftshims: FtshimsSection = field(default_factory=FtshimsSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    packages: List[Dict[str, Any]] = field(default_factory=list)
    trial: TrialSection = field(default_factory=TrialSection)
    shims: List[Dict[str, Any]] = field(default_factory=list)
    probes: ProbesSection = field(default_factory=ProbesSection)
    advisories: List[Dict[str, Any]] = field(default_factory=list)
    findings: List[Dict[str, Any]] = field(default_factory=list)
    tested_stack: Dict[str, Any] = field(default_factory=stacks.empty)
    frameworks: FrameworksSection = field(default_factory=FrameworksSection)
    summary: Dict[str, Any] = field(default_factory=dict)
    timing: TimingSection = field(default_factory=TimingSection)
    errors: List[Dict[str, Any]] = field(default_factory=list)

    @classmethod
    def empty(cls, options: Options) -> "Report":
        return cls(options=options.to_dict(), flash_attn=flashattn.not_installed(options.flash_attn_timeout))

    def to_dict(self) -> Dict[str, Any]:
        """The JSON-ready dict, its keys in the documented order."""
        sections = asdict(self)
        return {key: sections[key] for key in _ORDER}


_ORDER = ("schema", "schema_version", "created", "ftshims", "options", "environment", "packages", "flash_attn",
          "trial", "shims", "probes", "advisories", "findings", "tested_stack", "frameworks", "summary", "timing",
          "errors")  # the key order of the JSON (docs/doctor-json.md)


def skeleton(options: Options) -> Dict[str, Any]:
    """The report with every section at its empty value, as a dict (what a failed step leaves)."""
    return Report.empty(options).to_dict()


class _Steps:
    """Runs the report's steps: a step that raises leaves its default and adds an entry to ``errors``."""

    def __init__(self, report: Report):
        self.report = report

    def run(self, name: str, step: Callable[[], Any], default: Any = None) -> Any:
        start = time.perf_counter()
        try:
            return step()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self.report.errors.append(
                {"section": name, "error": error_text(exc), "traceback": traceback.format_exc(limit=8)}
            )
            return default
        finally:
            sections = self.report.timing.sections
            sections[name] = round(sections.get(name, 0.0) + time.perf_counter() - start, 3)


def collect(options: Optional[Options] = None, started: Optional[float] = None) -> Dict[str, Any]:
    """Run every check and return the report as a dict. Never raises (except KeyboardInterrupt)."""
    options = options or Options()
    started = time.perf_counter() if started is None else started
    report = Report.empty(options)
    steps = _Steps(report)

    report.ftshims = steps.run("ftshims", lambda: FtshimsSection(**ftshims_info()), report.ftshims)
    names = steps.run("packages", lambda: package_names(_registry_packages()), package_names(()))
    report.packages = steps.run("packages", lambda: collect_packages(names), [])
    report.tested_stack = steps.run(
        "tested_stack", lambda: stacks.tested_stack(stacks.installed_versions(report.packages)), report.tested_stack
    )
    report.frameworks = steps.run(
        "frameworks", lambda: FrameworksSection(**frameworks.frameworks_section()), report.frameworks
    )
    fa_row = _row(report.packages, "flash-attn")
    fa_version = fa_row.get("version")

    # Started first, collected last: the children's imports overlap the doctor's own.
    probe_run = None
    if options.probe:
        probe_run = steps.run("probes", lambda: _start_probes(options))
    check = None
    broken = fa_row.get("status") == BROKEN
    if options.check_flash_attn:
        check = steps.run("flash_attn", lambda: flashattn.start(options.flash_attn_timeout, fa_version, broken))
    elif flashattn.is_present(fa_version, broken):
        report.flash_attn = flashattn.skipped(fa_version, options.flash_attn_timeout, "flash-attn import check skipped (--no-flash-attn)")
    try:
        env = report.environment
        env.python = steps.run("environment", python_info, {})
        env.platform = steps.run("environment", platform_info, {})
        # With --probe the probe server computes the torch section and the trial in a forked child: it has
        # imported torch/transformers/peft/trl already, so the doctor need not import them a second time.
        served = steps.run("probe_server", lambda: probe_run.environment(_SERVER_WAIT_S)) if probe_run is not None else None
        if served:
            env.torch = served["torch"]
        else:
            env.torch = steps.run("environment", torch_info, env.torch)
        env.deepspeed = steps.run(
            "environment", lambda: deepspeed_section(_row(report.packages, "deepspeed"), env.torch), env.deepspeed
        )

        if report.ftshims.env_errors:
            # apply() rejects these settings and applies nothing; a trial would only repeat its ValueError.
            report.trial.mode = "skipped: an FTSHIMS_* setting is invalid (see problems); statuses from version gating only"
            report.shims = steps.run("shims", _gating_despite_bad_settings, [])
        else:
            if served:
                trial = served_trial(served["trial"])
            else:
                trial = steps.run("trial", lambda: run_trial(options.trial_imports))
            if trial is not None:
                report.trial = TrialSection(mode=trial["mode"], imports=trial["imports"], seconds=trial["seconds"],
                                            fingerprint=trial.get("fingerprint") or {})
                report.shims = steps.run("shims", lambda: shim_rows(trial, options.trial_imports), [])
            else:
                report.trial.mode = "failed; statuses from version gating only"
                report.shims = steps.run("shims", gating_only_rows, [])

        if options.lint_requested():
            report.findings = steps.run("lint", lambda: _lint(options, report.shims), [])

        if check is not None:
            report.flash_attn = steps.run("flash_attn", lambda: check.result(env.torch), report.flash_attn)
        report.advisories = steps.run(
            "advisories", lambda: advisory_rows(report.packages, report.flash_attn, _model_type(options)), []
        )
        if probe_run is not None:
            steps.run("probes", lambda: _collect_probes(probe_run, report.probes))
        patchers = [r for r in report.frameworks.frameworks if r["version"] and r["kind"] in ("framework", "patcher")]
        if options.probe and patchers:
            # which of ftshims' targets the installed frameworks replace once imported (a fresh process;
            # ~20 s of imports, so only where a framework or patcher that replaces functions is installed)
            report.frameworks.probe = steps.run("frameworks", frameworks.probe_section)
        if probe_run is None and options.probe:
            report.probes.requested = True
    except BaseException:
        if probe_run is not None:
            probe_run.close()
        raise
    finally:
        if check is not None:
            check.close()

    report.summary = steps.run("summary", lambda: summarize(report.to_dict()), _fallback_summary())
    report.timing.total_s = round(time.perf_counter() - started, 2)
    return report.to_dict()


def _gating_despite_bad_settings() -> List[Dict[str, Any]]:
    """Version-gating rows when a setting is invalid: FTSHIMS_DISABLE as far as it parses (not at all when it is the bad one)."""
    from ..settings import parse_disable

    try:
        disabled = parse_disable()
    except ValueError:
        disabled = set()
    return gating_only_rows(disabled=disabled)


def _start_probes(options: Options):
    from . import probes

    return probes.run(
        timeout_s=options.probe_timeout,
        jobs=options.probe_jobs,
        progress=options.progress,
        include_speed=options.probe_all,
        environment=options.trial_imports,
    )


# How long the doctor waits for the probe server's torch section and trial before checking for itself
# (the server's own start-up limit plus one probe's; the server reports failures sooner).
_SERVER_WAIT_S = 180.0


def _collect_probes(run, section: ProbesSection) -> None:
    section.results = run.results()
    known = {f.name for f in fields(section)}
    for name, value in run.summary().items():
        if name not in known:  # it would not reach the JSON
            raise KeyError(f"the probe run's summary has {name!r}, which the probes section does not document")
        setattr(section, name, value)
    section.requested = True
    section.seconds = round(time.perf_counter() - run.started, 2)


def _lint(options: Options, shim_rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from .. import lint

    return lint.run(
        lint.Inputs(
            model=options.model,
            adapter=options.adapter,
            tokenizer=options.tokenizer,
            deepspeed=options.deepspeed,
            train_config=options.train_config,
        ),
        shim_rows=shim_rows,
    )


def _advisories_module():
    """``ftshims.advisories`` when it exists; None while it does not (it is optional for the doctor)."""
    try:
        from .. import advisories
    except ModuleNotFoundError as exc:
        if exc.name == "ftshims.advisories":
            return None
        raise
    return advisories


def _field_of(item: Any, name: str, default: Any = None) -> Any:
    if isinstance(item, dict):
        return item.get(name, default)
    return getattr(item, name, default)


def _when_packages(when: Any) -> List[str]:
    if isinstance(when, dict):
        return [str(k) for k in when]
    if isinstance(when, (list, tuple)):
        names: List[str] = []
        for part in when:
            names += _when_packages(part)
        return names
    return []


def _model_type(options: Options) -> Optional[str]:
    """``model_type`` of ``--model`` (advisories for other model families then drop out), when readable."""
    if not options.model:
        return None
    import json
    import os

    path = os.path.join(options.model, "config.json") if os.path.isdir(options.model) else options.model
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def advisory_rows(
    packages: List[Dict[str, Any]], flash_attn: Optional[Dict[str, Any]] = None, model_type: Optional[str] = None
) -> List[Dict[str, Any]]:
    """The advisories whose conditions this stack matches (``ftshims.advisories.matching``), as report rows."""
    module = _advisories_module()
    if module is None:
        return []
    from ..versions import installed_version

    versions = {row["name"]: row.get("version") for row in packages}
    for name in module.packages():
        if name not in versions:
            versions[name] = installed_version(name)
    checks = {}
    if flash_attn and flash_attn.get("status"):
        checks["flash_attn_import"] = flash_attn["status"]
    # Matched on versions and checks only: whether the model type fits is judged per row (``applies``),
    # so a model-specific advisory shows as conditional without --model instead of vanishing or counting.
    try:
        found = module.matching(versions, checks=checks)
    except TypeError:  # an older matching(versions) signature
        found = module.matching(versions)
    rows = []
    for item in found:
        model_types = [str(t) for t in (_field_of(item, "model_types") or ())]
        when = _field_of(item, "when")
        named = _when_packages(dict(when) if hasattr(when, "items") else when)
        check = _field_of(item, "check")
        rows.append(
            {
                "id": str(_field_of(item, "id", "")),
                "title": str(_field_of(item, "title", "")),
                "severity": str(_field_of(item, "severity", "warning")),
                "symptom": str(_field_of(item, "symptom", "") or ""),
                "remedy": str(_field_of(item, "remedy", "") or ""),
                "refs": [str(r) for r in (_field_of(item, "refs") or ())],
                "matched": {name: versions.get(name) for name in named},
                "when": {str(k): str(v) for k, v in dict(when).items()} if hasattr(when, "items") else when,
                "check": ({"name": getattr(check, "name", None), "status": checks.get(getattr(check, "name", ""), None)}
                          if check is not None else None),
                "condition": _field_of(item, "condition"),
                "fixed_in": {str(k): str(v) for k, v in dict(_field_of(item, "fixed_in") or {}).items()},
                "verified": [str(v) for v in (_field_of(item, "verified") or ())],
                "related_shims": [str(r) for r in (_field_of(item, "related_shims") or ())],
                "model_types": model_types,
                "applies": applies(model_types, model_type),
            }
        )
    return rows


APPLIES_YES = "yes"
APPLIES_CONDITIONAL = "conditional"
APPLIES_NO = "no"


def applies(model_types: List[str], model_type: Optional[str]) -> str:
    """``yes``: no model condition, or --model is one of them; ``conditional``: it concerns certain model
    types and the model is not known (no --model); ``no``: --model is another type."""
    if not model_types:
        return APPLIES_YES
    if model_type is None:
        return APPLIES_CONDITIONAL
    return APPLIES_YES if model_type in model_types else APPLIES_NO


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
    if n != 1 and word.endswith("y"):
        return f"{n} {word[:-1]}ies"
    return f"{n} {word}" + ("" if n == 1 else "s")


def _probe_problem(result: Dict[str, Any]) -> bool:
    """An unpatched present bug: it shows with the shim (disabled, not applied, out of range, or not fixing it)."""
    return bool(result.get("bug_with_shim")) or (bool(result.get("bug_without_shim")) and result.get("fixed") is False)


@dataclass
class ShimCounts:
    """The shim rows sorted by what they mean for the user (ids; ``unpatched`` keeps the rows)."""

    fix_rows: List[Dict[str, Any]]
    known: List[str]  # affected fix shims: the known bugs of this stack
    patched: List[str]  # apply() installs them
    fixed: List[str]  # patched, and their evidence is a fix (not a guard, not a warning)
    guarded: List[str]
    warned: List[str]
    unpatched: List[Dict[str, Any]]
    unverified: List[str]
    opt_in: List[str]  # every opt-in shim not applied: speed ones and fixes that change what a run trains
    opt_in_speed: List[str]

    @classmethod
    def of(cls, shims: List[Dict[str, Any]]) -> "ShimCounts":
        # Opt-in shims (speed, or a fix that changes what a run trains) are listed apart: apply() leaves them out.
        fix = [s for s in shims if s["kind"] == "fix"]
        patched = [s["id"] for s in fix if s["verdict"] in (PATCHED, PATCHED_ON_IMPORT)]
        evidence = {s["id"]: s.get("evidence", verdicts.FIXED) for s in fix}
        return cls(
            fix_rows=fix,
            known=[s["id"] for s in fix if s["affected"]],
            patched=patched,
            # Only fixes count as fixes: a guard turns a crash into a clear error, a warning only warns.
            fixed=[i for i in patched if evidence[i] in verdicts.FIXES],
            guarded=[i for i in patched if evidence[i] == verdicts.GUARDED],
            warned=[i for i in patched if evidence[i] == verdicts.WARNED],
            unpatched=[s for s in fix if s["verdict"] == UNPATCHED],
            unverified=[s["id"] for s in fix if s["verdict"] == UNVERIFIED],
            opt_in=[s["id"] for s in shims if s["verdict"] == OPT_IN],
            opt_in_speed=[s["id"] for s in shims if s["verdict"] == OPT_IN and s["kind"] == "speed"],
        )


def _registry_failed(report: Dict[str, Any]) -> bool:
    """No shim rows because the shim steps themselves failed: the doctor cannot vouch for anything."""
    return not report["shims"] and bool({e["section"] for e in report["errors"]} & {"shims", "trial"})


def _problems(report: Dict[str, Any], counts: ShimCounts) -> List[Dict[str, Any]]:
    """Everything that makes the exit code 1."""
    problems: List[Dict[str, Any]] = []
    for error in report["ftshims"].get("env_errors") or []:
        # apply() and the start-up hook reject this value: as things stand no shim gets applied at all.
        problems.append({"source": "setting", "id": error["variable"], "message": error["message"]})
    for s in counts.unpatched:
        problems.append(
            {"source": "shim", "id": s["id"], "message": f"{s['title']}: affected but {s['status']} ({s['reason']})"}
        )
    if _registry_failed(report):
        # Without statuses the doctor cannot say that no known bug stays unpatched.
        problems.append(
            {"source": "doctor", "id": "shims", "message": "the shims could not be evaluated (see errors); ftshims.apply() would likely fail too"}
        )
    for result in report["probes"]["results"]:  # present and unpatched probe bugs
        if _probe_problem(result):
            message = result.get("detail", "")
            # Out of the shim's range there is nothing to patch; the advisory says what to do instead.
            covering = [a["id"] for a in report["advisories"] if result.get("shim_id") in (a.get("related_shims") or ())]
            if covering:
                message += f" (see advisory {', '.join(covering)})"
            problems.append({"source": "probe", "id": result.get("shim_id"), "message": message})
    for finding in report["findings"]:
        if finding.get("severity") == "error":
            problems.append({"source": "finding", "id": finding.get("rule"), "message": finding.get("message", "")})
    return problems


def _warnings(report: Dict[str, Any], counts: ShimCounts) -> List[str]:
    warnings: List[str] = []
    torch = report["environment"]["torch"]
    if torch.get("status") == "import failed":
        warnings.append(f"torch does not import: {torch.get('error')}")
    python = report["environment"]["python"]
    if python.get("no_bytecode") and python.get("writes_bytecode") is False:
        warnings.append(
            f"{' and '.join(python['no_bytecode'])} have no compiled bytecode and PYTHONDONTWRITEBYTECODE is set: every "
            "process compiles them from source again (seconds per start, --probe included); fix: "
            "python -m compileall -q \"$(python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')\""
        )
    for row in report["trial"]["imports"]:
        if not row["ok"]:
            warnings.append(f"import {row['module']} failed: {row['error']}")
    if counts.unverified:
        warnings.append(f"could not verify {', '.join(counts.unverified)}: the module it patches did not import")
    gating = {pkg for s in report["shims"] for pkg in s["requires"]}
    for row in report["packages"]:
        if row["status"] == BROKEN:
            extra = " (a shim gates on it: it counts as not installed there)" if row["name"] in gating else ""
            warnings.append(f"{row['name']}: {row['detail']}{extra}")
        elif row.get("detail"):
            warnings.append(f"{row['name']}: {row['detail']}")
    fa = report["flash_attn"]
    if fa.get("ok") is False:
        warnings.append(f"flash-attn does not import ({fa['status']}); the flash-attn section says why and how to fix it")
    for result in report["probes"]["results"]:
        if result.get("status") in ("error", "timeout", "crashed", "not run"):
            warnings.append(f"probe {result.get('shim_id')} could not run ({result.get('status')}): {result.get('error')}")
    for advisory in report["advisories"]:
        # A model-specific advisory is a warning of this stack only once --model shows the model is that type.
        if advisory.get("severity") in ("error", "warning") and advisory.get("applies", APPLIES_YES) == APPLIES_YES:
            warnings.append(f"advisory {advisory.get('id')} ({advisory.get('severity')}): {advisory.get('title')}")
    if report["errors"]:
        warnings.append(f"{_plural(len(report['errors']), 'doctor step')} failed: {', '.join(e['section'] for e in report['errors'])}")
    return warnings


def _headline(report: Dict[str, Any], counts: ShimCounts) -> str:
    """One paragraph: the known bugs and what apply() does about them, then probes, lint and advisories."""
    known, unpatched = counts.known, counts.unpatched
    if _registry_failed(report):
        message = "The shim registry could not be evaluated; see errors."
    elif not known:
        message = f"No known bug of the {_plural(len(counts.fix_rows), 'fix shim')} in the registry affects this stack."
    else:
        message = (
            f"{_plural(len(known), 'known bug')} {'affects' if len(known) == 1 else 'affect'} this stack; "
            f"ftshims.apply() fixes {len(counts.fixed)} of {len(known)}"
            + (f", guards against {len(counts.guarded)} ({', '.join(counts.guarded)})" if counts.guarded else "")
            + (f", only warns about {len(counts.warned)} ({', '.join(counts.warned)})" if counts.warned else "")
            + "."
        )
        if unpatched:
            message += f" Unpatched: {', '.join(s['id'] for s in unpatched)}."
        if counts.patched:
            message += " Call ftshims.apply() (or import ftshims.auto) at the top of your training script; the doctor itself patched nothing."
    choices = [i for i in counts.opt_in if i not in counts.opt_in_speed]
    if choices:
        message += (f" Opt-in fixes that change what a run trains (off by default): {', '.join(choices)}"
                    " (ftshims.apply(include=[...]); see each shim's symptom).")
    if counts.opt_in_speed:
        message += f" Opt-in speed shims available: {', '.join(counts.opt_in_speed)} (ftshims.apply(include=[...]))."
    probe_rows = report["probes"]["results"]
    if report["probes"]["requested"]:
        ran = [r for r in probe_rows if r.get("bug_without_shim") is not None]
        present = [r for r in ran if r.get("bug_without_shim")]
        fixed = [r for r in present if r.get("fixed")]
        unpatched_probes = [r for r in probe_rows if _probe_problem(r)]
        could_not = [r for r in probe_rows if r.get("verdict") == "could not run"]
        message += (
            f" Probes: {len(ran)} ran, the bug showed in {len(present)}, the shim fixed {len(fixed)}"
            + (f", UNPATCHED: {', '.join(r['shim_id'] for r in unpatched_probes)}" if unpatched_probes else "")
            + (f", {len(could_not)} could not run" if could_not else "")
            + "."
        )
    if report["findings"]:
        by = {sev: sum(1 for f in report["findings"] if f.get("severity") == sev) for sev in ("error", "warning", "info")}
        message += f" Setup lint: {by['error']} error(s), {by['warning']} warning(s), {by['info']} note(s)."
    elif any(report["options"].get(k) for k in ("model", "adapter", "tokenizer", "deepspeed", "train_config")):
        message += " Setup lint: no findings."
    matching = [a for a in report["advisories"] if a.get("applies", APPLIES_YES) == APPLIES_YES]
    conditional = [a for a in report["advisories"] if a.get("applies") == APPLIES_CONDITIONAL]
    if matching:
        count = len(matching)
        message += f" {_plural(count, 'advisory')} {'matches' if count == 1 else 'match'} this stack (see Advisories)."
    if conditional:
        message += (
            f" {_plural(len(conditional), 'more advisory' if matching else 'advisory')} "
            f"{'applies' if len(conditional) == 1 else 'apply'} only to "
            "certain model types (--model CONFIG tells)."
        )
    return message


def summarize(report: Dict[str, Any]) -> Dict[str, Any]:
    """Problems (each one makes the exit code 1), warnings, counts and the headline message."""
    counts = ShimCounts.of(report["shims"])
    problems = _problems(report, counts)
    return {
        "exit_code": EXIT_UNPATCHED if problems else EXIT_OK,
        "known_bugs": counts.known,
        "patched_by_apply": counts.patched,
        "fixed_by_apply": counts.fixed,
        "guarded_by_apply": counts.guarded,
        "warned_by_apply": counts.warned,
        "unpatched": [s["id"] for s in counts.unpatched],
        "unverified": counts.unverified,
        "opt_in": counts.opt_in,
        "problems": problems,
        "warnings": _warnings(report, counts),
        "message": _headline(report, counts),
    }


__all__ = ["Options", "collect", "summarize", "skeleton", "SCHEMA", "SCHEMA_VERSION"]
