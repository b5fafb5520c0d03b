"""apply / revert / status: the lifecycle, modelled on OpenTelemetry's BaseInstrumentor.

Every setting (shim ids, option names and values, the ``FTSHIMS_*``
variables that feed them) is checked by :mod:`ftshims.settings` before
anything is installed: a bad one is a ``ValueError`` and nothing changes.
Then, for each registered shim, ``apply()`` decides, in this order:

1. *disabled* — named in ``FTSHIMS_DISABLE`` (or it is ``*``), excluded, not in
   ``only``, or a ``speed`` shim nobody asked for;
2. *not needed* — a required distribution is absent or outside the shim's
   version range (read from metadata; nothing is imported); a shim newer than
   a pinned ``release`` is *disabled* here, with what it would fix;
3. *deferred* — a module it patches is not imported yet: a post-import hook
   installs it the moment that module is imported;
4. *applied* — installed now; or *target missing* (the target is absent or its
   signature changed: skipped, nothing left patched) or *failed* (the install
   raised: rolled back, logged, and raised only with ``strict=True``).

All of it runs under one lock, so concurrent ``apply()`` calls and imports on
other threads see each shim either fully installed or not at all.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from . import registry, releases, settings
from ._util import actions_of, forget_actions
from .foreign import foreign_origin, is_shim_wrapper
from .imports import is_loaded, on_import, settle, wait_for_inflight_imports
from .patching import LOCK, Patcher, require_params, resolve
from .report import (
    APPLIED,
    DEFERRED,
    DISABLED,
    FAILED,
    NOT_APPLIED,
    NOT_NEEDED,
    TARGET_MISSING,
    Report,
    ShimStatus,
)
from .spec import SPEED, TargetMissing
from .versions import cached, explain_mismatch, in_range, installed_versions

log = logging.getLogger("ftshims")

DISABLE_ENV = settings.DISABLE_ENV


class ShimError(RuntimeError):
    """Raised by ``apply(strict=True)`` when a shim fails to install."""


@dataclass
class _Record:
    status: str = NOT_APPLIED
    reason: str = "apply() has not been called"
    patcher: Optional[Patcher] = None
    options: Dict[str, Any] = field(default_factory=dict)
    strict: bool = False
    cancels: List[Any] = field(default_factory=list)


_RECORDS: Dict[str, _Record] = {}


def is_rank_zero() -> bool:
    for name in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value not in (None, "", "0"):
            return False
    return True


def _info(shim_id: str, status: str, reason: str) -> None:
    if is_rank_zero():
        log.info("%s %s (%s)", shim_id, status, reason)  # the logger's name already says "ftshims"


def disabled_by_env() -> Set[str]:
    """The shim ids ``FTSHIMS_DISABLE`` names (every id for ``*``); ValueError for an unknown one."""
    return settings.parse_disable()


def selection(shim, only=None, exclude=None, include=None, versions=None, disabled=None, pinned=None):
    """``(status, reason)`` for a shim that is not active yet: DISABLED, NOT_NEEDED or None (selected).

    ``disabled``: the ids ``FTSHIMS_DISABLE`` names, when the caller has parsed it already.
    ``pinned``: ``(as given, full release)`` of ``apply(release=...)``.
    """
    spec = shim.spec
    if spec.id in (disabled_by_env() if disabled is None else disabled):
        return DISABLED, f"disabled by {DISABLE_ENV}"
    if exclude and spec.id in exclude:
        return DISABLED, "excluded by exclude="
    if only is not None and spec.id not in only:
        return DISABLED, "not selected by only="
    if not spec.by_default and not ((only and spec.id in only) or (include and spec.id in include)):
        what = "speed shim" if spec.kind == SPEED else "changes what a run trains"
        return DISABLED, f"{what}, opt-in: pass only=[...] or include=[...]"
    versions = versions if versions is not None else installed_versions(spec.requires)
    mismatch = explain_mismatch(spec.requires, versions)
    if mismatch:
        fixed = ", ".join(f"{k} {v}" for k, v in spec.fixed_in.items())
        return NOT_NEEDED, mismatch + (f" (fixed in {fixed})" if fixed else "")
    if pinned and spec.since and releases.newer(spec.since, pinned[1]):
        return DISABLED, newer_than_pin(spec, pinned[0])
    return None, "selected"


def newer_than_pin(spec, given: str) -> str:
    """The status reason of a shim left out by ``apply(release=...)``: the pin, its since-version, what it fixes."""
    return f"newer than the pinned release {given} (ftshims {spec.since}); it would fix: {spec.title}"


_PIN: List[Optional[Tuple[str, str]]] = [None]  # the last apply()'s release pin, for fingerprint()


def _check_pin(release, only_set, include_set) -> Optional[Tuple[str, str]]:
    """``(as given, full release)`` or None; ValueError when only/include name a shim the pinned release lacks."""
    full = settings.check_release(release)
    if full is None:
        return None
    given = str(release).strip()
    named = (only_set or set()) | (include_set or set())
    for shim_id in sorted(named):
        spec = registry.shims()[shim_id].spec if shim_id in registry.shims() else None
        if spec is not None and spec.since and releases.newer(spec.since, full):
            raise ValueError(f"{shim_id} is newer than the pinned release {given} (ftshims {spec.since}): "
                             "drop it from only=/include= or pin a newer release")
    return given, full


def _check_declared_targets(shim, versions) -> None:
    """TargetMissing if a declared target of an imported module is absent or changed."""
    spec = shim.spec
    for target in spec.targets:
        if target.when and not in_range(versions.get(target.package), target.when):
            continue
        module = sys.modules.get(target.module)
        if module is None or target.module not in spec.modules:
            continue  # family targets are checked by the shim as their modules appear
        owner, attr = resolve(module, target.qualname)
        require_params(getattr(owner, attr), target.params, target.dotted)


def _install(shim, record: _Record) -> None:
    """Install one shim now. Caller holds LOCK and has checked every module is imported."""
    versions = installed_versions(shim.spec.requires)
    patcher = Patcher(shim.id, on_part_error=_part_failed, own=own_packages(shim.spec))
    record.patcher = patcher
    try:
        _check_declared_targets(shim, versions)
        patcher.installing = True
        try:
            shim.install(patcher, record.options)
        finally:
            patcher.installing = False
    except TargetMissing as exc:
        patcher.undo()
        record.patcher = None
        record.status, record.reason = TARGET_MISSING, str(exc)
        log.warning("%s skipped, target missing: %s", shim.id, exc)
        return
    except Exception as exc:
        patcher.undo()
        record.patcher = None
        record.status, record.reason = FAILED, f"{type(exc).__name__}: {exc}"
        log.warning("%s failed and was rolled back: %s", shim.id, record.reason, exc_info=True)
        if record.strict:
            raise ShimError(f"{shim.id}: {record.reason}") from exc
        return
    record.status = APPLIED
    record.reason = ", ".join(f"{k} {versions[k]}" for k in shim.spec.requires)
    _info(shim.id, APPLIED, record.reason)


def own_packages(spec) -> Tuple[str, ...]:
    """Top-level modules whose objects are not foreign in this shim's targets: what it requires and patches."""
    names = {name.replace("-", "_").split(".", 1)[0] for name in spec.requires}
    names.update(target.module.split(".", 1)[0] for target in spec.targets)
    return tuple(sorted(names))


def foreign_targets(spec, skip: Tuple[str, ...] = ()) -> Dict[str, str]:
    """``{target: origin}`` for the declared targets of ``spec`` that another patcher has replaced (imported modules only).

    ``skip``: slot descriptions the shim patched itself (their foreign state is reported by its Patcher).
    """
    import inspect

    found: Dict[str, str] = {}
    own = own_packages(spec)
    for target in spec.targets:
        module = sys.modules.get(target.module)
        if module is None or not is_loaded(target.module):
            continue
        try:
            owner, attr = resolve(module, target.qualname)
            value = inspect.getattr_static(owner, attr)
        except (TargetMissing, AttributeError):
            continue
        while is_shim_wrapper(value):  # ftshims' own layers: judge what they wrap
            value = getattr(value, "__wrapped__", None)
        if any(target.dotted == s or target.dotted.endswith("." + s) for s in skip):
            continue
        origin = foreign_origin(owner, value, own)
        if origin:
            found[target.dotted] = origin
    return found


def _notes(shim, record: "_Record") -> List[str]:
    """The notes of an active shim: its own, foreign take-overs of its slots, and foreign code on its declared targets."""
    if record.patcher is None:
        return []
    notes = list(record.patcher.notes) + record.patcher.foreign_notes()
    for dotted, origin in foreign_targets(shim.spec, tuple(record.patcher.patched)).items():
        if not any(origin in note for note in notes):
            notes.append(f"target {dotted} holds foreign code ({origin}), replaced by another patcher: {shim.id} left it alone")
    return notes


def _part_failed(shim_id: str, exc: BaseException) -> None:
    """A deferred part of an applied shim raised: roll the whole shim back."""
    with LOCK:
        record = _RECORDS.get(shim_id)
        if record is None:
            return
        if record.patcher is not None:
            record.patcher.undo()
            record.patcher = None
        record.status, record.reason = FAILED, f"{type(exc).__name__}: {exc}"
        log.warning("%s failed and was rolled back: %s", shim_id, record.reason, exc_info=exc)
        if record.strict:
            raise ShimError(f"{shim_id}: {record.reason}") from exc


def _activate(shim, record: _Record) -> None:
    forget_actions(shim.id)  # counts start with this apply(), whether the install is now or deferred
    missing = [m for m in shim.spec.modules if not is_loaded(m)]
    if not missing:
        _install(shim, record)
        return
    record.status = DEFERRED
    record.reason = f"waiting for import of {', '.join(missing)}"
    _info(shim.id, DEFERRED, record.reason)

    def on_module_imported(module) -> None:
        with LOCK:
            if record.status != DEFERRED:
                return  # reverted or already installed
            # The module whose hook fires has run its body; importlib clears its
            # _initializing flag only after the hook returns.
            if all(m == module.__name__ or is_loaded(m) for m in shim.spec.modules):
                _install(shim, record)

    for name in missing:
        record.cancels.append(on_import(name, on_module_imported))


def apply(only=None, exclude=None, strict: bool = False, include=None, options=None, release=None) -> Report:
    """Apply every fix shim whose target versions are installed. See ``ftshims.apply``."""
    only_set, exclude_set, include_set, options = settings.check_arguments(only, exclude, include, options)
    pinned = _check_pin(release, only_set, include_set)
    disabled = settings.parse_disable()
    _print_summary_at_exit()  # checks FTSHIMS_SUMMARY, before anything is installed
    waited = set()
    with LOCK, cached():
        settle()  # deferred installs whose module finished importing without telling us (a race)
        # First decide every shim and check the settings of the selected ones (their FTSHIMS_* variables
        # included): a bad setting raises here, before anything is installed.
        plan = []
        for shim in registry.shims().values():
            record = _RECORDS.setdefault(shim.id, _Record())
            if record.status in (APPLIED, DEFERRED):
                continue  # idempotent: an active shim is left exactly as it is
            if only_set is not None and shim.id not in only_set and record.reason != _Record.reason:
                continue  # a narrowed call leaves the other shims' last decision alone
            skip, reason = selection(shim, only_set, exclude_set, include_set, disabled=disabled, pinned=pinned)
            chosen = None if skip else settings.shim_options(shim.spec, options.get(shim.id, {}), os.environ)
            plan.append((shim, record, skip, reason, chosen))
        _PIN[0] = pinned
        for shim, record, skip, reason, chosen in plan:
            if skip is not None:
                if (record.status, record.reason) != (skip, reason):
                    _info(shim.id, skip, reason)
                record.status, record.reason = skip, reason
                continue
            record.options = chosen
            record.strict = strict
            _activate(shim, record)
            if record.status == DEFERRED:
                waited.update(shim.spec.modules)
    # Outside the lock: an import of a watched module racing this call may have slipped past the hooks.
    wait_for_inflight_imports(waited)
    return status()


# Patches ftshims makes outside the shims (the monitor's Trainer attachment) that a full revert() undoes too.
_ON_FULL_REVERT: List[Any] = []


def on_full_revert(undo) -> None:
    """Call ``undo()`` once, at the next ``revert()`` of every shim (no ``only=``)."""
    with LOCK:
        if undo not in _ON_FULL_REVERT:
            _ON_FULL_REVERT.append(undo)


def revert(only=None) -> Report:
    """Undo every active shim (or those in ``only``), restoring the original objects."""
    only_set = settings.check_ids(only, "only")
    with LOCK:
        if only_set is None:
            while _ON_FULL_REVERT:
                _ON_FULL_REVERT.pop()()
        for shim_id in reversed(list(registry.ids())):
            if only_set is not None and shim_id not in only_set:
                continue
            record = _RECORDS.get(shim_id)
            if record is None or record.status not in (APPLIED, DEFERRED):
                continue
            for cancel in record.cancels:
                cancel()
            record.cancels.clear()
            if record.patcher is not None:
                record.patcher.undo()
                record.patcher = None
            record.status, record.reason = NOT_APPLIED, "reverted"
            _info(shim_id, NOT_APPLIED, "reverted")
        return status()


def status() -> Report:
    """The current state of every registered shim."""
    with LOCK, cached():
        settle()
        entries = []
        for shim in registry.shims().values():
            record = _RECORDS.get(shim.id) or _Record()
            entries.append(
                ShimStatus(
                    id=shim.id,
                    kind=shim.spec.kind,
                    status=record.status,
                    reason=record.reason,
                    title=shim.spec.title,
                    versions=installed_versions(shim.spec.requires),
                    patched=list(record.patcher.patched) if record.patcher else [],
                    waiting=list(record.patcher.waiting) if record.patcher else [],
                    notes=_notes(shim, record),
                    evidence=_evidence(shim.spec, record.status),
                    actions=actions_of(shim.id),
                )
            )
        for shim_id, reason in registry.load_errors().items():
            entries.append(ShimStatus(id=shim_id, kind="fix", status=FAILED, reason=reason))
        return Report(entries)


def summary_line() -> str:
    """``ftshims.summary()``: the counts ``status()`` gives (applied, and deferred apart: a deferred shim has
    installed nothing yet), then what the applied shims did so far."""
    report = status()
    applied = [entry for entry in report if entry.status == APPLIED]
    deferred = [entry for entry in report if entry.status == DEFERRED]
    did = [
        f"{entry.id} " + ", ".join(f"{n} {action}" for action, n in sorted(entry.actions.items()))
        for entry in applied
        if entry.actions
    ]
    idle = [entry.id for entry in applied if not entry.actions]
    text = f"ftshims: {len(applied)} shim{'s' if len(applied) != 1 else ''} applied"
    if deferred:
        shims = registry.shims()
        # top-level packages only: status() names each module (transformers.trainer, ...)
        waiting = sorted({module.split(".")[0] for entry in deferred if entry.id in shims
                          for module in shims[entry.id].spec.modules if not is_loaded(module)})
        text += f", {len(deferred)} deferred" + (f" (waiting for import of {', '.join(waiting)})" if waiting else "")
    text += "; acted: " + "; ".join(did) if did else "; none has acted yet"
    if idle and did:
        text += f"; not needed so far: {', '.join(idle)}"
    return text + f"; fingerprint {fingerprint(report)['hash']}"


def fingerprint(report: Optional[Report] = None) -> Dict[str, Any]:
    """See ``ftshims.fingerprint``: the active shims, their since-versions and non-default options, the gating
    versions and ftshims' version, hashed (sha256 of the canonical JSON, 12 hex digits)."""
    import hashlib
    import json

    from . import __version__

    report = status() if report is None else report
    shims: List[Dict[str, Any]] = []
    gating: Set[str] = set()
    with LOCK:
        for entry in report:
            shim = registry.shims().get(entry.id)
            if not entry.active or shim is None:
                continue
            spec = shim.spec
            record = _RECORDS.get(entry.id)
            chosen = record.options if record is not None else {}
            changed = {k: v for k, v in sorted(chosen.items()) if spec.options.get(k) != v}
            shims.append({"id": entry.id, "since": spec.since, "options": changed})
            gating.update(spec.requires)
    pinned = _PIN[0]
    body = {
        "ftshims": __version__,
        "release": pinned[1] if pinned else None,
        "versions": {name: version for name, version in sorted(installed_versions(tuple(sorted(gating))).items())},
        "shims": sorted(shims, key=lambda shim: shim["id"]),
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return {"hash": digest, **body}


_SUMMARY_AT_EXIT = []


def _print_summary_at_exit() -> None:
    """With FTSHIMS_SUMMARY on, print summary_line() once at exit, from rank 0 only (torchrun/accelerate set RANK)."""
    if _SUMMARY_AT_EXIT or not settings.parse_summary() or os.environ.get("RANK", "0") != "0":
        return
    import atexit

    _SUMMARY_AT_EXIT.append(True)
    atexit.register(lambda: print(summary_line(), file=sys.stderr))


def _evidence(spec, status: str) -> str:
    from . import verdicts

    if status in (APPLIED, DEFERRED):
        return verdicts.delivered(spec)
    return verdicts.ABSENT if status == NOT_NEEDED else verdicts.NOT_RUN


def notes(shim_id: str) -> List[str]:
    """Parts of an applied shim that were skipped (for example a model lacking the target)."""
    with LOCK:
        record = _RECORDS.get(shim_id)
        shim = registry.shims().get(shim_id)
        return _notes(shim, record) if record and shim else []


def export_to_children(**arguments) -> None:
    """Put this apply() call's arguments in FTSHIMS_AUTO for child processes to repeat."""
    import json

    clean = {k: (sorted(v) if isinstance(v, (set, frozenset, tuple)) else v) for k, v in arguments.items() if v}
    os.environ[settings.AUTO_ENV] = json.dumps(clean) if clean else "1"
