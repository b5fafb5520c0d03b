"""Time ``python -m ftshims.doctor --probe --json``: wall clock, idle and with one core kept busy.

    python bench/doctor_probe.py [--python PY] [--root DIR] [--repeat N] [--only idle|busy] [--from-source]

Each run is a fresh subprocess (nothing warm but the OS file cache), timed with the wall clock. "busy"
starts one spinning Python process first (one core taken, as by a training job or a test run) and stops
it afterwards. For each run it prints the wall time, the CPU time of the doctor and everything it started
(the probe server and its probe children), the load average before the run, and the breakdown the
report gives: ``timing.sections``, ``probes.startup_s`` (the server's imports) and the probes' own time.

CPU seconds are the number to compare when the machine is loaded by others: the wall time then depends
on how much of the CPUs the run got. ``--root`` times another checkout (e.g. ``git archive HEAD``
unpacked somewhere) with the same Python, for a before/after comparison.

Goal (issue 12): <= 15 s idle and <= 30 s with the other core busy, on a 2-core machine.

What dominates is the probe server's imports (torch, transformers, peft, trl's trainers). Those depend on
whether the packages have compiled bytecode: pip compiles at install, uv only with ``--compile-bytecode``
(the noxfile sets ``UV_COMPILE_BYTECODE=1``), and with ``PYTHONDONTWRITEBYTECODE=1`` (set on this project's
machines) Python never writes it itself. Each run's last line says which case was timed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(python: str, root: str, from_source: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=root, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if from_source:  # look for bytecode in an empty folder and write none: every import compiles from source
        env.update(PYTHONPYCACHEPREFIX=tempfile.mkdtemp(prefix="ftshims-no-bytecode-"), PYTHONDONTWRITEBYTECODE="1")
    load = os.getloadavg()[0]
    cpu = _children_cpu()
    start = time.perf_counter()
    proc = subprocess.run(
        [python, "-m", "ftshims.doctor", "--probe", "--json", "--quiet"],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    wall = time.perf_counter() - start
    cpu = _children_cpu() - cpu
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(f"the doctor printed no JSON (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    probes = report["probes"]
    ran = [r["seconds"] for r in probes["results"] if isinstance(r.get("seconds"), (int, float))]
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "load_before": round(load, 2),
        "exit_code": proc.returncode,
        "sections": report["timing"]["sections"],
        "server_startup_s": probes.get("startup_s"),
        "probes_s": probes.get("seconds"),
        "probe_own_s_sum": round(sum(ran), 2),
        "probes_ran": len(ran),
        "trial_mode": report["trial"]["mode"],
        "no_bytecode": report["environment"]["python"].get("no_bytecode"),
        "writes_bytecode": report["environment"]["python"].get("writes_bytecode"),
    }


def busy_core():
    """One process spinning on one core (the 'other core busy' case)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def show(label: str, row: dict) -> None:
    sections = ", ".join(f"{k} {v:.1f}" for k, v in row["sections"].items() if v >= 0.05)
    print(
        f"{label:8} wall {row['wall_s']:6.1f} s  cpu {row['cpu_s']:5.1f} s  load before {row['load_before']:.2f}  "
        f"exit {row['exit_code']}\n"
        f"      server start-up {row['server_startup_s']} s; probes {row['probes_s']} s from server start "
        f"({row['probes_ran']} ran, {row['probe_own_s_sum']} s of probe time); doctor sections: {sections}\n"
        f"      trial: {row['trial_mode']}; {_bytecode_text(row)}"
    )


def _bytecode_text(row: dict) -> str:
    """Whether the imports that dominate the run compile from source (about 13 s instead of 5 s here)."""
    if not row["no_bytecode"]:
        return "torch/transformers have compiled bytecode"
    written = "written on first import" if row["writes_bytecode"] else "never written (PYTHONDONTWRITEBYTECODE)"
    return f"no compiled bytecode for {', '.join(row['no_bytecode'])}, {written}: the imports compile from source"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--root", default=ROOT, help="the checkout to time (default: this one)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only", choices=("idle", "busy"))
    parser.add_argument("--json", action="store_true", help="print the rows as JSON too")
    parser.add_argument(
        "--from-source", action="store_true",
        help="also time each case with the bytecode hidden (every import compiles from source), side by side",
    )
    args = parser.parse_args()
    args.python = os.path.abspath(args.python)  # the runs start in --root
    rows = []
    print(f"{os.cpu_count()} CPUs; {args.root}; {args.python}")
    variants = [False, True] if args.from_source else [False]
    for _ in range(args.repeat):
        for case in ("idle", "busy"):
            if args.only not in (None, case):
                continue
            for from_source in variants:
                spinner = busy_core() if case == "busy" else None
                try:
                    if spinner is not None:
                        time.sleep(0.5)
                    row = run_once(args.python, args.root, from_source)
                finally:
                    if spinner is not None:
                        spinner.kill()
                        spinner.wait()
                label = case + (" src" if from_source else "")
                rows.append((label, row))
                show(label, row)
    if args.json:
        print(json.dumps([dict(row, case=case) for case, row in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
