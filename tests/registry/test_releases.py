"""The version, the releases and CHANGELOG.md agree: every shim's since-version has its changelog entry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import ftshims
from ftshims import registry, releases
from ftshims.spec import FIX, OPT_IN, SPEED

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
NUMERICS = "**changes training numerics**"
NO_NUMERICS = "*does not change training numerics*"


def sections() -> dict:
    """``{release: text}`` of CHANGELOG.md's ``## [X.Y.Z] - date`` sections, in file order."""
    found = {}
    parts = re.split(r"^## \[([^\]]+)\][^\n]*$", CHANGELOG, flags=re.M)
    for release, text in zip(parts[1::2], parts[2::2]):
        found[release] = text
    return found


def test_version_is_the_newest_release():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == ftshims.__version__ == releases.CURRENT


def test_one_changelog_section_per_release_newest_first():
    assert list(sections()) == list(reversed(releases.RELEASES))


def _entry(shim_id: str, text: str):
    """The changelog line of a shim in a release's text, and the heading it sits under."""
    heading = None
    for line in text.splitlines():
        if line.startswith("### "):
            heading = line[4:].lower()
        elif line.startswith("- ") and f"`{shim_id}`" in line.split("—")[0]:
            return line, heading
    return None, None


@pytest.mark.parametrize("shim_id", registry.ids())
def test_every_since_version_has_its_changelog_entry(shim_id):
    spec = registry.get(shim_id).spec
    text = sections().get(spec.since)
    assert text is not None, f"{shim_id}: since={spec.since!r} has no section in CHANGELOG.md"
    line, heading = _entry(shim_id, text)
    assert line, f"{shim_id}: CHANGELOG.md [{spec.since}] does not list it"
    if spec.kind == SPEED:
        assert "speed" in heading, f"{shim_id}: speed shims are listed apart ({heading!r})"
        return
    if spec.kind == OPT_IN:
        assert "opt-in" in heading, f"{shim_id}: opt-in fixes are listed apart ({heading!r})"
    else:
        assert spec.kind == FIX and "default" in heading, f"{shim_id}: listed under a default-shims heading ({heading!r})"
    marker = NUMERICS if spec.changes_numerics else NO_NUMERICS
    assert marker in line, f"{shim_id}: its changelog line must say {marker} ({line!r})"
