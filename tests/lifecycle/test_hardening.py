"""Faults, concurrency and hostile inputs injected into every real shim, in the installed stack.

For each registered shim whose versions match this stack: its declared targets
removed, its targets' signatures changed, every module it patches raising on
import, apply() from 8 threads over apply/revert cycles. The invariants: no
exception escapes apply() (strict=False), nothing stays half-patched, each
target is wrapped at most once, revert restores identity. Runs on every pinned
stack, since the targets are the installed versions' own.

Left to the others: the same promises on the normal path, no fault injected
(test_real_shims.py), and how the machinery itself handles each fault (a failing
install, a missing or changed target, a module raising on import, threads
racing apply() and the import), proven once on fake shims (test_apply_revert.py).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

import ftshims
from ftshims import _manager, registry
from ftshims.patching import resolve, wrapper_depth
from ftshims.probing import in_affected_range
from ftshims.versions import in_range, installed_version

from tests.fakes import at_once_on_threads
from tests.lifecycle.test_real_shims import _snapshot

COUNTS = {"cases": 0}


def _in_range_shims():
    return [s for s in registry.shims().values() if in_affected_range(s.id)[0]]


def _declared_targets(shim):
    """Declared targets that exist on this stack (their module imported, their `when` satisfied)."""
    first = next(iter(shim.spec.requires))
    version = installed_version(first)
    found = []
    for target in shim.spec.targets:
        if target.when and not in_range(version, target.when):
            continue
        try:
            module = importlib.import_module(target.module)
            owner, attr = resolve(module, target.qualname)
        except Exception:
            continue
        found.append((target, owner, attr))
    return found


def _import_all():
    registry.import_shim_modules()


SHIMS = [s.id for s in registry.shims().values()]


@pytest.mark.parametrize("shim_id", SHIMS)
def test_missing_target_skips_cleanly(shim_id, monkeypatch):
    shim = registry.get(shim_id)
    if not in_affected_range(shim_id)[0]:
        pytest.skip("not in range on this stack")
    _import_all()
    targets = [t for t in _declared_targets(shim) if t[0].module in shim.spec.modules]
    if not targets:
        pytest.skip("no declared target checked at install time on this stack")
    removable = [(t, o, a) for t, o, a in targets if a in vars(o)]
    if not removable:
        pytest.skip("every declared target is inherited; nothing to remove")
    for target, owner, attr in removable:
        COUNTS["cases"] += 1
        before = _snapshot()
        with monkeypatch.context() as m:
            m.delattr(owner, attr)
            report = ftshims.apply(only=[shim_id])
            assert report[shim_id].status == "target missing", (report[shim_id].status, report[shim_id].reason)
            ftshims.revert()
        after = _snapshot()
        assert not [k for k, v in before.items() if after.get(k) is not v], "half-applied shim left changes"


@pytest.mark.parametrize("shim_id", SHIMS)
def test_changed_signature_skips_cleanly(shim_id, monkeypatch):
    shim = registry.get(shim_id)
    if not in_affected_range(shim_id)[0]:
        pytest.skip("not in range on this stack")
    _import_all()
    targets = [t for t in _declared_targets(shim) if t[0].params and t[0].module in shim.spec.modules]
    if not targets:
        pytest.skip("the shim declares no parameters to check")
    for target, owner, attr in targets:
        COUNTS["cases"] += 1

        def changed_signature(completely, different):
            raise AssertionError("must never be called")

        with monkeypatch.context() as m:
            m.setattr(owner, attr, changed_signature)
            report = ftshims.apply(only=[shim_id])
            assert report[shim_id].status == "target missing", report[shim_id]
            assert "signature changed" in report[shim_id].reason
            ftshims.revert()


@pytest.mark.parametrize("shim_id", SHIMS)
def test_eight_threads_and_cycles(shim_id):
    if not in_affected_range(shim_id)[0]:
        pytest.skip("not in range on this stack")
    _import_all()
    before = _snapshot()
    for cycle in range(3):
        COUNTS["cases"] += 1
        assert not at_once_on_threads(lambda: ftshims.apply(only=[shim_id], include=[shim_id]))
        record = _manager._RECORDS[shim_id]
        assert record.status in ("applied", "deferred", "target missing"), (record.status, record.reason)
        for container, key, is_item, original in (record.patcher.slots if record.patcher else []):
            value = container[key] if is_item else vars(container).get(key)
            depth = wrapper_depth(value)
            assert depth <= 1, f"{key} wrapped {depth} times"
        ftshims.revert()
        after = _snapshot()
        assert not [k for k, v in before.items() if after.get(k) is not v], f"cycle {cycle}: identity not restored"


def _subprocess(code: str) -> dict:
    env = dict(os.environ)
    env.pop("FTSHIMS_DISABLE", None)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_module_raising_on_import_never_breaks_apply():
    """Every shim's modules raise on import (a broken install): apply() still returns, the user's import fails."""
    modules = sorted({m for s in registry.shims().values() for m in s.spec.modules})
    data = _subprocess(
        f"""
        import json, sys
        BROKEN = {modules!r}
        class Raiser:
            def find_spec(self, name, path=None, target=None):
                if name in BROKEN:
                    raise ImportError("injected: " + name + " is broken")
                return None
        sys.meta_path.insert(0, Raiser())
        import ftshims
        ftshims.apply()
        errors = []
        for name in BROKEN:
            try:
                __import__(name)
            except ImportError as exc:
                errors.append(str(exc))
        print(json.dumps({{"statuses": {{e.id: e.status for e in ftshims.status()}}, "errors": len(errors)}}))
        """
    )
    COUNTS["cases"] += len(modules)
    assert data["errors"] == len(modules)
    for shim_id, status in data["statuses"].items():
        assert status in ("deferred", "not needed", "disabled"), (shim_id, status)


def test_zz_report_counts(capsys):
    """Prints how many fault-injection cases ran in this session (for the closing note)."""
    with capsys.disabled():
        print(f"\nfault-injection cases run: {COUNTS['cases']}")
