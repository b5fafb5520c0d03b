"""One loader for ``ftshims/data``: the pinned stacks, the recorded evidence, the refuted claims,
and where the advisories live. The noxfile, the matrix, the canary, the doctor and the tools all
read the data through here. Importing this module imports nothing heavy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

DATA = Path(__file__).resolve().parent / "data"
STACKS_FILE = DATA / "stacks.toml"
VERIFIED_FILE = DATA / "verified.json"
CLAIMS_FILE = DATA / "claims.toml"
ADVISORIES_FILE = DATA / "advisories.json"


def load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise RuntimeError(f"reading {path.name} needs Python 3.11+ (tomllib)") from None
    return tomllib.loads(path.read_text(encoding="utf-8"))


def stacks() -> Dict[str, dict]:
    """``{name: {"pins": [...], "note": ..., "default"?: True, "session"?: ...}}`` in file order."""
    return load_toml(STACKS_FILE)["stacks"]


def default_stack() -> str:
    return next(name for name, info in stacks().items() if info.get("default"))


def matrix_stacks() -> List[str]:
    """The pinned-version matrix: every stack but the default one and those run by their own session."""
    return [name for name, info in stacks().items() if not info.get("default") and "session" not in info]


def evidence_stacks() -> List[str]:
    """Stacks whose test run records evidence for the matrix (all but those marked ``evidence = false``,
    e.g. the client frameworks' session, which tests ftshims inside other tools)."""
    return [name for name, info in stacks().items() if info.get("evidence", True)]


DEFAULT_TORCH = "2.13.0"  # the torch every stack runs on unless it names its own (``torch = "2.15.0"``)


def torch_version(stack: str) -> str:
    """The torch release a stack runs on (its ``torch`` key, else :data:`DEFAULT_TORCH`)."""
    return stacks()[stack].get("torch") or DEFAULT_TORCH


def pinned_versions(stack: str) -> Dict[str, str]:
    """``{distribution: version}`` of a stack's ``==`` pins."""
    return dict(pin.split("==", 1) for pin in stacks()[stack]["pins"] if "==" in pin)


def newest_pinned(distribution: str):
    """The newest version of ``distribution`` that a stack pins, or None when none pins it (flash-attn)."""
    from packaging.version import Version

    versions = {pins[distribution] for pins in (pinned_versions(name) for name in stacks()) if distribution in pins}
    return max(versions, key=Version) if versions else None


def verified() -> dict:
    """The recorded evidence (``{"stacks": ..., "shims": ...}``), empty when none is recorded."""
    if VERIFIED_FILE.exists():
        return json.loads(VERIFIED_FILE.read_text(encoding="utf-8"))
    return {"stacks": {}, "shims": {}}


def claims() -> List[dict]:
    return load_toml(CLAIMS_FILE)["claims"]


LEADS_FILE = DATA / "leads.toml"
LEAD_OUTCOMES = ("entry", "refuted", "out_of_reach")


def leads() -> List[dict]:
    """The ledger of research leads (``data/leads.toml``): one row per dossier lead with its outcome."""
    return load_toml(LEADS_FILE)["leads"]
