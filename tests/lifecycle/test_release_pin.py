"""Upgrading never changes a run's numbers silently: ``apply(release=...)`` and ``fingerprint()``.

On fakes (two shims, one from each release) for the machinery, and on the real registry for the
start-up hook and the fingerprint across processes. The changelog and the since-versions are checked
against each other in tests/registry/test_releases.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tests.fakes import FakeWorld, wrap_add

import ftshims
from ftshims import _manager, releases, settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def world(tmp_path, monkeypatch):
    w = FakeWorld(tmp_path, monkeypatch)
    w.add_shim("old_fix", wrap_add, since="0.1.0")
    w.add_shim("new_fix", wrap_add, since="0.2.0")
    yield w
    w.cleanup()


def test_pin_applies_only_what_the_release_applied(world):
    target = world.module()
    report = ftshims.apply(release="0.1")
    assert report["old_fix"].status == "applied"
    assert report["new_fix"].status == "disabled"
    assert report["new_fix"].reason == "newer than the pinned release 0.1 (ftshims 0.2.0); it would fix: fake new_fix"
    assert target.add(1) == 3  # one wrapper: old_fix's


@pytest.mark.parametrize("pin", ["0.2", "0.2.0", None])
def test_pin_to_the_current_release_or_none_applies_everything(world, pin):
    world.module()
    report = ftshims.apply(release=pin)
    assert report["old_fix"].status == report["new_fix"].status == "applied"


@pytest.mark.parametrize("pin", ["0.9", "1", "0.1.0.0", "latest", "", 0.1, ["0.1"]])
def test_unknown_release_raises_before_anything_is_installed(world, pin):
    target = world.module()
    original = target.add
    with pytest.raises(ValueError, match="release"):
        ftshims.apply(release=pin)
    assert target.add is original
    assert all(not entry.active for entry in ftshims.status())


def test_naming_a_newer_shim_under_a_pin_raises(world):
    with pytest.raises(ValueError, match="new_fix is newer than the pinned release 0.1"):
        ftshims.apply(release="0.1", only=["new_fix"])
    assert all(not entry.active for entry in ftshims.status())


def test_release_names():
    assert releases.normalize("0.1") == "0.1.0" and releases.normalize(" 0.2.0 ") == "0.2.0"
    assert releases.CURRENT == ftshims.__version__
    assert settings.parse_auto('{"release": "0.1"}') == {"release": "0.1"}


def test_fingerprint_tells_apart_what_was_applied(world):
    world.module()
    ftshims.apply(release="0.1")
    pinned = ftshims.fingerprint()
    assert pinned["release"] == "0.1.0"
    assert pinned["shims"] == [{"id": "old_fix", "since": "0.1.0", "options": {}}]
    assert pinned["versions"] == {"packaging": _manager.installed_versions(["packaging"])["packaging"]}
    assert pinned["ftshims"] == ftshims.__version__
    assert len(pinned["hash"]) == 12 and ftshims.fingerprint() == pinned  # stable
    ftshims.revert()
    ftshims.apply()
    full = ftshims.fingerprint()
    assert [s["id"] for s in full["shims"]] == ["new_fix", "old_fix"] and full["release"] is None
    assert full["hash"] != pinned["hash"]
    assert full["hash"] in ftshims.summary()
    ftshims.revert()
    assert ftshims.fingerprint()["shims"] == []


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full,
                          timeout=300)


FINGERPRINT = """
import json, ftshims.auto, ftshims
print(json.dumps(ftshims.fingerprint()))
"""


def test_pinned_and_unpinned_runs_of_the_real_registry_through_the_start_up_hook():
    """FTSHIMS_AUTO's release key reaches apply(); the fingerprint is the same in two processes that applied the
    same shims, and differs where the pin left a newer shim out."""
    pinned = [_python(FINGERPRINT, {"FTSHIMS_AUTO": '{"release": "0.1"}'}) for _ in range(2)]
    unpinned = _python(FINGERPRINT, {"FTSHIMS_AUTO": "1"})
    for result in pinned + [unpinned]:
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    one, two = (json.loads(r.stdout.strip().splitlines()[-1]) for r in pinned)
    full = json.loads(unpinned.stdout.strip().splitlines()[-1])
    assert one == two, "same environment, same pin: same fingerprint"
    assert all(shim["since"] == "0.1.0" for shim in one["shims"])
    newer = {s["id"] for s in full["shims"] if releases.newer(s["since"], "0.1.0")}
    assert (one["hash"] == full["hash"]) == (not newer and one["shims"] == full["shims"])
    assert {s["id"] for s in one["shims"]} == {s["id"] for s in full["shims"]} - newer


def test_a_bad_release_in_ftshims_auto_applies_nothing():
    result = _python(FINGERPRINT, {"FTSHIMS_AUTO": '{"release": "0.9"}'})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown ftshims release '0.9'" in lines[0] and "no shims applied" in lines[0]
    assert json.loads(result.stdout.strip().splitlines()[-1])["shims"] == []


def test_the_doctor_reports_a_bad_release_in_ftshims_auto():
    problems = settings.environment_problems({"FTSHIMS_AUTO": '{"release": "9"}'})
    assert [p["variable"] for p in problems] == ["FTSHIMS_AUTO"]
    assert "unknown ftshims release" in problems[0]["message"]


def test_propagate_exports_the_pin(world, monkeypatch):
    monkeypatch.delenv(settings.AUTO_ENV, raising=False)
    ftshims.apply(release="0.1", propagate=True)
    assert json.loads(os.environ[settings.AUTO_ENV]) == {"release": "0.1"}
