"""ftshims' own releases, for since-versions and ``apply(release=...)``.

Every shim's spec says in ``since`` the ftshims release that added it as a
default or last changed what it computes. A user who validated a run with one
release pins it (``ftshims.apply(release="0.1")``) and gets only the shims
that release applied; CHANGELOG.md says, release by release, which shims
change training numerics. A new release is added here and to CHANGELOG.md
together (tests/registry/test_releases.py checks both).
"""

from __future__ import annotations

from typing import Tuple

# Oldest first. The last one is the version of this package (pyproject.toml, ftshims.__version__).
RELEASES: Tuple[str, ...] = ("0.1.0", "0.2.0", "0.3.0")
CURRENT = RELEASES[-1]


def _key(release: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def normalize(release: object) -> str:
    """The full release a pin names: ``"0.1"`` and ``"0.1.0"`` name 0.1.0. ValueError for anything else."""
    if not isinstance(release, str) or not release.strip():
        raise ValueError(f"release must be an ftshims release such as {CURRENT!r}, not {release!r}")
    text = release.strip()
    try:
        wanted = _key(text)
    except ValueError:
        raise ValueError(f"release {release!r} is not a version; known releases: {', '.join(RELEASES)}") from None
    for known in RELEASES:
        key = _key(known)
        if key == wanted or (len(wanted) == 2 and key[:2] == wanted and key[2] == 0):
            return known
    raise ValueError(f"unknown ftshims release {release!r}; known releases: {', '.join(RELEASES)}")


def check_release(release: str, what: str = "release") -> None:
    """Raise ValueError unless ``release`` is one of :data:`RELEASES` exactly (specs name full releases)."""
    if release not in RELEASES:
        raise ValueError(f"{what} must be one of the ftshims releases {', '.join(RELEASES)}, not {release!r}")


def newer(since: str, pinned: str) -> bool:
    """Whether a shim with this since-version is newer than the pinned release."""
    return _key(since) > _key(pinned)
