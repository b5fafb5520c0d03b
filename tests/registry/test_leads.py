"""The ledger of research leads (ftshims/data/leads.toml): every lead has an outcome, and every name it gives exists.

* Always: each row's outcome is one of entry / refuted / out_of_reach, with what that outcome needs (entries,
  claims, a reason); every shim, advisory and claim a row names exists in the catalogue.
* When the research dossiers are present (shared/research/ beside the clone, as on the CI machine and in the
  shared work tree, or shared/ inside it on the device machine): every lead heading of each dossier the ledger
  cites ("## N. `name`" or "### N. `name`") has exactly one row with that id and number, and the ledger names no
  lead the dossier does not have. Without the dossiers that part is skipped, with the reason.
* The checks can fail: they are run on fabricated ledgers with each kind of defect.

Fast and offline: reads TOML, JSON and Markdown only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import pytest

from ftshims import advisories, datafiles, matrix
from ftshims.shims import SHIM_IDS

ROOT = Path(__file__).resolve().parents[2]
RESEARCH_CANDIDATES = (ROOT.parent / "shared" / "research", ROOT / "shared" / "research")
HEADING = re.compile(r"^#{2,3} (\d+)\. `([a-z0-9_]+)`", re.MULTILINE)
REQUIRED = ("id", "dossier", "number", "outcome")
KNOWN_KEYS = set(REQUIRED) | {"entries", "claims", "reason", "note", "versions"}


def research_dir() -> Optional[Path]:
    for candidate in RESEARCH_CANDIDATES:
        if candidate.is_dir():
            return candidate
    return None


def claim_ids() -> set:
    return {claim["id"] for claim in datafiles.claims() if "id" in claim}


def row_problems(rows: Iterable[dict], shims: Iterable[str], advisory_ids: Iterable[str], claims: Iterable[str]) -> List[str]:
    """What is wrong with ledger rows, independent of the dossiers: one message per defect."""
    shims, advisory_ids, claims = set(shims), set(advisory_ids), set(claims)
    problems = []
    seen = set()
    for index, row in enumerate(rows):
        where = f"lead {row.get('id', index)!r}"
        missing = [key for key in REQUIRED if key not in row]
        if missing:
            problems.append(f"{where}: missing {missing}")
            continue
        unknown = sorted(set(row) - KNOWN_KEYS)
        if unknown:
            problems.append(f"{where}: unknown field(s) {unknown}")
        key = (row["dossier"], row["id"])
        if key in seen:
            problems.append(f"{where}: duplicate row for {row['dossier']}")
        seen.add(key)
        if not isinstance(row["number"], int) or row["number"] < 1:
            problems.append(f"{where}: number must be a positive integer")
        outcome = row["outcome"]
        if outcome not in datafiles.LEAD_OUTCOMES:
            problems.append(f"{where}: outcome {outcome!r} is not one of {datafiles.LEAD_OUTCOMES}")
        entries = row.get("entries", [])
        named_claims = row.get("claims", [])
        if outcome == "entry" and not entries:
            problems.append(f"{where}: outcome entry names no shim or advisory")
        if outcome == "refuted" and not named_claims:
            problems.append(f"{where}: outcome refuted names no claim")
        if outcome == "out_of_reach":
            if not str(row.get("reason", "")).strip():
                problems.append(f"{where}: outcome out_of_reach gives no reason")
            if entries:
                problems.append(f"{where}: out of reach, yet it names entries {entries}")
        for name in entries:
            if name not in shims and name not in advisory_ids:
                problems.append(f"{where}: names {name!r}, which is neither a shim nor an advisory")
        for name in named_claims:
            if name not in claims:
                problems.append(f"{where}: names claim {name!r}, which claims.toml does not have")
    return problems


def dossier_leads(path: Path) -> Dict[str, int]:
    """{lead id: number} from a dossier's numbered headings."""
    found: Dict[str, int] = {}
    for number, name in HEADING.findall(path.read_text(encoding="utf-8")):
        found[name] = int(number)
    return found


def coverage_problems(rows: Iterable[dict], research: Path) -> Tuple[List[str], List[str]]:
    """(problems, dossiers read): every heading of each cited dossier has its row, and every row its heading."""
    rows = list(rows)
    problems, read = [], []
    for dossier in sorted({row["dossier"] for row in rows}):
        path = research / dossier
        if not path.is_file():
            problems.append(f"{dossier}: cited by the ledger but not found under {research}")
            continue
        read.append(dossier)
        headings = dossier_leads(path)
        ledger = {row["id"]: row["number"] for row in rows if row["dossier"] == dossier}
        for name, number in headings.items():
            if name not in ledger:
                problems.append(f"{dossier} #{number} `{name}` has no ledger row")
            elif ledger[name] != number:
                problems.append(f"{dossier} `{name}`: ledger number {ledger[name]}, dossier {number}")
        for name in ledger:
            if name not in headings:
                problems.append(f"{dossier}: ledger row `{name}` is not a lead heading of the dossier")
    return problems, read


# --- the shipped ledger ----------------------------------------------------------------------------------


def test_ledger_loads_and_is_not_empty():
    rows = datafiles.leads()
    assert len(rows) >= 28, len(rows)  # the wave-3 dossiers: 13 + 15 leads


def test_every_row_is_well_formed_and_every_name_exists():
    problems = row_problems(datafiles.leads(), SHIM_IDS, [a.id for a in advisories.load()], claim_ids())
    assert not problems, "\n".join(problems)


def test_every_dossier_lead_has_a_row():
    research = research_dir()
    if research is None:
        pytest.skip(f"research dossiers not present (looked in {', '.join(str(p) for p in RESEARCH_CANDIDATES)})")
    problems, read = coverage_problems(datafiles.leads(), research)
    assert read, "no dossier cited by the ledger was read"
    assert not problems, "\n".join(problems)


def test_wave3_counts():
    """13 transformers leads and 15 TRL/PEFT/accelerate leads, numbered 1..N without gaps."""
    rows = datafiles.leads()
    for dossier, count in (("dossier-wave3/transformers.md", 13), ("dossier-wave3/trl-peft-accelerate.md", 15)):
        numbers = sorted(row["number"] for row in rows if row["dossier"] == dossier)
        assert numbers == list(range(1, count + 1)), (dossier, numbers)


def test_the_matrix_renders_every_lead():
    text = matrix.render()
    assert "## Leads" in text
    section = text.split("## Leads", 1)[1]
    for row in datafiles.leads():
        assert f"`{row['id']}`" in section, row["id"]


# --- the checks can fail ---------------------------------------------------------------------------------

GOOD = {"id": "a_lead", "dossier": "d.md", "number": 1, "outcome": "entry", "entries": ["shim_a"]}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"entries": ["no_such_shim"]}, "neither a shim nor an advisory"),
        ({"outcome": "fixed"}, "is not one of"),
        ({"outcome": "entry", "entries": []}, "names no shim or advisory"),
        ({"outcome": "refuted", "entries": [], "claims": []}, "names no claim"),
        ({"outcome": "refuted", "entries": [], "claims": ["no_such_claim"]}, "claims.toml does not have"),
        ({"outcome": "out_of_reach", "entries": [], "reason": " "}, "gives no reason"),
        ({"outcome": "out_of_reach", "reason": "needs vLLM"}, "yet it names entries"),
        ({"number": 0}, "positive integer"),
        ({"colour": "red"}, "unknown field"),
    ],
)
def test_row_check_fails_on_a_defect(change, message):
    row = {**GOOD, **change}
    problems = row_problems([row], ["shim_a"], ["advisory_a"], ["claim_a"])
    assert any(message in p for p in problems), problems


def test_row_check_passes_good_rows():
    rows = [
        GOOD,
        {**GOOD, "id": "b", "entries": ["advisory_a"]},
        {**GOOD, "id": "c", "outcome": "refuted", "entries": [], "claims": ["claim_a"]},
        {**GOOD, "id": "d", "outcome": "out_of_reach", "entries": [], "reason": "needs a GPU and vLLM"},
    ]
    assert row_problems(rows, ["shim_a"], ["advisory_a"], ["claim_a"]) == []


def test_coverage_check_fails_on_a_missing_or_unknown_lead(tmp_path):
    (tmp_path / "d.md").write_text("# D\n\n### 1. `a_lead`\ntext\n\n### 2. `b_lead`\n\n## Notes\n", encoding="utf-8")
    problems, read = coverage_problems([GOOD], tmp_path)
    assert read == ["d.md"]
    assert problems == ["d.md #2 `b_lead` has no ledger row"]
    problems, _ = coverage_problems([GOOD, {**GOOD, "id": "c_lead", "number": 3}], tmp_path)
    assert "d.md: ledger row `c_lead` is not a lead heading of the dossier" in problems
    problems, _ = coverage_problems([{**GOOD, "number": 2}], tmp_path)
    assert "d.md `a_lead`: ledger number 2, dossier 1" in problems
    problems, read = coverage_problems([{**GOOD, "dossier": "gone.md"}], tmp_path)
    assert read == [] and "not found" in problems[0]


def test_heading_parser_reads_both_dossier_styles(tmp_path):
    path = tmp_path / "x.md"
    path.write_text("## 1. `one` (unfixed)\n### 12. `twelve` ★\n## How this was checked\n| 3 | `three` |\n", encoding="utf-8")
    assert dossier_leads(path) == {"one": 1, "twelve": 12}
