"""Adding a shim touches five places; this test names the one that was forgotten (see
ftshims.registry.ShimModule for the checklist)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ftshims import matrix, registry
from ftshims.spec import SPEED

ROOT = Path(__file__).resolve().parents[2]
IDS = registry.ids()


def test_every_registered_shim_loads():
    assert registry.load_errors() == {}


@pytest.mark.parametrize("shim_id", IDS)
def test_checklist(shim_id):
    shim = registry.get(shim_id)
    module_file = ROOT / "ftshims" / "shims" / f"{shim_id}.py"
    assert module_file.is_file(), f"one shim per file: {module_file}"
    assert (shim.module.__doc__ or "").strip(), f"{shim_id}: the module docstring says why, when, how it falls back"
    assert shim.spec.since, f"{shim_id}: since= names the ftshims release that added it or changed what it computes"
    assert list(inspect.signature(shim.module.install).parameters) == ["patcher", "options"]
    assert (ROOT / "tests" / "shims" / f"test_{shim_id}.py").is_file(), f"{shim_id}: tests/shims/test_{shim_id}.py"
    assert shim_id in matrix.load_verified()["shims"], f"{shim_id}: no evidence in verified.json (record a matrix run)"
    assert f"`{shim_id}`" in (ROOT / "COMPAT_MATRIX.md").read_text(), f"{shim_id}: regenerate COMPAT_MATRIX.md"
    if shim.spec.kind != SPEED:
        import sys

        sys.path.insert(0, str(ROOT / "tools"))
        import mutation

        assert mutation.assignment().get(shim_id), f"{shim_id}: no pinned stack can run its mutation check"
