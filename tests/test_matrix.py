"""COMPAT_MATRIX.md is generated from the registry; these tests fail when it is stale or wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftshims import matrix, registry

ROOT = Path(__file__).resolve().parent.parent


def test_compat_matrix_is_current():
    assert matrix.main(["--check", "--output", str(ROOT / "COMPAT_MATRIX.md")]) == 0, (
        "COMPAT_MATRIX.md is stale: run `python -m ftshims.matrix` and commit it"
    )


def test_every_shim_is_in_the_matrix_with_its_refs():
    text = (ROOT / "COMPAT_MATRIX.md").read_text()
    for shim in registry.shims().values():
        assert f"`{shim.id}`" in text
        for url in shim.spec.refs:
            assert url in text


def test_every_shim_has_recorded_evidence():
    verified = matrix.load_verified()
    for shim_id in registry.ids():
        per_stack = verified["shims"].get(shim_id, {})
        assert per_stack, f"{shim_id}: no stack recorded its reproduction"
        wanted = matrix.EQUIVALENT if registry.get(shim_id).spec.kind == "speed" else matrix.FIXED
        assert any(e["verdict"] == wanted for e in per_stack.values()), (
            f"{shim_id}: no stack shows the verdict {wanted!r}"
        )
        assert not [s for s, e in per_stack.items() if e["verdict"] == matrix.MISMATCH], shim_id


def _run(tmp_path, stack, results):
    (tmp_path / f"{stack}.json").write_text(json.dumps({"stack": stack, "versions": {}, "results": results}))


def test_verdicts():
    ok = {"affected": True, "bug_without_shim": True, "bug_with_shim": False}
    healthy = {"affected": True, "bug_without_shim": False, "bug_with_shim": False}
    outside = {"affected": False, "bug_without_shim": False, "bug_with_shim": False}
    assert matrix.verdict({"a": ok, "b": healthy}) == matrix.FIXED
    assert matrix.verdict({"a": healthy}) == matrix.MISMATCH, "in range but never reproduced"
    assert matrix.verdict({"a": outside}) == matrix.ABSENT
    assert matrix.verdict({"a": dict(outside, bug_without_shim=True)}) == matrix.MISMATCH, "bug outside the range"
    assert matrix.verdict({"a": dict(ok, bug_with_shim=True)}) == matrix.MISMATCH, "shim did not fix it"
    assert matrix.verdict({}) == matrix.MISMATCH
    assert matrix.verdict({"a": healthy}, kind="speed") == matrix.EQUIVALENT
    assert matrix.verdict({"a": ok}, kind="speed") == matrix.MISMATCH, "a speed shim's run differed"


def test_evidence_comparison_flags_disagreement(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "load_verified", lambda: {
        "stacks": {"s1": {}},
        "shims": {shim_id: {"s1": {"verdict": matrix.FIXED}} for shim_id in registry.ids()},
    })
    monkeypatch.setattr(matrix, "stacks", lambda: {"s1": {}, "s2": {}})
    first = registry.ids()[0]
    _run(tmp_path, "s1", {first: {"x": {"affected": True, "bug_without_shim": False, "bug_with_shim": False}}})
    problems = matrix.compare_evidence(tmp_path)
    assert any("no evidence for stack(s) s2" in p for p in problems)
    assert any(f"{first} on s1: evidence contradicts" in p for p in problems)
    assert any("produced no evidence" in p for p in problems), "a recorded shim silently missing from a run"
    assert not matrix.compare_evidence(tmp_path, require_all=False) == []
