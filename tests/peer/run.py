"""Run an upstream project's own tests against ftshims: off, then with the default shims, compared per test id.

    python tests/peer/run.py --suite trl --release 0.19.1 --out matrix-results/peer [-- extra pytest args]

The vendored tests of the release (tests/peer/<suite>/<release>/: the files that exercise what the shims patch, with
their licence and source commit) run twice in this venv, in a fresh working folder that holds the local hub
stand-ins (tests/peer/hub.py):

* ``off``: no ftshims (``FTSHIMS_AUTO`` unset: the start-up hook does nothing);
* ``default``: ``FTSHIMS_AUTO=1``: every process applies the default shims at start-up, as a user's run would.

The ``off`` outcomes depend on nothing of ftshims: with the release's pins they are recorded once
(``--record-off`` writes ``tests/peer/<suite>/<release>/off-outcomes.json`` with the versions and the selection
they were taken with), and a run whose versions and selection match reads them instead of running the tests a
second time (half the CI time). Every id whose recorded ``off`` outcome differs from the ``default`` run then runs
live in ``off`` mode, and only live outcomes are compared: a recorded outcome can hide no difference the live ``off``
run would show unless the test changes outcome between two runs of the same code (the flaky case below). Recorded
outcomes a live run contradicts are listed as stale (record again). ``--off live`` always runs both modes.

Every test id whose outcome differs between the two must be declared in tests/peer/declared.toml (with the shim,
the reason and the upstream reference); an undeclared difference fails the run, and so does a declared one that did
not happen (a stale declaration hides the next real one). The result, with per-file counts for both modes, is
written to ``<out>/<suite>-<release>.json``; exit status 0 when every difference is declared.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODES = ("off", "default")
REPEATS = 1  # extra runs of each differing test id, in both modes
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "collection error")


def load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        import tomli as tomllib
    return tomllib.loads(path.read_text())


def release_config(suite: str, release: str) -> dict:
    """tests/peer/<suite>/<release>/peer.toml: which files run, which names to stub, where the tree came from."""
    folder = HERE / suite / release
    config = load_toml(folder / "peer.toml")
    config["folder"] = folder
    return config


def declared(suite: str, release: str) -> dict:
    rows = load_toml(HERE / "declared.toml").get("difference", [])
    found = {}
    for row in rows:
        missing = [k for k in ("suite", "release", "test", "off", "default", "shim", "reason", "ref") if not row.get(k)]
        if missing:
            raise SystemExit(f"tests/peer/declared.toml: a difference without {missing}: {row}")
        if row["suite"] == suite and row["release"] == release:
            if row["test"] in found:
                raise SystemExit(f"tests/peer/declared.toml: {row['test']} declared twice for {suite} {release}")
            found[row["test"]] = row
    return found


def installed(name: str) -> str:
    import importlib.metadata as md

    return md.version(name)


def selection_key(config: dict, versions: dict) -> dict:
    """What recorded ``off`` outcomes were taken with: they stand for a live run only when all of it is the same."""
    return {"versions": versions, "files": config["files"], "select": config.get("select"),
            "stubs": config.get("stubs", {}), "pytest_args": config.get("pytest_args", []),
            "cpu_bf16": bool(config.get("cpu_bf16"))}


def recorded_off_path(config: dict) -> Path:
    return config["folder"] / "off-outcomes.json"


def recorded_off(config: dict, key: dict):
    """The recorded ``off`` outcomes when they were taken with exactly ``key``; else None, and why."""
    path = recorded_off_path(config)
    if not path.is_file():
        return None, f"no {path.relative_to(ROOT)} (python tests/peer/run.py --record-off writes it)"
    data = json.loads(path.read_text())
    if data.get("key") != key:
        changed = sorted(k for k in set(key) | set(data.get("key", {})) if key.get(k) != data.get("key", {}).get(k))
        return None, f"{path.relative_to(ROOT)} was recorded with another {', '.join(changed)}"
    return {t: {"outcome": o} for t, o in data["outcomes"].items()}, ""


def run_mode(mode: str, workdir: Path, config: dict, outcomes_path: Path, extra: list, test_ids=None) -> float:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FTSHIMS_", "ACCELERATE_")) and k != "PYTHONPATH"}
    env.update(
        PYTHONPATH=str(HERE),  # the plugin only: the vendored tree is a package named `tests`, like ours
        FTSHIMS_PEER_OUTCOMES=str(outcomes_path),
        FTSHIMS_PEER_STUBS=json.dumps(config.get("stubs", {})),
        FTSHIMS_PEER_CPU_BF16="1" if config.get("cpu_bf16") else "0",
        FTSHIMS_PEER_SELECT=json.dumps(config.get("select") if test_ids is None else None),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(workdir / ".hf-home"),  # nothing of the user's cache is read, and nothing written there
        TOKENIZERS_PARALLELISM="false", WANDB_DISABLED="true", WANDB_MODE="disabled",
    )
    if mode == "default":
        env["FTSHIMS_AUTO"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ftshims_peer_plugin",
               "-o", "addopts=", "--rootdir", str(workdir), *(test_ids or config["files"]),
               *config.get("pytest_args", []), *extra]
    started, cpu_before = time.time(), _children_cpu()
    subprocess.run(command, cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    if not outcomes_path.exists():
        raise SystemExit(f"peer run ({mode}) wrote no outcomes: pytest did not finish ({' '.join(command)})")
    return time.time() - started, _children_cpu() - cpu_before


def _children_cpu() -> float:
    """CPU seconds of the finished child processes (the pytest runs): what a run costs, whatever the machine's load."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def file_of(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def counts(outcomes: dict) -> dict:
    per_file = {}
    for test_id, entry in outcomes.items():
        per_file.setdefault(file_of(test_id), Counter())[entry["outcome"] or "not run"] += 1
    return {name: dict(sorted(c.items())) for name, c in sorted(per_file.items())}


def seconds_per_file(outcomes: dict) -> dict:
    per_file = Counter()
    for test_id, entry in outcomes.items():
        per_file[file_of(test_id)] += entry.get("seconds", 0.0)
    return {name: round(value, 1) for name, value in sorted(per_file.items())}


def compare(results: dict, expected: dict) -> tuple:
    """(undeclared differences, stale declarations, declared differences seen)."""
    off, default = results["off"], results["default"]
    undeclared, seen = [], []
    for test_id in sorted(set(off) | set(default)):
        a = (off.get(test_id) or {}).get("outcome")
        b = (default.get(test_id) or {}).get("outcome")
        if a == b:
            continue
        row = expected.get(test_id)
        if row is not None and row["off"] == a and row["default"] == b:
            seen.append(test_id)
        else:
            undeclared.append((test_id, a, b, (default.get(test_id) or {}).get("message", "")))
    stale = sorted(set(expected) - set(seen))
    return undeclared, stale, seen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="trl")
    parser.add_argument("--release", required=True)
    parser.add_argument("--out", default=str(ROOT / "matrix-results" / "peer"))
    parser.add_argument("--hub-cache", default=str(ROOT / ".nox" / ".peer-hub"))
    parser.add_argument("--keep", action="store_true", help="keep the working folder (printed)")
    parser.add_argument("--off", choices=("recorded", "live"), default="recorded",
                        help="off outcomes: the recorded ones when they match this venv and selection (default), or run")
    parser.add_argument("--record-off", action="store_true",
                        help="run the off mode only and record its outcomes for this release (off-outcomes.json)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to both pytest runs (e.g. -k collator)")
    args = parser.parse_args(argv)

    config = release_config(args.suite, args.release)
    package_version = installed(config["package"])
    if package_version != args.release:
        raise SystemExit(f"{config['package']} {package_version} is installed, the vendored tests are {args.release}'s")
    expected = declared(args.suite, args.release)
    sys.path.insert(0, str(HERE))
    import hub

    stack_key = "-".join(f"{p}{installed(p)}" for p in ("transformers", "trl"))
    hub_dir = hub.build(config["folder"] / "scripts", Path(args.hub_cache) / stack_key)

    workdir = Path(tempfile.mkdtemp(prefix=f"peer-{args.suite}-{args.release}-"))
    shutil.copytree(config["folder"] / "tests", workdir / "tests")
    (workdir / hub.ORG).symlink_to(hub_dir / hub.ORG, target_is_directory=True)
    versions = {p: installed(p) for p in ("torch", "transformers", "peft", "trl", "accelerate")}
    key = selection_key(config, versions)
    if args.record_off:
        if args.pytest_args:
            raise SystemExit("--record-off records the whole selection: no pytest arguments")
        path = workdir / "outcomes-off.json"
        wall, cpu = run_mode("off", workdir, config, path, [])
        outcomes = json.loads(path.read_text())["outcomes"]
        recorded_off_path(config).write_text(json.dumps({
            "key": key, "seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "outcomes": {t: e["outcome"] for t, e in sorted(outcomes.items())}}, indent=0) + "\n")
        print(f"recorded {len(outcomes)} off outcomes in {recorded_off_path(config).relative_to(ROOT)} "
              f"({round(wall, 1)} s, {round(cpu, 1)} s CPU)")
        shutil.rmtree(workdir, ignore_errors=True)
        return 0
    off_recorded, why_live = (None, "--off live") if args.off == "live" else \
        (None, "a selection (pytest arguments)") if args.pytest_args else recorded_off(config, key)
    results, seconds, cpu_seconds, stubbed = {}, {}, {}, []
    for mode in MODES:
        if mode == "off" and off_recorded is not None:
            results[mode], seconds[mode], cpu_seconds[mode] = off_recorded, 0.0, 0.0
            continue
        path = workdir / f"outcomes-{mode}.json"
        wall, cpu = run_mode(mode, workdir, config, path, args.pytest_args)
        seconds[mode], cpu_seconds[mode] = round(wall, 1), round(cpu, 1)
        data = json.loads(path.read_text())
        results[mode], stubbed = data["outcomes"], data["stubbed"]
    # Recorded off outcomes are compared only after a live run: every id they differ on runs live in off mode, and
    # its live outcome replaces the recorded one (a recorded outcome the live run contradicts is stale).
    stale_recorded = []
    if off_recorded is not None:
        differing = sorted(t for t in set(results["off"]) | set(results["default"])
                           if (results["off"].get(t) or {}).get("outcome") != (results["default"].get(t) or {}).get("outcome"))
        if differing:
            path = workdir / "outcomes-off-live.json"
            wall, cpu = run_mode("off", workdir, config, path, [], test_ids=differing)
            seconds["off"], cpu_seconds["off"] = round(wall, 1), round(cpu, 1)
            live = json.loads(path.read_text())["outcomes"]
            for test_id in differing:
                recorded = (results["off"].get(test_id) or {}).get("outcome")
                if (live.get(test_id) or {}).get("outcome") != recorded:
                    stale_recorded.append(test_id)
                if test_id in live:
                    results["off"][test_id] = live[test_id]
                else:
                    results["off"].pop(test_id, None)
    # A difference must reproduce: each differing id runs again in both modes (REPEATS times). One whose outcome
    # changes between runs of the same mode is flaky: the difference is not ftshims', and it is reported apart.
    flaky = []
    differing = sorted(t for t in set(results["off"]) | set(results["default"])
                       if (results["off"].get(t) or {}).get("outcome") != (results["default"].get(t) or {}).get("outcome"))
    for repeat in range(REPEATS if differing else 0):
        for mode in MODES:
            path = workdir / f"outcomes-{mode}-repeat{repeat}.json"
            run_mode(mode, workdir, config, path, args.pytest_args, test_ids=differing)
            again = json.loads(path.read_text())["outcomes"]
            for test_id in differing:
                if (again.get(test_id) or {}).get("outcome") != (results[mode].get(test_id) or {}).get("outcome"):
                    flaky.append(test_id)
    flaky = sorted(set(flaky))
    for test_id in flaky:
        for mode in MODES:
            results[mode].pop(test_id, None)
    if args.pytest_args:  # a selection (-k ...): declarations of tests it did not run are not judged
        expected = {t: row for t, row in expected.items() if t in results["off"] or t in results["default"]}
    undeclared, stale, seen = compare(results, expected)

    ran_for_real = sorted(t for t in results["off"] if results["off"][t]["outcome"] == "passed"
                          or (results["default"].get(t) or {}).get("outcome") == "passed")
    summary = {
        "suite": args.suite, "release": args.release, "source": config["source"],
        "versions": versions,
        "off_outcomes": "recorded" if off_recorded is not None else f"live ({why_live})",
        "stale_recorded_off": stale_recorded,
        "seconds": seconds, "cpu_seconds": cpu_seconds, "stubbed": stubbed, "test_ids": len(set(results["off"]) | set(results["default"])),
        "passed_in_either_mode": len(ran_for_real),
        "per_file": {mode: counts(results[mode]) for mode in MODES},
        "seconds_per_file": {mode: seconds_per_file(results[mode]) for mode in MODES},
        "declared_differences_seen": seen, "undeclared_differences": [list(u) for u in undeclared],
        "flaky": flaky,
        "stale_declarations": stale,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}-{args.release}.json").write_text(json.dumps(summary, indent=1) + "\n")
    for mode in MODES:
        (out / f"{args.suite}-{args.release}-{mode}-outcomes.json").write_text(json.dumps(results[mode], indent=0))

    print(f"{args.suite} {args.release} tests ({config['source']}) on {summary['versions']}")
    if off_recorded is not None:
        print(f"  off: the recorded outcomes ({recorded_off_path(config).relative_to(ROOT)}); the ids they differ on "
              f"from default ran live in off mode")
    else:
        print(f"  off: run live ({why_live})")
    if stubbed:
        print(f"  stood in for names gone from the release, in both modes alike: {', '.join(stubbed)}")
    print(f"  {summary['test_ids']} test ids, {summary['passed_in_either_mode']} passed in at least one mode; "
          f"off {seconds['off']} s ({cpu_seconds['off']} s CPU), default {seconds['default']} s "
          f"({cpu_seconds['default']} s CPU)")
    print(f"  {'file':<48} {'off':<44} default")
    for name in sorted(set(summary["per_file"]["off"]) | set(summary["per_file"]["default"])):
        row = [", ".join(f"{k} {v}" for k, v in summary["per_file"][m].get(name, {}).items()) for m in MODES]
        print(f"  {name:<48} {row[0]:<44} {row[1]}")
    for test_id in seen:
        row = expected[test_id]
        print(f"  declared: {test_id}: {row['off']} -> {row['default']} ({row['shim']}: {row['ref']})")
    for test_id, a, b, message in undeclared:
        print(f"  UNDECLARED: {test_id}: {a} -> {b}: {message}")
    for test_id in stale:
        print(f"  STALE declaration (did not happen): {test_id}")
    for test_id in stale_recorded:
        print(f"  stale recorded off outcome (the live off run differs; record again): {test_id}")
    for test_id in flaky:
        print(f"  flaky (outcome changed between runs of one mode; not compared): {test_id}")
    if args.keep:
        print(f"  working folder kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    ok = not undeclared and not stale
    print(f"peer {args.suite} {args.release}: {'ok' if ok else 'FAILED'}: {len(seen)} declared differences, "
          f"{len(undeclared)} undeclared, {len(stale)} stale")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
