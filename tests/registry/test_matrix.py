"""COMPAT_MATRIX.md is generated from the registry; these tests fail when it is stale or wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftshims import matrix, registry, verdicts

ROOT = Path(__file__).resolve().parents[2]


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
        spec = registry.get(shim_id).spec
        per_stack = verified["shims"].get(shim_id, {})
        assert per_stack, f"{shim_id}: no stack recorded its reproduction"
        wanted = verdicts.delivered(spec)
        assert any(e["verdict"] == wanted for e in per_stack.values()), (
            f"{shim_id}: no stack shows the verdict {wanted!r}"
        )
        assert not [s for s, e in per_stack.items() if e["verdict"] == verdicts.MISMATCH], shim_id


def _spec(**changes):
    from ftshims.spec import ShimSpec, Target

    fields = dict(id="synthetic", title="t", symptom="s", why="w", requires={"transformers": ">=4"}, fixed_in={},
                  refs=("https://example.invalid/1",), targets=(Target("transformers.x", "f"),), modules=("transformers.x",))
    fields.update(changes)
    return ShimSpec(**fields)


REPRODUCED = {"affected": True, "expect_bug": True, "bug_without_shim": True, "bug_with_shim": False, "status": "applied"}
HEALTHY = {"affected": True, "expect_bug": False, "bug_without_shim": False, "bug_with_shim": False, "status": "applied"}
OUTSIDE = {"affected": False, "expect_bug": True, "bug_without_shim": False, "bug_with_shim": False,
           "status": "not needed"}


@pytest.mark.parametrize("scenarios,spec_changes,expected", [
    ({"a": REPRODUCED, "b": HEALTHY}, {}, verdicts.FIXED),
    ({"a": REPRODUCED}, {"stand_in": "a CPU stand-in"}, verdicts.FIXED_ON_STAND_IN),
    ({"a": REPRODUCED}, {"effect": "guards"}, verdicts.GUARDED),
    ({"a": REPRODUCED}, {"effect": "warns"}, verdicts.WARNED),
    ({"a": OUTSIDE}, {}, verdicts.ABSENT),
    ({}, {}, verdicts.NOT_RUN),
    ({"a": HEALTHY}, {"kind": "speed"}, verdicts.SAME_RESULTS),
    # what must never render as a success
    ({"a": dict(REPRODUCED, bug_without_shim=False)}, {}, verdicts.MISMATCH),  # failed negative control
    ({"a": REPRODUCED, "b": dict(HEALTHY, bug_without_shim=True)}, {}, verdicts.MISMATCH),  # a control showed the bug
    ({"a": dict(REPRODUCED, status="skipped")}, {}, verdicts.MISMATCH),  # shim not applied in range
    ({"a": dict(OUTSIDE, status="applied")}, {}, verdicts.MISMATCH),  # applied out of range
    ({"a": dict(REPRODUCED, bug_with_shim=True)}, {}, verdicts.MISMATCH),  # not fixed
    ({"a": HEALTHY}, {}, verdicts.MISMATCH),  # in range, never reproduced: the range is wrong
    ({"a": dict(OUTSIDE, bug_without_shim=True)}, {}, verdicts.MISMATCH),  # bug outside the range
    ({"a": dict(HEALTHY, bug_without_shim=True)}, {"kind": "speed"}, verdicts.MISMATCH),  # results differed
])
def test_synthetic_evidence_renders_the_right_verdict(scenarios, spec_changes, expected):
    assert matrix.verdict(scenarios, _spec(**spec_changes)) == expected


def _run(tmp_path, stack, results, versions=None):
    (tmp_path / f"{stack}.json").write_text(json.dumps({"stack": stack, "versions": versions or {}, "results": results}))


def test_evidence_comparison_is_semantic_and_complete(tmp_path, monkeypatch):
    from ftshims import datafiles

    stacks = {"s1": {"pins": ["transformers==4.57.6"]}, "s2": {"pins": []}}
    monkeypatch.setattr(datafiles, "stacks", lambda: stacks)
    first, second = registry.ids()[:2]
    _run(tmp_path, "s1", {first: {"x": HEALTHY}}, {"transformers": "4.57.6"})
    committed = {"stacks": {"s1": {"versions": {"transformers": "4.57.6"}}},
                 "shims": {first: {"s1": {"verdict": "fixed", "scenarios": 1, "reproduced": 0, "tests": ["?"]}},
                           second: {"s1": {"verdict": "absent", "scenarios": 1, "reproduced": 0, "tests": ["?"]}}}}
    monkeypatch.setattr(matrix, "load_verified", lambda: committed)
    problems = matrix.compare_evidence(tmp_path)
    assert any("no evidence for stack(s) s2" in p for p in problems), "a pinned stack without evidence"
    assert any(f"{first} on s1: evidence contradicts" in p for p in problems)
    assert any(f"{second} on s1: recorded, but this run produced no evidence" in p for p in problems)
    assert any(f"{first} on s1: this run supports" in p for p in problems), "compared field by field"


def test_evidence_from_other_versions_than_the_pins_is_refused(tmp_path, monkeypatch):
    from ftshims import datafiles

    monkeypatch.setattr(datafiles, "stacks", lambda: {"s1": {"pins": ["transformers==4.57.6"]}})
    _run(tmp_path, "s1", {}, {"transformers": "4.57.5"})
    _, problems = matrix.verified_from_evidence(tmp_path)
    assert any("transformers 4.57.5 installed, stack s1 pins 4.57.6" in p for p in problems)


def test_target_when_names_its_package():
    text = (ROOT / "COMPAT_MATRIX.md").read_text()
    assert "ConstantLengthDataset.__init__` (trl `<0.20`)" in text
    assert "(transformers `<0.20`)" not in text
