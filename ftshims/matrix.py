"""Generate and check COMPAT_MATRIX.md from the registry and the recorded evidence.

    python -m ftshims.matrix                      # rewrite COMPAT_MATRIX.md
    python -m ftshims.matrix --check              # exit 1 if COMPAT_MATRIX.md is stale
    python -m ftshims.matrix --evidence DIR --record   # merge a matrix run into data/verified.json, rewrite
    python -m ftshims.matrix --evidence DIR --check    # also: this run's evidence equals what is recorded

The evidence of a run is one JSON file per stack, written by the test suite
(``FTSHIMS_EVIDENCE_OUT``) from tests that passed, after their assertions: for
every shim and scenario, the test id, whether the stack was inside the shim's
range, whether the shim was applied, whether the bug showed without the shim
and whether it was gone with it, and what was measured each way; the file
carries the installed versions, read from package metadata. ``data/verified.json``
holds exactly what the evidence of the whole matrix supports (one verdict of
:mod:`ftshims.verdicts` per shim and stack); ``--record`` rewrites it from a
complete run, ``--check --evidence`` fails when a run supports anything else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from . import datafiles, registry, verdicts
from .verdicts import ABSENT, MISMATCH, NOT_RUN, SAME_RESULTS

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "COMPAT_MATRIX.md"

SYMBOL = {
    verdicts.FIXED: "✅ fixed",
    verdicts.FIXED_ON_STAND_IN: "🧪 fixed on a stand-in",
    verdicts.GUARDED: "🛡️ guarded",
    verdicts.WARNED: "⚠️ warned",
    ABSENT: "➖ absent",
    SAME_RESULTS: "⚡ same results",
    MISMATCH: "❌ mismatch",
    NOT_RUN: "· not run",
}


def _consistent(scenario: dict) -> bool:
    """One scenario agrees with the registry: applied exactly in range, the bug exactly where
    expected without the shim, never with it."""
    in_range = scenario["affected"]
    expected = in_range and scenario.get("expect_bug", True)
    applied = scenario.get("status") in ("applied", "deferred")
    return (
        scenario["bug_without_shim"] == expected
        and not scenario["bug_with_shim"]
        and applied == in_range
    )


def verdict(scenarios: Dict[str, dict], spec) -> str:
    """One verdict (:mod:`ftshims.verdicts`) for a shim on a stack, from its recorded scenarios.

    Every scenario must agree with the registry (:func:`_consistent`), else
    ``mismatch``. In range, at least one scenario must reproduce the bug
    without the shim (a range that selects a stack where the bug is absent is
    a mismatch too); the verdict is then the one the shim's declared effect
    earns: fixed, fixed on a stand-in, guarded or warned. For a speed shim the
    "bug" of a scenario is a difference from the unpatched run.
    """
    if not scenarios:
        return NOT_RUN
    if not all(_consistent(s) for s in scenarios.values()):
        return MISMATCH
    in_range = {s["affected"] for s in scenarios.values()}
    if spec.kind == "speed":
        if any(s["bug_without_shim"] for s in scenarios.values()):
            return MISMATCH
        return SAME_RESULTS if True in in_range else ABSENT
    if True not in in_range:
        return ABSENT
    if not any(s["affected"] and s["bug_without_shim"] for s in scenarios.values()):
        return MISMATCH  # in range, yet the bug did not reproduce here
    return verdicts.delivered(spec)


def _check_versions(run: dict, path: Path) -> List[str]:
    """Problems with a run's versions: they must be its stack's pins (read from the installed metadata)."""
    stack = run.get("stack")
    if stack not in datafiles.stacks():
        return [f"{path.name}: stack {stack!r} is not in stacks.toml"]
    problems = []
    for name, pinned in datafiles.pinned_versions(stack).items():
        got = run.get("versions", {}).get(name)
        if got is not None and got != pinned:
            problems.append(f"{path.name}: {name} {got} installed, stack {stack} pins {pinned}")
    return problems


def verified_from_evidence(directory: Path) -> Tuple[dict, List[str]]:
    """The ``verified.json`` content a matrix run's evidence supports, and the problems found on the way."""
    shims = registry.shims()
    fresh: dict = {"stacks": {}, "shims": {}}
    problems: List[str] = []
    for path in sorted(Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        problems += _check_versions(run, path)
        fresh["stacks"][run["stack"]] = {"versions": run["versions"]}
        for shim_id, scenarios in run["results"].items():
            if shim_id not in shims:
                problems.append(f"{path.name}: evidence for unknown shim {shim_id}")
                continue
            fresh["shims"].setdefault(shim_id, {})[run["stack"]] = {
                "verdict": verdict(scenarios, shims[shim_id].spec),
                "scenarios": len(scenarios),
                "reproduced": sum(1 for s in scenarios.values() if s["affected"] and s["bug_without_shim"]),
                "tests": sorted({s.get("test", "?") for s in scenarios.values()}),
            }
    return fresh, problems


def load_verified() -> dict:
    return datafiles.verified()


def record(directory: Path) -> dict:
    """Replace verified.json by what this run's evidence supports (every stack must be in the run)."""
    fresh, problems = verified_from_evidence(directory)
    missing = [s for s in datafiles.evidence_stacks() if s not in fresh["stacks"]]
    if missing:
        problems.append(f"no evidence for stack(s) {', '.join(missing)}")
    if problems:
        raise SystemExit("matrix: not recorded:\n  " + "\n  ".join(problems))
    datafiles.VERIFIED_FILE.write_text(json.dumps(fresh, indent=2, sort_keys=True) + "\n")
    return fresh


def compare_evidence(directory: Path, require_all: bool = True) -> List[str]:
    """Differences between what a run's evidence supports and the committed verified.json (empty when equal)."""
    fresh, problems = verified_from_evidence(directory)
    committed = load_verified()
    ran = set(fresh["stacks"])
    if require_all:
        missing = [s for s in datafiles.evidence_stacks() if s not in ran]
        if missing:
            problems.append(f"no evidence for stack(s) {', '.join(missing)}")
    for shim_id, per_stack in fresh["shims"].items():
        for stack, entry in per_stack.items():
            if entry["verdict"] == MISMATCH:
                problems.append(f"{shim_id} on {stack}: evidence contradicts the registry")
            recorded = committed["shims"].get(shim_id, {}).get(stack)
            if recorded != entry:
                problems.append(f"{shim_id} on {stack}: this run supports {entry}, verified.json says {recorded}")
    for shim_id, per_stack in committed["shims"].items():
        for stack in per_stack:
            if stack in ran and stack not in fresh["shims"].get(shim_id, {}):
                problems.append(f"{shim_id} on {stack}: recorded, but this run produced no evidence")
    for stack in ran:
        if committed["stacks"].get(stack) != fresh["stacks"][stack]:
            problems.append(f"stack {stack}: versions differ from verified.json")
    for shim_id in registry.ids():
        if shim_id not in committed["shims"] and shim_id not in fresh["shims"]:
            problems.append(f"{shim_id}: no evidence recorded on any stack")
    return problems


# ---------------------------------------------------------------------------


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _ranges(spec) -> str:
    return "<br>".join(f"{name} `{spec_}`" for name, spec_ in spec.requires.items())


def _fixed(spec) -> str:
    if spec.kind == "speed":
        return "n/a (speed)"
    fixed = "<br>".join(f"{name} {version}" for name, version in spec.fixed_in.items())
    if fixed:
        return fixed
    report = verdicts.upstream_report(spec)
    return f"unfixed upstream ([reproduction]({report}))" if report else "unfixed upstream"


def _refs(spec) -> str:
    out = []
    for url in spec.refs:
        parts = url.rstrip("/").split("/")
        label = f"{parts[-3]}#{parts[-1]}" if len(parts) >= 3 and parts[-1].isdigit() else url
        out.append(f"[{label}]({url})")
    return ", ".join(out)


def _delivers(spec) -> str:
    text = verdicts.delivered(spec)
    return f"{text} ({spec.stand_in}; GPU evidence pending)" if spec.stand_in else text


def render() -> str:
    shims = registry.shims()
    all_stacks = datafiles.stacks()
    verified = load_verified()
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by `python -m ftshims.matrix` from the shim registry, ftshims/data/stacks.toml,",
        "     ftshims/data/verified.json, ftshims/data/claims.toml and ftshims/data/leads.toml. Do not edit by hand; a test",
        "     fails when it is stale. -->",
        "",
        "## Is my stack affected?",
        "",
        "Run `python -m ftshims.doctor`: it reads your installed versions (without importing the packages) and lists",
        "the known bugs your stack has and what ftshims does about each. By package version:",
        "",
        "| package | versions | bug | ftshims | fixed upstream in |",
        "|---|---|---|---|---|",
    ]
    rows = []
    for shim in shims.values():
        spec = shim.spec
        if spec.kind == "speed":
            continue
        package, specifier = next(iter(spec.requires.items()))
        extra = "".join(f"<br>with {name} `{r}`" for name, r in list(spec.requires.items())[1:])
        rows.append((package, spec.id, f"| {package} | `{specifier}`{extra} | {_md(spec.title)} | "
                     f"{verdicts.delivered(spec)} (`{spec.id}`) | {_fixed(spec)} |"))
    lines += [row for _, _, row in sorted(rows)]
    lines += [
        "",
        "What the verdicts mean: **fixed** — the bug reproduced on that real stack and is gone with the shim;",
        "**fixed on a stand-in** — reproduced with a named CPU stand-in for a GPU kernel, GPU evidence pending;",
        "**guarded** — a crash or silent corruption becomes a clear error; **warned** — the shim only warns (never",
        "counted as a fix); **absent** — the bug does not exist there; **same results** — a `speed` shim matches",
        "the unpatched numbers; **not run** — no test of that shim can run on that stack.",
        "",
        "## Shims",
        "",
        "`fix` shims are applied by `ftshims.apply()`; `opt-in` shims (their fix changes what a run trains) and",
        "`speed` shims only when asked for (`include=[...]`). Ranges are PEP 440 specifiers evaluated with",
        "pre-releases included.",
        "",
        "`since` is the ftshims release that added the shim, or last changed what it computes",
        "(`ftshims.apply(release=...)` leaves out newer ones; CHANGELOG.md says which change training numerics).",
        "",
        "| shim | kind | since | where the bug exists, ftshims | affected versions | fixed in | symptom | upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shim in shims.values():
        spec = shim.spec
        lines.append(
            f"| `{spec.id}` | {spec.kind} | {spec.since} | {_md(_delivers(spec))} | {_ranges(spec)} | {_fixed(spec)} | "
            f"{_md(spec.symptom)} | {_refs(spec)} |"
        )
    lines += ["", "## Verified on pinned stacks", ""]
    lines += [
        "Every stack runs the test suite; only tests that passed leave evidence. In range, a shim's test reproduces",
        "the bug without the shim and shows it gone with it; out of range, it shows the bug absent and the shim not",
        "applied. Cells give the verdict and `reproduced/scenarios`.",
        "",
    ]
    names = datafiles.evidence_stacks()
    lines.append("| shim | " + " | ".join(f"`{n}`" for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for shim_id in shims:
        cells = []
        for stack in names:
            entry = verified["shims"].get(shim_id, {}).get(stack)
            cells.append(f"{SYMBOL[entry['verdict']]} {entry['reproduced']}/{entry['scenarios']}" if entry else SYMBOL[NOT_RUN])
        lines.append(f"| `{shim_id}` | " + " | ".join(cells) + " |")
    lines += ["", "## Stacks", "", "| stack | torch | transformers | peft | trl | accelerate | datasets | note |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for stack, info in all_stacks.items():
        pins = datafiles.pinned_versions(stack)
        recorded = verified["stacks"].get(stack, {}).get("versions", {})
        torch_version = recorded.get("torch") or "?"
        cols = [pins.get(k, recorded.get(k) or "?") for k in ("transformers", "peft", "trl", "accelerate", "datasets")]
        lines.append(f"| `{stack}` | {torch_version} | " + " | ".join(cols) + f" | {_md(info.get('note', ''))} |")
    lines += ["", "## Shim details", ""]
    for shim in shims.values():
        spec = shim.spec
        lines += [f"### `{spec.id}` — {spec.title}", "", _md(spec.why), ""]
        lines.append("Targets: " + ", ".join(
            f"`{t.dotted}`" + (f" ({t.package} `{t.when}`)" if t.when else "") for t in spec.targets))
        if spec.options:
            lines.append("")
            lines.append("Options: " + ", ".join(f"`{k}` (default `{v!r}`)" for k, v in spec.options.items()))
        if spec.backports:
            lines += ["", "Backports: " + ", ".join(spec.backports) + ". Follow-ups: " + (
                "; ".join(_md(f.statement) for f in spec.follow_ups) or _md(spec.follow_ups_checked))]
        if spec.unpinned:
            lines += ["", "No pinned stack: " + _md(spec.unpinned)]
        lines += [""]
    lines += ["## Popular claims that turned out false", ""]
    for claim in datafiles.claims():
        lines += [f"- **Claim:** {_md(claim['claim'])}", f"  **What is true:** {_md(claim['truth'])}"]
    lines += _leads_section()
    return "\n".join(lines).rstrip() + "\n"


LEAD_OUTCOME_TEXT = {"entry": "entry", "refuted": "refuted", "out_of_reach": "out of reach"}


def _leads_section() -> List[str]:
    """The ledger of research leads (ftshims/data/leads.toml): every lead of a dossier and what became of it."""
    rows = datafiles.leads()
    counts = {outcome: sum(1 for row in rows if row["outcome"] == outcome) for outcome in datafiles.LEAD_OUTCOMES}
    lines = [
        "",
        "## Leads",
        "",
        "Every lead of the research dossiers (shared/research/), by its dossier id, and its outcome: the shims and",
        "advisories that cover it (**entry**), the claim that refutes it (**refuted**), or why it is **out of reach**.",
        f"{len(rows)} leads: " + ", ".join(f"{counts[o]} {LEAD_OUTCOME_TEXT[o]}" for o in datafiles.LEAD_OUTCOMES) + ".",
        "",
        "| dossier | lead | outcome | covered by / why | note | versions read |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["outcome"] == "out_of_reach":
            covered = _md(row["reason"])
        else:
            covered = ", ".join(f"`{name}`" for name in list(row.get("entries", [])) + list(row.get("claims", [])))
        lines.append(
            f"| {_md(row['dossier'])} #{row['number']} | `{row['id']}` | {LEAD_OUTCOME_TEXT[row['outcome']]} | "
            f"{covered} | {_md(row.get('note', ''))} | {_md(row.get('versions', ''))} |"
        )
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftshims.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when COMPAT_MATRIX.md (or the evidence) disagrees")
    parser.add_argument("--evidence", type=Path, help="directory of per-stack evidence JSON written by a test run")
    parser.add_argument("--record", action="store_true", help="rewrite ftshims/data/verified.json from --evidence (a complete run)")
    parser.add_argument("--partial", action="store_true", help="with --evidence --check: do not require every stack")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)
    if args.record:
        if not args.evidence:
            parser.error("--record needs --evidence DIR")
        record(args.evidence)
    text = render()
    if args.check:
        problems = []
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            problems.append(f"{args.output.name} is stale: run `python -m ftshims.matrix` and commit it")
        if args.evidence:
            problems += compare_evidence(args.evidence, require_all=not args.partial)
        for problem in problems:
            print(f"matrix: {problem}", file=sys.stderr)
        if not problems:
            print(f"matrix: {args.output.name} is current" + (" and matches the evidence" if args.evidence else ""))
        return 1 if problems else 0
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
