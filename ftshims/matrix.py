"""Generate and check COMPAT_MATRIX.md from the registry and the recorded evidence.

    python -m ftshims.matrix                      # rewrite COMPAT_MATRIX.md
    python -m ftshims.matrix --check              # exit 1 if COMPAT_MATRIX.md is stale
    python -m ftshims.matrix --evidence DIR --record   # merge a matrix run into data/verified.json, rewrite
    python -m ftshims.matrix --evidence DIR --check    # also: this run's evidence equals what is recorded
    python -m ftshims.matrix --canary             # drift canary, see ftshims.canary

The evidence of a run is one JSON file per stack, written by the test suite
(``FTSHIMS_EVIDENCE_OUT``): for every shim and scenario, whether the stack was
inside the shim's range, whether the bug showed without the shim and whether
it was gone with it. ``data/verified.json`` keeps the verdict per shim and
stack; COMPAT_MATRIX.md shows it. A claim in the matrix that the latest run
does not reproduce fails ``--check``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional

from . import registry

DATA = Path(__file__).parent / "data"
VERIFIED = DATA / "verified.json"
STACKS = DATA / "stacks.toml"
CLAIMS = DATA / "claims.toml"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "COMPAT_MATRIX.md"

FIXED = "fixed"  # bug reproduced without the shim, gone with it
ABSENT = "absent"  # outside the range: bug absent, shim not applied
EQUIVALENT = "equivalent"  # a speed shim: applied, same results as without it in every scenario
MISMATCH = "MISMATCH"  # evidence contradicts the registry (the tests fail too)

SYMBOL = {
    FIXED: "✅ reproduced, fixed",
    ABSENT: "➖ not affected",
    EQUIVALENT: "⚡ same results",
    MISMATCH: "❌ mismatch",
}


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise SystemExit("ftshims.matrix needs Python 3.11+ (tomllib)") from None
    return tomllib.loads(path.read_text())


def stacks() -> Dict[str, dict]:
    return _load_toml(STACKS)["stacks"]


def verdict(scenarios: Dict[str, dict], kind: str = "fix") -> str:
    """One verdict for a shim on a stack, from its recorded scenarios.

    For a speed shim the "bug" a scenario records is a difference from the
    unpatched run (results or gradients out of tolerance), so it must never show.
    """
    if not scenarios:
        return MISMATCH
    affected = {s["affected"] for s in scenarios.values()}
    if any(s["bug_with_shim"] for s in scenarios.values()):
        return MISMATCH
    if kind == "speed":
        if any(s["bug_without_shim"] for s in scenarios.values()):
            return MISMATCH
        return EQUIVALENT if affected == {True} else ABSENT if affected == {False} else MISMATCH
    if affected == {True}:
        return FIXED if any(s["bug_without_shim"] for s in scenarios.values()) else MISMATCH
    if affected == {False}:
        return ABSENT if not any(s["bug_without_shim"] for s in scenarios.values()) else MISMATCH
    # Scenario-specific ranges (e.g. a TRL-path scenario inside a peft-wide shim): both kinds may appear.
    reproduced = [s for s in scenarios.values() if s["affected"] and s["bug_without_shim"]]
    spurious = [s for s in scenarios.values() if not s["affected"] and s["bug_without_shim"]]
    return FIXED if reproduced and not spurious else MISMATCH


def verdicts_from_evidence(directory: Path) -> Dict[str, Dict[str, dict]]:
    """``{shim_id: {stack: {"verdict", "scenarios", "reproduced"}}}`` from a matrix run."""
    table: Dict[str, Dict[str, dict]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        run = json.loads(path.read_text())
        for shim_id, scenarios in run["results"].items():
            kind = registry.shims()[shim_id].spec.kind if shim_id in registry.shims() else "fix"
            table.setdefault(shim_id, {})[run["stack"]] = {
                "verdict": verdict(scenarios, kind),
                "scenarios": len(scenarios),
                "reproduced": sum(1 for s in scenarios.values() if s["bug_without_shim"]),
            }
    return table


def stack_versions_from_evidence(directory: Path) -> Dict[str, dict]:
    return {json.loads(p.read_text())["stack"]: json.loads(p.read_text())["versions"] for p in sorted(Path(directory).glob("*.json"))}


def load_verified() -> dict:
    if VERIFIED.exists():
        return json.loads(VERIFIED.read_text())
    return {"stacks": {}, "shims": {}}


def record(directory: Path) -> dict:
    """Merge a matrix run into verified.json (stacks in the run replace their earlier verdicts)."""
    verified = load_verified()
    for stack, versions in stack_versions_from_evidence(directory).items():
        verified["stacks"][stack] = {"versions": versions}
    for shim_id, per_stack in verdicts_from_evidence(directory).items():
        verified["shims"].setdefault(shim_id, {}).update(per_stack)
    VERIFIED.write_text(json.dumps(verified, indent=2, sort_keys=True) + "\n")
    return verified


def compare_evidence(directory: Path, require_all: bool = True) -> List[str]:
    """Differences between a run's verdicts and the recorded ones (empty when they agree)."""
    problems = []
    verified = load_verified()
    fresh = verdicts_from_evidence(directory)
    ran = set(stack_versions_from_evidence(directory))
    if require_all:
        missing = [s for s in stacks() if s not in ran]
        if missing:
            problems.append(f"no evidence for stack(s) {', '.join(missing)}")
    for shim_id, per_stack in fresh.items():
        for stack, entry in per_stack.items():
            if entry["verdict"] == MISMATCH:
                problems.append(f"{shim_id} on {stack}: evidence contradicts the registry")
            recorded = verified["shims"].get(shim_id, {}).get(stack, {}).get("verdict")
            if recorded != entry["verdict"]:
                problems.append(f"{shim_id} on {stack}: run says {entry['verdict']}, COMPAT_MATRIX says {recorded}")
    for shim_id, per_stack in verified["shims"].items():
        for stack in per_stack:
            if stack in ran and stack not in fresh.get(shim_id, {}):
                problems.append(f"{shim_id} on {stack}: recorded, but this run produced no evidence")
    for shim_id in registry.ids():
        if shim_id not in verified["shims"] and shim_id not in fresh:
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
    return "<br>".join(f"{name} {version}" for name, version in spec.fixed_in.items()) or "unfixed upstream"


def _refs(spec) -> str:
    out = []
    for url in spec.refs:
        parts = url.rstrip("/").split("/")
        label = f"{parts[-3]}#{parts[-1]}" if len(parts) >= 3 and parts[-1].isdigit() else url
        out.append(f"[{label}]({url})")
    return ", ".join(out)


def render() -> str:
    shims = registry.shims()
    all_stacks = stacks()
    verified = load_verified()
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by `python -m ftshims.matrix` from the shim registry, ftshims/data/stacks.toml,",
        "     ftshims/data/verified.json and ftshims/data/claims.toml. Do not edit by hand; a test fails when it is stale. -->",
        "",
        "Each shim fixes one reproduced bug, only on the versions where it exists. `fix` shims are applied by",
        "`ftshims.apply()`; `speed` shims only when asked for (`include=[...]`). Ranges are PEP 440 specifiers",
        "evaluated with pre-releases included.",
        "",
        "## Shims",
        "",
        "| shim | kind | affected versions | fixed in | symptom | upstream |",
        "|---|---|---|---|---|---|",
    ]
    for shim in shims.values():
        spec = shim.spec
        lines.append(
            f"| `{spec.id}` | {spec.kind} | {_ranges(spec)} | {_fixed(spec)} | {_md(spec.symptom)} | {_refs(spec)} |"
        )
    lines += ["", "## Verified on pinned stacks", ""]
    lines += [
        "Every stack runs the whole test suite. In range, a shim's test reproduces the bug without the shim and",
        "shows it gone with it; out of range, it shows the bug absent and the shim not applied. A speed shim shows",
        "the same results (logits and gradients within tolerance) with and without it. Cells give the verdict and",
        "`reproduced/scenarios`; \"not run\" means no test of that shim can run on that stack (for example packing",
        "below transformers 4.37, which accepts no custom mask, or flash-attn's files outside `fa_rotary`).",
        "",
    ]
    names = list(all_stacks)
    lines.append("| shim | " + " | ".join(f"`{n}`" for n in names) + " |")
    lines.append("|---|" + "---|" * len(names))
    for shim_id in shims:
        cells = []
        for stack in names:
            entry = verified["shims"].get(shim_id, {}).get(stack)
            cells.append(f"{SYMBOL[entry['verdict']]} {entry['reproduced']}/{entry['scenarios']}" if entry else "not run")
        lines.append(f"| `{shim_id}` | " + " | ".join(cells) + " |")
    lines += ["", "## Stacks", "", "| stack | torch | transformers | peft | trl | accelerate | datasets | note |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for stack, info in all_stacks.items():
        pins = {p.split("==")[0]: p.split("==")[1] for p in info["pins"] if "==" in p}
        recorded = verified["stacks"].get(stack, {}).get("versions", {})
        torch_version = recorded.get("torch") or "2.13.0"
        cols = [pins.get(k, recorded.get(k, "?")) for k in ("transformers", "peft", "trl", "accelerate", "datasets")]
        lines.append(f"| `{stack}` | {torch_version} | " + " | ".join(cols) + f" | {_md(info.get('note', ''))} |")
    lines += ["", "## Shim details", ""]
    for shim in shims.values():
        spec = shim.spec
        lines += [f"### `{spec.id}` — {spec.title}", ""]
        doc = (shim.module.__doc__ or "").strip().split("\n\n")
        if len(doc) > 1:
            lines += [" ".join(doc[1].split()), ""]
        lines.append("Targets: " + ", ".join(f"`{t.dotted}`" + (f" (transformers `{t.when}`)" if t.when else "") for t in spec.targets))
        if spec.options:
            lines.append("")
            lines.append("Options: " + ", ".join(f"`{k}` (default `{v!r}`)" for k, v in spec.options.items()))
        lines += [""]
    lines += ["## Popular claims that turned out false", ""]
    for claim in _load_toml(CLAIMS)["claims"]:
        lines += [f"- **Claim:** {_md(claim['claim'])}", f"  **What is true:** {_md(claim['truth'])}"]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftshims.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when COMPAT_MATRIX.md (or the evidence) disagrees")
    parser.add_argument("--evidence", type=Path, help="directory of per-stack evidence JSON written by a test run")
    parser.add_argument("--record", action="store_true", help="merge --evidence into ftshims/data/verified.json")
    parser.add_argument("--partial", action="store_true", help="with --evidence --check: do not require every stack")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--canary", action="store_true", help="check every shim's targets in released code (downloads)")
    parser.add_argument("--tracked-only", action="store_true", help="with --canary: skip the newest releases")
    args = parser.parse_args(argv)
    if args.canary:
        from . import canary

        text, code = canary.report(canary.run(include_newest=not args.tracked_only))
        print(text)
        return code
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
