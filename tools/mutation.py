"""Mutation check: a no-op version of every fix shim must make its tests fail.

    python tools/mutation.py --stack t4_57 --out matrix-results/mutation     # inside that stack's venv
    python tools/mutation.py --summary matrix-results/mutation               # after every stack ran

Each ``fix`` shim is checked on one stack where its bug exists: the default
stack when the shim's range includes it, else the newest pinned stack inside
its range; flash-attn shims in the ``rotary_flash`` session (``fa_rotary``),
whose tests load flash-attn's released sources. There its test file
(``tests/shims/test_<id>.py``) runs with ``--noop-shim <id>`` (tests/noop_shims.py:
the shim installs, but every patch passes through). Outcomes:

* **caught** — the tests fail: they can tell the shim from its absence;
* **survived** — they pass: a shim without a real test (the check fails);
* **not run** — nothing ran (all skipped: the stack cannot express the bug).

``--summary`` prints ``N/N fix shims: a no-op version is caught`` and exits 1
unless every fix shim was caught on its stack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLASH_ATTN_STACK = "fa_rotary"  # flash-attn is not pip-installable on CPU: its sources are loaded by the tests


def assignment() -> dict:
    """``{shim_id: stack}``: where each fix shim's no-op is checked."""
    from ftshims import datafiles, registry
    from ftshims.spec import SPEED
    from ftshims.versions import explain_mismatch

    order = [datafiles.default_stack()] + datafiles.matrix_stacks()[::-1]
    chosen = {}
    for shim in registry.shims().values():
        spec = shim.spec
        if spec.kind == SPEED:  # same results by design: nothing for a no-op to break
            continue
        if "flash-attn" in spec.requires:
            chosen[spec.id] = FLASH_ATTN_STACK
            continue
        for name in order:
            if explain_mismatch(spec.requires, dict(datafiles.pinned_versions(name), torch=datafiles.torch_version(name))) is None:
                chosen[spec.id] = name
                break
        else:
            chosen[spec.id] = None  # no pinned stack inside its range
    return chosen


def run_stack(stack: str, out: Path, extra_args) -> int:
    shim_ids = sorted(shim_id for shim_id, where in assignment().items() if where == stack)
    results = {}
    for shim_id in shim_ids:
        test_file = ROOT / "tests" / "shims" / f"test_{shim_id}.py"
        started = time.time()
        if not test_file.exists():
            results[shim_id] = {"outcome": "not run", "detail": f"no {test_file.relative_to(ROOT)}"}
            continue
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rN", str(test_file),
                   "--noop-shim", shim_id, *extra_args]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        last = ((proc.stdout.strip() or proc.stderr.strip()).splitlines() or [f"pytest exit code {proc.returncode}"])[-1]
        if proc.returncode == 1:
            outcome = "caught"
        elif proc.returncode == 0 and " passed" in last:
            outcome = "survived"
        else:  # 5: nothing collected or all deselected; 0 with only skips; 2-4: pytest itself failed
            outcome = "not run"
        results[shim_id] = {"outcome": outcome, "detail": last, "seconds": round(time.time() - started, 1)}
        print(f"mutation [{stack}] {shim_id}: {outcome} ({last}; {results[shim_id]['seconds']} s)", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stack}.json").write_text(json.dumps({"stack": stack, "results": results}, indent=2, sort_keys=True) + "\n")
    return 0 if all(r["outcome"] == "caught" for r in results.values()) else 1


def summary(directory: Path) -> int:
    expected = assignment()
    seen = {}
    for path in sorted(directory.glob("*.json")):
        run = json.loads(path.read_text())
        for shim_id, result in run["results"].items():
            seen[shim_id] = (run["stack"], result)
    caught = 0
    for shim_id, stack in sorted(expected.items()):
        where, result = seen.get(shim_id, (stack, {"outcome": "not run", "detail": "no result from its stack"}))
        caught += result["outcome"] == "caught"
        print(f"  {shim_id:<36} {str(where):<14} {result['outcome']:<9} {result.get('detail', '')}")
    print(f"{caught}/{len(expected)} fix shims: a no-op version is caught")
    return 0 if caught == len(expected) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", help="run the no-op checks of the shims assigned to this stack (in its venv)")
    parser.add_argument("--out", default=str(ROOT / "matrix-results" / "mutation"))
    parser.add_argument("--summary", metavar="DIR", help="print the overall result of the stacks' runs")
    parser.add_argument("--list", action="store_true", help="print which stack checks which shim")
    args, extra = parser.parse_known_args(argv)
    if args.list:
        for shim_id, stack in sorted(assignment().items()):
            print(f"{shim_id}: {stack}")
        return 0
    if args.summary:
        return summary(Path(args.summary))
    if not args.stack:
        parser.error("--stack, --summary or --list")
    os.environ.setdefault("FTSHIMS_STACK", args.stack)
    return run_stack(args.stack, Path(args.out), extra)


if __name__ == "__main__":
    sys.exit(main())
