"""The peer suites' declared differences (tests/peer/declared.toml) name what exists, and the comparison that CI
relies on (tests/peer/run.py) fails on what it must fail on: an undeclared difference, a declared difference with
other outcomes, a declaration that did not happen. Fast and offline: reads TOML and calls the comparison."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from ftshims.shims import SHIM_IDS

PEER = Path(__file__).resolve().parents[1] / "peer"
OUTCOMES = {"passed", "failed", "error", "skipped", "xfailed", "xpassed", "collection error", None}


def _runner():
    spec = importlib.util.spec_from_file_location("peer_run", PEER / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _runner()


def _rows():
    return run.load_toml(PEER / "declared.toml").get("difference", [])


@pytest.mark.parametrize("row", _rows(), ids=lambda row: row.get("test", "?"))
def test_declared_difference_names_what_exists(row):
    assert set(row) == {"suite", "release", "test", "off", "default", "shim", "reason", "ref"}, sorted(row)
    assert row["shim"] in SHIM_IDS
    config = run.release_config(row["suite"], row["release"])
    assert run.file_of(row["test"]) in config["files"], f"{row['test']} is not in a file the release runs"
    assert (config["folder"] / run.file_of(row["test"])).is_file()
    assert row["off"] in OUTCOMES and row["default"] in OUTCOMES and row["off"] != row["default"]
    assert row["ref"].startswith("https://github.com/"), row["ref"]
    assert len(row["reason"]) > 40


def test_every_release_folder_is_complete():
    for peer_toml in PEER.glob("*/*/peer.toml"):
        folder = peer_toml.parent
        config = run.release_config(folder.parent.name, folder.name)
        assert config["files"] and config["source"] and (folder / "SOURCE").is_file()
        assert (folder.parent / "LICENSE").is_file()
        for name in config["files"]:
            assert (folder / name).is_file(), name


def _results(off: dict, default: dict) -> dict:
    return {"off": {k: {"outcome": v, "message": ""} for k, v in off.items()},
            "default": {k: {"outcome": v, "message": ""} for k, v in default.items()}}


def _declared(test: str, off: str, default: str) -> dict:
    return {test: {"test": test, "off": off, "default": default}}


def test_comparison_accepts_exactly_the_declared_difference():
    results = _results({"a": "passed", "b": "failed"}, {"a": "passed", "b": "passed"})
    undeclared, stale, seen = run.compare(results, _declared("b", "failed", "passed"))
    assert (undeclared, stale, seen) == ([], [], ["b"])


def test_comparison_fails_on_an_undeclared_difference():
    results = _results({"a": "passed"}, {"a": "failed"})
    undeclared, stale, seen = run.compare(results, {})
    assert [u[:3] for u in undeclared] == [("a", "passed", "failed")] and not stale and not seen


def test_comparison_fails_on_a_declared_difference_with_other_outcomes():
    results = _results({"a": "passed"}, {"a": "error"})
    undeclared, stale, _ = run.compare(results, _declared("a", "passed", "failed"))
    assert [u[0] for u in undeclared] == ["a"] and stale == ["a"]


def test_comparison_fails_on_a_declaration_that_did_not_happen():
    results = _results({"a": "passed"}, {"a": "passed"})
    undeclared, stale, _ = run.compare(results, _declared("a", "passed", "failed"))
    assert not undeclared and stale == ["a"]


def test_comparison_counts_a_test_missing_from_one_mode():
    results = _results({"a": "passed", "b": "passed"}, {"a": "passed"})
    undeclared, _, _ = run.compare(results, {})
    assert [u[:3] for u in undeclared] == [("b", "passed", None)]
