"""Installed versions of the packages a fine-tuning stack is made of, from metadata only.

Nothing here imports the packages: ``importlib.metadata`` reads the
``*.dist-info`` / ``*.egg-info`` directories. Metadata can be broken in the wild
(a half-deleted dist-info, an undecodable METADATA file, two installs of one
package left on ``sys.path``); each of those is reported on the package's row,
never raised.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional

from packaging.version import InvalidVersion, Version

# The packages issue 2 asks for, in report order; every package a registered shim
# gates on is appended after them (see ``package_names``).
DEFAULT_PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "trl",
    "flash-attn",
    "accelerate",
    "deepspeed",
    "bitsandbytes",
    "triton",
    "liger-kernel",
    "wrapt",
    "packaging",
)

INSTALLED = "installed"
ABSENT = "not installed"
BROKEN = "broken metadata"


def package_names(extra: Iterable[str] = ()) -> List[str]:
    names = list(DEFAULT_PACKAGES)
    for name in extra:
        if _normalize(name) not in {_normalize(n) for n in names}:
            names.append(name)
    return names


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _distributions(name: str) -> list:
    """Every distribution on sys.path named ``name`` (also tried with ``_`` for older Pythons)."""
    from importlib import metadata

    found = list(metadata.distributions(name=name))
    if not found and "-" in name:
        found = list(metadata.distributions(name=name.replace("-", "_")))
    unique, seen = [], set()
    for dist in found:  # the same directory listed twice on sys.path is one install
        location = _location(dist)
        key = os.path.realpath(location) if location else id(dist)
        if key not in seen:
            seen.add(key)
            unique.append(dist)
    return unique


def _location(dist) -> Optional[str]:
    path = getattr(dist, "_path", None)  # PathDistribution: the dist-info directory
    return str(path) if path is not None else None


def _read_version(dist) -> Dict[str, Any]:
    """``{"version", "problem"}`` for one distribution; problem is None when healthy."""
    try:
        version = dist.version
    except Exception as exc:  # an unreadable METADATA file raises on access
        return {"version": None, "problem": f"metadata unreadable: {type(exc).__name__}: {_one_line(exc)}"}
    if not version:
        return {"version": None, "problem": "metadata has no Version field (missing or empty METADATA)"}
    try:
        Version(version)
    except InvalidVersion:
        return {"version": version, "problem": f"version {version!r} is not a PEP 440 version"}
    return {"version": version, "problem": None}


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def package_row(name: str) -> Dict[str, Any]:
    """One row of the packages section. Never raises."""
    row: Dict[str, Any] = {"name": name, "status": ABSENT, "version": None, "detail": None, "location": None}
    try:
        dists = _distributions(name)
    except Exception as exc:
        row.update(status=BROKEN, detail=f"metadata lookup failed: {type(exc).__name__}: {_one_line(exc)}")
        return row
    if not dists:
        return row
    first = _read_version(dists[0])
    row["version"] = first["version"]
    row["location"] = _location(dists[0])
    row["status"] = INSTALLED if first["problem"] is None else BROKEN
    row["detail"] = first["problem"]
    if len(dists) > 1:
        versions = [str(_read_version(d)["version"]) for d in dists]
        note = f"{len(dists)} installs on sys.path ({', '.join(versions)}); the first one is used"
        row["detail"] = f"{row['detail']}; {note}" if row["detail"] else note
    return row


def collect_packages(names: Iterable[str]) -> List[Dict[str, Any]]:
    return [package_row(name) for name in names]
