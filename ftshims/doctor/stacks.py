"""Is the installed stack one the test suite runs on? The report's ``tested_stack`` section.

``ftshims/data/stacks.toml`` pins every tested stack. The installed versions are compared with each
stack's pins of :data:`COMPARED`, torch included: a stack runs on torch 2.13.0 unless it names its own
(``datafiles.torch_version``: ``t5_25`` runs torch 2.15.0, the other stacks 2.13.0), and torch's local
label (``+cpu``, ``+cu132``) is not part of the comparison. When none matches exactly, the nearest
stacks are named: smallest transformers distance first, then peft, trl, accelerate, datasets, torch.
The shims' ranges are evaluated on the installed versions either way; an untested combination only
means no test run backs those verdicts.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

from packaging.version import InvalidVersion, Version

COMPARED = ("transformers", "peft", "trl", "accelerate", "datasets", "torch")

EXACT = "exact"
UNTESTED = "untested"
UNKNOWN = "unknown"

_FAR = float("inf")


def empty() -> Dict[str, Any]:
    return {"status": None, "compared": {}, "stacks": [], "differences": {}, "message": None}


def _public(version: Optional[str]) -> Optional[Version]:
    """The version without its local label (``+cpu``); None when missing or not PEP 440."""
    if not version:
        return None
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def _distance(installed: Optional[str], pinned: str) -> float:
    """How far apart two versions are, as major/minor/micro digits of one number (inf: not comparable)."""
    a, b = _public(installed), _public(pinned)
    if a is None or b is None:
        return _FAR
    number = lambda v: sum(part * 1000 ** (2 - i) for i, part in enumerate((v.release + (0, 0, 0))[:3]))  # noqa: E731
    return abs(number(a) - number(b))


def compare(installed: Mapping[str, Optional[str]], stacks: Mapping[str, Dict[str, str]]) -> Dict[str, Any]:
    """``installed``: {package: version or None}; ``stacks``: {name: {package: pinned version}} (file order)."""
    section = empty()
    section["compared"] = {name: installed.get(name) for name in COMPARED}
    differences: Dict[str, Dict[str, Dict[str, Optional[str]]]] = {}
    keys: Dict[str, Tuple[float, ...]] = {}
    for stack, pins in stacks.items():
        pinned = {name: pins[name] for name in COMPARED if name in pins}
        differences[stack] = {
            name: {"installed": installed.get(name), "tested": version}
            for name, version in pinned.items()
            if _public(installed.get(name)) is None or _public(installed.get(name)) != _public(version)
        }
        keys[stack] = tuple(_distance(installed.get(name), pinned[name]) if name in pinned else _FAR for name in COMPARED)
    exact = [stack for stack, diff in differences.items() if not diff]
    if exact:
        section.update(status=EXACT, stacks=exact, differences={})
        versions = ", ".join(f"{k} {v}" for k, v in section["compared"].items())
        also = f" (also {', '.join(exact[1:])})" if len(exact) > 1 else ""
        section["message"] = f"exactly the tested stack {exact[0]}{also}: {versions}. The test suite runs on these versions."
        return section
    best = min(keys.values(), default=None)
    nearest = [stack for stack, key in keys.items() if key == best]
    section.update(status=UNTESTED, stacks=nearest, differences={stack: differences[stack] for stack in nearest})
    section["message"] = (
        f"not a tested stack; nearest: {'; '.join(f'{s} ({_diff_text(differences[s])})' for s in nearest) or 'none'}. "
        "The shims' version ranges were evaluated on your installed versions and fill the gap, but this exact "
        "combination was never run by the test suite: the verdicts come from the ranges, not from a test on it "
        "(--probe checks the bugs live)."
    )
    return section


def _diff_text(diff: Dict[str, Dict[str, Optional[str]]]) -> str:
    return ", ".join(f"{name} {d['installed'] or 'not installed'} here, {d['tested']} tested" for name, d in diff.items())


def tested_stack(installed: Mapping[str, Optional[str]]) -> Dict[str, Any]:
    """The section for these installed versions; ``unknown`` when stacks.toml cannot be read (Python < 3.11)."""
    from .. import datafiles

    try:
        stacks = {name: dict(datafiles.pinned_versions(name), torch=datafiles.torch_version(name)) for name in datafiles.stacks()}
    except (RuntimeError, OSError, ValueError, KeyError) as exc:  # RuntimeError: no tomllib before Python 3.11
        section = empty()
        section.update(status=UNKNOWN, compared={name: installed.get(name) for name in COMPARED})
        section["message"] = f"unknown: the tested stacks could not be read ({exc})."
        return section
    return compare(installed, stacks)


def installed_versions(packages: List[Dict[str, Any]]) -> Dict[str, Optional[str]]:
    """The compared packages' versions: from the report's package rows, else from metadata."""
    from ..versions import installed_version

    rows = {row["name"]: row.get("version") for row in packages}
    return {name: rows[name] if name in rows else installed_version(name) for name in COMPARED}
