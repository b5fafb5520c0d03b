"""Advisories: known-bad version combinations, kept as data (most of them no shim can fix).

The data live in ``ftshims/data/advisories.json`` (its ``about`` list documents
every field). Each advisory names the installed versions it applies to
(``when``: distribution -> PEP 440 specifier, all must hold), what the user
sees, what to do, upstream references, and how the claim was verified. A few
advisories cannot be seen in version numbers at all (a flash-attn build made
for another torch); those carry a ``check`` and are triggered by the doctor's
live check instead.

API for the doctor::

    from ftshims import advisories
    advisories.packages()                      # distributions to read versions of
    advisories.matching(versions)              # versions: {name: version or None}
    advisories.matching(versions, checks={"flash_attn_import": "abi mismatch"})
    advisories.matching(versions, model_type="llama")   # model known: other families drop out

``versions`` is what ``importlib.metadata`` gives (``None`` for a package that
is not installed); names are compared PEP 503-normalised, so ``flash_attn``,
``Flash-Attn`` and ``flash-attn`` are the same key. ``matching(None)`` reads the
installed versions itself.

Matching rules (tested in tests/doctor/test_advisories.py):

* every ``when`` entry must hold; a distribution that is not installed never
  holds unless the advisory lists it in ``absent_matches``;
* versions compare with ``prereleases=True`` and local labels ignored
  (:func:`ftshims.versions.in_range`): ``4.57.0.dev0`` is inside ``>=4.50``,
  ``2.13.0+cpu`` inside ``>=2.13``, and ``2.6.0a0+git123`` is *not* inside
  ``<2.6`` (PEP 440 keeps pre-releases of the bound out of an exclusive upper
  bound);
* a version that is not PEP 440 (``"unknown"``) never matches;
* an advisory with a ``check`` matches only when ``checks[name]`` is one of its
  statuses (and its ``when``, if any, holds).

``fixed_by_shims`` names shims that remove the problem once ``ftshims.apply()``
ran (the doctor can say "fixed by ftshims" when such a shim is applied);
``related_shims`` only help or warn.

Why JSON and not TOML like the other data files: the doctor runs on the user's
Python (3.9+), and ``tomllib`` exists only from 3.11. JSON needs nothing.

Importing this module imports only the standard library and ``packaging``.

Size: the loader validates every field of the JSON with a message that names the advisory and the key
(the data are edited by hand); validation, matching and the API above belong to one small data type.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .versions import in_range, installed_version

from .datafiles import ADVISORIES_FILE as DATA  # noqa: E402

SEVERITIES = ("error", "warning", "info")
SEVERITY_RANK = {name: rank for rank, name in enumerate(SEVERITIES)}

# Live checks an advisory may name, with the statuses each can report.
# flash_attn_import: ftshims/doctor/flashattn.py (the "status" of its result).
CHECKS: Dict[str, Tuple[str, ...]] = {
    "flash_attn_import": (
        "ok",
        "not installed",
        "abi mismatch",
        "missing library",
        "import error",
        "timeout",
        "crashed",
        "check failed",
        "skipped",
    ),
}

_ID = re.compile(r"^[a-z][a-z0-9_]*$")
_URL = re.compile(r"^https?://[^\s/]+\.[^\s/]+/\S*$")
_VERIFIED = re.compile(r"^(src|run): \S")
_REQUIRED = ("id", "title", "severity", "when", "symptom", "remedy", "refs", "verified")
_OPTIONAL = ("check", "condition", "model_types", "fixed_in", "related_shims", "fixed_by_shims", "absent_matches")


class AdvisoryDataError(ValueError):
    """The advisory data file is malformed; the message names the advisory and the field."""


def normalize(name: str) -> str:
    """PEP 503 name normalisation: ``Flash_Attn`` -> ``flash-attn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Check:
    name: str
    status: Tuple[str, ...]


@dataclass(frozen=True)
class Advisory:
    id: str
    title: str
    severity: str
    when: Mapping[str, str]
    symptom: str
    remedy: str
    refs: Tuple[str, ...]
    verified: Tuple[str, ...]
    check: Optional[Check] = None
    condition: Optional[str] = None
    model_types: Tuple[str, ...] = ()
    fixed_in: Mapping[str, str] = field(default_factory=dict)
    related_shims: Tuple[str, ...] = ()
    fixed_by_shims: Tuple[str, ...] = ()
    absent_matches: Tuple[str, ...] = ()

    def matches(
        self,
        versions: Mapping[str, Optional[str]],
        checks: Optional[Mapping[str, Optional[str]]] = None,
        model_type: Optional[str] = None,
    ) -> bool:
        """True when this advisory applies to ``versions`` (and, for a check advisory, to ``checks``).

        ``model_type`` (a transformers ``config.model_type``), when given, rules
        out advisories that concern other model families; None means unknown.
        """
        if model_type is not None and self.model_types and model_type not in self.model_types:
            return False
        if self.check is not None:
            status = _lookup(checks or {}, self.check.name, normalized=False)
            if status not in self.check.status:
                return False
        elif not self.when:
            return False  # the loader refuses this; kept for hand-built advisories
        return all(self._holds(name, specifier, versions) for name, specifier in self.when.items())

    def _holds(self, name: str, specifier: str, versions: Mapping[str, Optional[str]]) -> bool:
        version = _lookup(versions, name)
        if version is None:
            return name in self.absent_matches
        return in_range(version, specifier)

    def evidence(
        self, versions: Mapping[str, Optional[str]], checks: Optional[Mapping[str, Optional[str]]] = None
    ) -> List[str]:
        """One line per condition that made the advisory match, e.g. ``"transformers 4.47.0 in >=4.47.0,<4.47.1"``."""
        lines = []
        for name, specifier in self.when.items():
            version = _lookup(versions, name)
            lines.append(f"{name} not installed" if version is None else f"{name} {version} in {specifier}")
        if self.check is not None:
            lines.append(f"check {self.check.name}: {_lookup(checks or {}, self.check.name, normalized=False)}")
        return lines

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form, as in the data file (for the doctor's --json output)."""
        out: Dict[str, Any] = {
            "id": self.id,
            "title": self.title,
            "severity": self.severity,
            "when": dict(self.when),
            "symptom": self.symptom,
            "remedy": self.remedy,
            "refs": list(self.refs),
            "verified": list(self.verified),
        }
        if self.check is not None:
            out["check"] = {"name": self.check.name, "status": list(self.check.status)}
        if self.condition is not None:
            out["condition"] = self.condition
        if self.model_types:
            out["model_types"] = list(self.model_types)
        if self.fixed_in:
            out["fixed_in"] = dict(self.fixed_in)
        if self.related_shims:
            out["related_shims"] = list(self.related_shims)
        if self.fixed_by_shims:
            out["fixed_by_shims"] = list(self.fixed_by_shims)
        if self.absent_matches:
            out["absent_matches"] = list(self.absent_matches)
        return out


def _lookup(mapping: Mapping[str, Optional[str]], name: str, normalized: bool = True) -> Optional[str]:
    if name in mapping:
        return mapping[name]
    if not normalized:
        return None
    wanted = normalize(name)
    for key, value in mapping.items():
        if normalize(key) == wanted:
            return value
    return None


# --- loading and validation -------------------------------------------------------------------------


def _fail(where: str, message: str) -> None:
    raise AdvisoryDataError(f"{where}: {message}")


def _text(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        _fail(where, f"{key!r} must be a non-empty string")
    return value


def _strings(where: str, key: str, value: Any, allow_empty: bool = False) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item.strip() for item in value):
        _fail(where, f"{key!r} must be a list of non-empty strings")
    if not value and not allow_empty:
        _fail(where, f"{key!r} must not be empty")
    if len(set(value)) != len(value):
        _fail(where, f"{key!r} has duplicates")
    return tuple(value)


def _specifier(where: str, name: str, specifier: Any) -> str:
    if not isinstance(specifier, str) or not specifier.strip():
        _fail(where, f"when[{name!r}] must be a non-empty PEP 440 specifier string")
    try:
        parsed = SpecifierSet(specifier, prereleases=True)
    except InvalidSpecifier:
        parsed = None
    # packaging < 22 accepts non-PEP 440 "legacy" specifiers (LegacySpecifier): refuse them on every release.
    if parsed is None or not all(isinstance(item, Specifier) for item in parsed):
        _fail(where, f"when[{name!r}] = {specifier!r} is not a PEP 440 specifier")
    return specifier


def _distribution(where: str, key: str, name: Any) -> str:
    if not isinstance(name, str) or normalize(name) != name:
        _fail(where, f"{key} names a distribution as {name!r}; write it PEP 503-normalised ({normalize(str(name))!r})")
    return name


def _advisory(raw: Any, index: int) -> Advisory:
    where = f"advisories[{index}]"
    if not isinstance(raw, dict):
        _fail(where, "must be an object")
    if isinstance(raw.get("id"), str):
        where = f"advisory {raw['id']!r}"
    unknown = sorted(set(raw) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        _fail(where, f"unknown field(s) {unknown}")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        _fail(where, f"missing field(s) {missing}")

    advisory_id = _text(where, "id", raw["id"])
    if not _ID.match(advisory_id):
        _fail(where, "id must be snake_case ([a-z][a-z0-9_]*)")
    severity = raw["severity"]
    if severity not in SEVERITIES:
        _fail(where, f"severity {severity!r} is not one of {SEVERITIES}")

    when = raw["when"]
    if not isinstance(when, dict):
        _fail(where, "'when' must be an object {distribution: specifier}")
    when = {_distribution(where, "when", name): _specifier(where, name, spec) for name, spec in when.items()}

    check = None
    if "check" in raw:
        spec = raw["check"]
        if not isinstance(spec, dict) or set(spec) != {"name", "status"}:
            _fail(where, "'check' must be an object with exactly 'name' and 'status'")
        if spec["name"] not in CHECKS:
            _fail(where, f"unknown check {spec['name']!r}; known: {sorted(CHECKS)}")
        statuses = _strings(where, "check.status", spec["status"])
        bad = [status for status in statuses if status not in CHECKS[spec["name"]]]
        if bad:
            _fail(where, f"check {spec['name']!r} never reports {bad}; it reports {list(CHECKS[spec['name']])}")
        check = Check(spec["name"], statuses)
    if not when and check is None:
        _fail(where, "an advisory needs a non-empty 'when' or a 'check'")

    refs = _strings(where, "refs", raw["refs"])
    for ref in refs:
        if not _URL.match(ref):
            _fail(where, f"ref {ref!r} is not an http(s) URL")
    verified = _strings(where, "verified", raw["verified"])
    for entry in verified:
        if not _VERIFIED.match(entry):
            _fail(where, f"verified entry {entry[:40]!r}... must start with 'src: ' or 'run: '")

    fixed_in: Dict[str, str] = {}
    if "fixed_in" in raw:
        if not isinstance(raw["fixed_in"], dict) or not raw["fixed_in"]:
            _fail(where, "'fixed_in' must be a non-empty object {distribution: version}")
        for name, version in raw["fixed_in"].items():
            _distribution(where, "fixed_in", name)
            try:
                Version(version)
            except (InvalidVersion, TypeError):
                _fail(where, f"fixed_in[{name!r}] = {version!r} is not a PEP 440 version")
            if name in when and in_range(version, when[name]):
                _fail(where, f"fixed_in[{name!r}] = {version} lies inside when[{name!r}] = {when[name]!r}")
            fixed_in[name] = version

    absent = _strings(where, "absent_matches", raw.get("absent_matches", []), allow_empty=True)
    for name in absent:
        if name not in when:
            _fail(where, f"absent_matches names {name!r}, which is not in 'when'")

    return Advisory(
        id=advisory_id,
        title=_text(where, "title", raw["title"]),
        severity=severity,
        when=when,
        symptom=_text(where, "symptom", raw["symptom"]),
        remedy=_text(where, "remedy", raw["remedy"]),
        refs=refs,
        verified=verified,
        check=check,
        condition=_text(where, "condition", raw["condition"]) if "condition" in raw else None,
        model_types=_strings(where, "model_types", raw.get("model_types", []), allow_empty=True),
        fixed_in=fixed_in,
        related_shims=_strings(where, "related_shims", raw.get("related_shims", []), allow_empty=True),
        fixed_by_shims=_strings(where, "fixed_by_shims", raw.get("fixed_by_shims", []), allow_empty=True),
        absent_matches=absent,
    )


def parse(data: Any) -> List[Advisory]:
    """Validate the decoded data file and return its advisories; raises :class:`AdvisoryDataError`."""
    if not isinstance(data, dict):
        _fail("advisories data", "must be an object")
    if data.get("schema") != 1:
        _fail("advisories data", f"unsupported schema {data.get('schema')!r} (expected 1)")
    unknown = sorted(set(data) - {"schema", "about", "advisories"})
    if unknown:
        _fail("advisories data", f"unknown top-level field(s) {unknown}")
    raw = data.get("advisories")
    if not isinstance(raw, list):
        _fail("advisories data", "'advisories' must be a list")
    advisories = [_advisory(item, index) for index, item in enumerate(raw)]
    seen = set()
    for advisory in advisories:
        if advisory.id in seen:
            _fail(f"advisory {advisory.id!r}", "duplicate id")
        seen.add(advisory.id)
    return advisories


_CACHE: Optional[List[Advisory]] = None


def load(path=None) -> List[Advisory]:
    """All advisories, validated (cached for the packaged file). Raises :class:`AdvisoryDataError`."""
    global _CACHE
    if path is None and _CACHE is not None:
        return list(_CACHE)
    source = Path(path) if path is not None else DATA
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdvisoryDataError(f"{source}: cannot read advisories: {exc}") from exc
    advisories = parse(data)
    if path is None:
        _CACHE = advisories
    return list(advisories)


def get(advisory_id: str) -> Advisory:
    for advisory in load():
        if advisory.id == advisory_id:
            return advisory
    raise KeyError(advisory_id)


def packages(advisories: Optional[Iterable[Advisory]] = None) -> Tuple[str, ...]:
    """Every distribution named in any advisory's ``when``, sorted: the versions the doctor must read."""
    names = set()
    for advisory in load() if advisories is None else advisories:
        names.update(advisory.when)
    return tuple(sorted(names))


def matching(
    versions: Optional[Mapping[str, Optional[str]]] = None,
    checks: Optional[Mapping[str, Optional[str]]] = None,
    advisories: Optional[Iterable[Advisory]] = None,
    model_type: Optional[str] = None,
) -> List[Advisory]:
    """The advisories that apply, most severe first (then in data-file order).

    versions: {distribution: version or None}, e.g. from ``importlib.metadata``;
              None reads the installed versions of :func:`packages`.
    checks:   results of the doctor's live checks, {check name: status},
              e.g. ``{"flash_attn_import": "abi mismatch"}``.
    model_type: the ``model_type`` of the model being trained, when known
              (``--model CONFIG``): advisories for other families are left out.
    """
    pool = load() if advisories is None else list(advisories)
    if versions is None:
        versions = {name: installed_version(name) for name in packages(pool)}
    found = [advisory for advisory in pool if advisory.matches(versions, checks, model_type)]
    return sorted(found, key=lambda advisory: SEVERITY_RANK[advisory.severity])
