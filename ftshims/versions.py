"""Installed versions and version ranges, without importing the packages.

Versions come from ``importlib.metadata`` only: importing transformers to read
``__version__`` would cost seconds and could itself fail.

Ranges are ``packaging`` specifiers evaluated with ``prereleases=True``
explicitly, so that the answer does not depend on the installed ``packaging``
release (24.x and 26.x disagree on ``SpecifierSet(">=4.50").contains("4.57.0.dev0")``
when ``prereleases`` is left unset). The semantics are PEP 440's:

* ``4.57.0.dev0`` is inside ``>=4.50`` and inside ``<4.58``;
* ``5.0.0.dev0`` is *not* inside ``<5.0`` (PEP 440 excludes pre-releases of the
  bound from an exclusive upper bound), so a development build of a fixed
  release counts as fixed;
* local labels (``2.13.0+cpu``, ``2.6.0a0+git1234``) are ignored in comparisons.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Mapping, Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# Set while a manager call runs: each lookup scans sys.path (~3 ms), and one
# apply() asks for the same few distributions a dozen times.
_CALL_CACHE: Optional[Dict[str, Optional[str]]] = None


@contextlib.contextmanager
def cached() -> Iterator[None]:
    """Memoise :func:`installed_version` for the duration of the block (re-entrant)."""
    global _CALL_CACHE
    outermost = _CALL_CACHE is None
    if outermost:
        _CALL_CACHE = {}
    try:
        yield
    finally:
        if outermost:
            _CALL_CACHE = None


def installed_version(distribution: str) -> Optional[str]:
    """The installed version string of ``distribution``, or None if absent or unreadable."""
    cache = _CALL_CACHE
    if cache is not None and distribution in cache:
        return cache[distribution]
    from importlib import metadata

    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        version = None
    except Exception:  # broken metadata (e.g. a half-deleted dist-info) reads as absent
        version = None
    if cache is not None:
        cache[distribution] = version
    return version


def installed_versions(distributions) -> Dict[str, Optional[str]]:
    return {name: installed_version(name) for name in distributions}


def parse_version(version: str) -> Optional[Version]:
    try:
        return Version(version)
    except InvalidVersion:
        return None


def older_than(version: Optional[str], bound: str) -> bool:
    """True when ``version`` is known, valid and below ``bound``; False for a missing or unparsable one."""
    parsed = parse_version(version) if version else None
    return parsed is not None and parsed < Version(bound)


def in_range(version: Optional[str], specifier: str) -> bool:
    """True when ``version`` satisfies ``specifier`` (pre-releases included)."""
    if version is None:
        return False
    parsed = parse_version(version)
    if parsed is None:
        return False
    try:
        spec = SpecifierSet(specifier, prereleases=True)
    except InvalidSpecifier as exc:
        raise ValueError(f"invalid version specifier {specifier!r}") from exc
    return spec.contains(parsed, prereleases=True)


def explain_mismatch(requires: Mapping[str, str], versions: Mapping[str, Optional[str]]) -> Optional[str]:
    """None when every requirement holds, else a one-line reason naming the first that does not."""
    for name, specifier in requires.items():
        version = versions.get(name)
        if version is None:
            return f"{name} is not installed"
        if parse_version(version) is None:
            return f"{name} {version} is not a PEP 440 version"
        if not in_range(version, specifier):
            return f"{name} {version} is outside {specifier}"
    return None
