"""``python -m ftshims.doctor --probe``: the probe server, its isolation, the report rows and the exit code.

Fault injection uses fake shims written to ``tmp_path`` (on ``PYTHONPATH`` so
the probe server imports them by name): probes that hang, segfault, exit,
raise, are unsupported, flood stdout, and healthy ones that the shim fixes or
does not. Those runs preload nothing, so they take a second or two. One test
runs the real ``python -m ftshims.doctor --probe`` end to end on the installed
stack, with a time limit generous enough for a loaded CI machine.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from ftshims import _manager, advisories, registry
from ftshims.doctor import cli, probes
from ftshims.doctor import report as report_mod
from ftshims.probing import in_affected_range

ROOT = Path(__file__).resolve().parents[2]

FAKE = '''
import os, sys, time, signal
from ftshims.spec import Observation, ProbeUnsupported, ShimSpec

SPEC = ShimSpec(
    id={shim_id!r},
    title="fake {shim_id}",
    symptom="fake",
    why="a fake shim for the tests",
    requires={requires!r},
    fixed_in={{}},
    refs=("https://example.invalid/1",),
    targets=(),
    modules=("json",),
    kind={kind!r},
)
class State:
    def __init__(self, broken):
        self.broken = broken

# Not a bare True/False: revert's copy sweep (ftshims.patching._sweep_copies) rebinds every module global that *is*
# the replaced object, so replacing a singleton would rewrite unrelated modules' globals.
STATE = State(True)

def install(patcher, options):
    if {fixes!r}:
        patcher.replace(sys.modules[__name__], "STATE", State(False))

def probe():
{body}
'''

BODIES = {
    "fake_fixed": "    return Observation(STATE.broken, 'broken' if STATE.broken else 'fine')",
    "fake_unpatched": "    return Observation(True, 'still broken')",
    "fake_absent": "    return Observation(False, 'fine')",
    "fake_hang": "    time.sleep(600)",
    "fake_segv": "    os.kill(os.getpid(), signal.SIGSEGV)",
    "fake_exit": "    os._exit(7)",
    "fake_raise": "    raise RuntimeError('probe exploded')",
    "fake_unsupported": "    raise ProbeUnsupported('not on this stack')",
    "fake_chatty": "    print('noise ' * 5000); print('{\"event\": \"result\", \"index\": 0}'); sys.stderr.write('err\\n' * 100)\n"
    "    return Observation(STATE.broken, 'after the noise')",
}


def write_fake(root: Path, shim_id: str, fixes: bool = True, requires=None, kind: str = "fix") -> types.ModuleType:
    module_name = f"ftshims_test_{shim_id}"
    source = FAKE.format(shim_id=shim_id, requires=requires or {"packaging": ">=0"}, fixes=fixes, body=BODIES[shim_id], kind=kind)
    (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    sys.modules.pop(module_name, None)
    import importlib

    return importlib.import_module(module_name)


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """Register fake shims (parent and probe server see the same modules via PYTHONPATH)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    used = []

    def use(*specs):
        cache = {}
        for spec in specs:
            shim_id, kwargs = (spec, {}) if isinstance(spec, str) else spec
            module = write_fake(tmp_path, shim_id, **kwargs)
            cache[shim_id] = registry.Shim(module.SPEC, module)
            used.append(shim_id)
            _manager._RECORDS.pop(shim_id, None)
        monkeypatch.setattr(registry, "_CACHE", cache)
        return [probes.Task(i, shim_id) for i, shim_id in enumerate(cache)]

    yield use
    for shim_id in used:
        _manager._RECORDS.pop(shim_id, None)
        sys.modules.pop(f"ftshims_test_{shim_id}", None)


def run_fakes(tasks, **kwargs):
    progress = io.StringIO()
    started = time.perf_counter()
    run = probes.ProbeRun(tasks, progress=progress, preload=[], **kwargs)
    rows = {row["shim_id"]: row for row in run.results()}
    return rows, run, progress.getvalue(), time.perf_counter() - started


# -- isolation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "inline"])
def test_hanging_and_crashing_probes_cannot_stop_the_others(fakes, fork):
    if fork and not sys.platform.startswith("linux"):
        pytest.skip("fork mode is Linux-only")
    tasks = fakes("fake_fixed", "fake_hang", "fake_segv", "fake_exit", "fake_raise", "fake_unsupported", "fake_absent")
    rows, run, progress, seconds = run_fakes(tasks, timeout_s=3, jobs=2, fork=fork)
    assert run.mode == ("fork" if fork else "inline")
    status = {shim_id: row["status"] for shim_id, row in rows.items()}
    assert status == {
        "fake_fixed": "ok",
        "fake_hang": "timeout",
        "fake_segv": "crashed",
        "fake_exit": "crashed",
        "fake_raise": "error",
        "fake_unsupported": "unsupported",
        "fake_absent": "ok",
    }
    assert "SIGSEGV" in rows["fake_segv"]["error"]
    assert "exit code 7" in rows["fake_exit"]["error"] or "died" in rows["fake_exit"]["error"]
    assert "RuntimeError: probe exploded" in rows["fake_raise"]["error"]
    assert "ProbeUnsupported: not on this stack" in rows["fake_unsupported"]["error"]
    assert rows["fake_hang"]["seconds"] >= 3
    for shim_id in ("fake_hang", "fake_segv", "fake_exit", "fake_raise", "fake_unsupported"):
        assert rows[shim_id]["verdict"] == "could not run" and rows[shim_id]["bug_without_shim"] is None
    assert rows["fake_fixed"]["verdict"] == "bug fixed" and rows["fake_absent"]["verdict"] == "bug absent"
    # one progress line per probe, on the stream given (the CLI's stderr)
    assert sum(1 for line in progress.splitlines() if line.strip().startswith("[")) == 7
    assert seconds < 60
    if fork:
        assert run.servers_started == 1  # a hang or crash costs its own probe only, no restart
    else:
        assert run.servers_started >= 3  # inline: the watchdog restarts the server after the hang and the crashes


def test_a_hanging_probe_is_killed_with_its_process_group(fakes):
    if not sys.platform.startswith("linux"):
        pytest.skip("fork mode is Linux-only")
    tasks = fakes("fake_hang")
    rows, run, _, seconds = run_fakes(tasks, timeout_s=1.5, jobs=1)
    assert rows["fake_hang"]["status"] == "timeout"
    assert "killed" in rows["fake_hang"]["error"]
    assert seconds < 30


def test_probe_output_cannot_corrupt_the_protocol(fakes):
    tasks = fakes("fake_chatty")
    rows, _, _, _ = run_fakes(tasks, timeout_s=20, jobs=1)
    row = rows["fake_chatty"]
    assert row["status"] == "ok" and row["bug_without_shim"] is True and row["fixed"] is True


def test_a_server_that_cannot_start_stops_the_run_with_a_reason(fakes):
    tasks = fakes("fake_fixed", "fake_absent")
    broken = [sys.executable, "-c", "import sys; sys.stderr.write('torch is broken\\n'); sys.exit(3)"]
    env = probes.child_env()
    rows, run, _, seconds = run_fakes(tasks, timeout_s=5, server_factory=lambda: probes.Server(env, argv=broken))
    assert {row["status"] for row in rows.values()} == {"not run"}
    assert "died while starting" in rows["fake_fixed"]["error"] and "exit code 3" in rows["fake_fixed"]["error"]
    assert "torch is broken" in (rows["fake_fixed"]["output_tail"] or "")
    assert run.servers_started == 0
    assert seconds < 30


def test_the_doctor_runs_its_own_trial_when_the_server_cannot_start(monkeypatch):
    broken = [sys.executable, "-c", "import sys; sys.exit(3)"]
    env = probes.child_env()
    real_run = probes.ProbeRun

    def run(tasks=None, **kwargs):
        assert kwargs["environment"] is False  # --no-import: the server was asked for the trial without imports
        return real_run(probes.tasks_from_registry()[:1], server_factory=lambda: probes.Server(env, argv=broken), **kwargs)

    monkeypatch.setattr(probes, "run", run)
    started = time.perf_counter()
    report = report_mod.collect(report_mod.Options(probe=True, trial_imports=False, check_flash_attn=False))
    assert report["trial"]["mode"] == "version gating only (--no-import)"  # the doctor's own trial
    assert report["shims"] and report["environment"]["torch"]["status"] is not None
    assert report["probes"]["results"][0]["status"] == "not run"
    assert time.perf_counter() - started < 60


def test_the_probe_environment_is_offline_and_unpatched(monkeypatch):
    monkeypatch.setenv("FTSHIMS_AUTO", "1")
    monkeypatch.setenv("FTSHIMS_DISABLE", "x")
    env = probes.child_env()
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        assert env[name] == "1"
    assert "FTSHIMS_AUTO" not in env
    assert env["FTSHIMS_DISABLE"] == "x"  # the user's choice is what the probes must reflect
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_the_worker_refuses_network_connections():
    code = (
        "import socket; from ftshims.doctor import _probe_worker as w; w._no_network()\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9))\nexcept OSError as e:\n    print('refused', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "refused network access is disabled" in out.stdout, out.stderr


# -- verdicts, problems and the exit code -------------------------------------------------------


def test_disabled_or_unfixing_shim_is_an_unpatched_bug(fakes, monkeypatch):
    tasks = fakes("fake_fixed", ("fake_unpatched", {"fixes": False}), ("fake_absent", {"requires": {"packaging": "<1"}}))
    monkeypatch.setenv("FTSHIMS_DISABLE", "fake_fixed")
    rows, _, _, _ = run_fakes(tasks, timeout_s=20)
    fixed, unpatched, absent = rows["fake_fixed"], rows["fake_unpatched"], rows["fake_absent"]
    assert (fixed["bug_without_shim"], fixed["bug_with_shim"], fixed["fixed"]) == (True, True, False)
    assert fixed["shim_status"] == "disabled" and "FTSHIMS_DISABLE" in fixed["detail"]
    assert unpatched["verdict"] == "bug unpatched" and "did not fix" in unpatched["detail"]
    assert absent["verdict"] == "not needed" and absent["affected"] is False and absent["fixed"] is None
    assert probes.is_problem(fixed) and probes.is_problem(unpatched) and not probes.is_problem(absent)
    assert probes.bug_present_text(fixed) == "yes" and probes.fixed_text(fixed) == "no"
    assert probes.fixed_text(absent) == "n/a"


def test_cli_probe_exit_codes_and_clean_json(fakes, monkeypatch, capsys):
    fakes("fake_fixed", "fake_unsupported")
    monkeypatch.setattr(probes, "preload_names", lambda ids: [])
    code = cli.main(["--probe", "--json", "--no-flash-attn", "--no-import", "--probe-timeout", "20"])
    captured = capsys.readouterr()
    data = json.loads(captured.out)  # progress went to stderr, stdout is pure JSON
    assert "probing 2 shim(s)" in captured.err and "[2/2]" in captured.err
    assert code == 0 == data["summary"]["exit_code"]
    section = data["probes"]
    assert section["requested"] is True and section["seconds"] > 0 and section["timeout_s"] == 20
    assert [r["shim_id"] for r in section["results"]] == ["fake_fixed", "fake_unsupported"]
    assert "Probes: 1 ran, the bug showed in 1, the shim fixed 1, 1 could not run." in data["summary"]["message"]

    monkeypatch.setenv("FTSHIMS_DISABLE", "fake_fixed")
    code = cli.main(["--probe", "--no-flash-attn", "--no-import", "--quiet"])
    captured = capsys.readouterr()
    assert code == 1 and captured.err == "", captured.out
    assert "PROBLEM  fake_fixed" in captured.out and "bug present: yes; fixed by the shim: no" in captured.out
    code = cli.main(["--probe", "--markdown", "--no-flash-attn", "--no-import", "--quiet"])
    markdown = capsys.readouterr().out
    assert code == 1 and "| `fake_fixed` | yes | no | bug unpatched |" in markdown


def test_speed_shims_are_probed_only_with_probe_all(fakes):
    tasks = fakes(("fake_fixed", {"kind": "speed"}), "fake_absent")
    rows, _, _, _ = run_fakes(tasks, timeout_s=20)
    assert rows["fake_fixed"]["status"] == "skipped" and rows["fake_absent"]["status"] == "ok"
    assert probes.bug_present_text(rows["fake_fixed"]).startswith("not probed")
    rows, _, _, _ = run_fakes(tasks, timeout_s=20, include_speed=True)
    assert rows["fake_fixed"]["verdict"] == "bug fixed"


@pytest.mark.parametrize("argv", [["--probe-jobs", "0"], ["--probe-timeout", "-1"], ["--probe-timeout", "soon"]])
def test_probe_usage_errors_exit_2(argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--probe", *argv])
    assert exc.value.code == 2


def test_summary_counts_probe_problems_from_rows():
    report = report_mod.skeleton(report_mod.Options())
    report["probes"]["requested"] = True
    report["probes"]["results"] = [
        {"shim_id": "a", "bug_without_shim": True, "bug_with_shim": False, "fixed": True, "verdict": "bug fixed", "status": "ok"},
        {"shim_id": "b", "bug_without_shim": False, "bug_with_shim": True, "fixed": None, "verdict": "bug unpatched", "status": "ok", "detail": "shim causes it"},
        {"shim_id": "c", "bug_without_shim": None, "bug_with_shim": None, "fixed": None, "verdict": "could not run", "status": "crashed", "error": "boom"},
    ]
    summary = report_mod.summarize(report)
    assert [p["id"] for p in summary["problems"]] == ["b"] and summary["exit_code"] == 1
    assert any("probe c could not run (crashed)" in w for w in summary["warnings"])


# -- the real thing -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_probe_run():
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "ftshims.doctor", "--probe", "--json", "--no-flash-attn"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return result, time.perf_counter() - started


def test_real_probe_run_end_to_end(real_probe_run):
    result, seconds = real_probe_run
    data = json.loads(result.stdout)
    # 30 s on an idle 2-core machine; generous for a loaded CI box (see docs/doctor-json.md for measurements)
    assert seconds < 180, seconds
    rows = {row["shim_id"]: row for row in data["probes"]["results"]}
    unfixable = {}
    assert list(rows) == list(registry.ids())
    assert data["probes"]["servers_started"] == 1
    for shim_id, row in rows.items():
        shim = registry.get(shim_id)
        if shim.probe is None:
            assert row["status"] == "no probe"
            continue
        if shim.spec.kind == "speed":
            assert row["status"] == "skipped"  # opt-in speed shims: --probe-all
            continue
        assert row["status"] in ("ok", "unsupported"), row  # nothing hung, crashed or raised on the real stack
        assert f"] {shim_id}: " in result.stderr  # a progress line per probe
        if row["status"] != "ok":
            continue
        affected, _ = in_affected_range(shim_id)
        assert row["affected"] == affected
        if affected:
            assert row["bug_with_shim"] is False, row  # every real shim removes its bug on its own stack
        elif row["bug_without_shim"]:
            # present but unfixable on these versions (packing below 4.37): an advisory must say so, and the
            # doctor reports the bug as unpatched, pointing at that advisory
            covering = [a.id for a in advisories.matching() if shim_id in (a.related_shims or ())]
            assert covering, row
            unfixable[shim_id] = covering
        else:
            assert row["bug_with_shim"] is False, row  # the gate: no bug outside the range
    assert data["summary"]["exit_code"] == result.returncode
    # The server computed the torch section and the trial (the doctor imported neither); same verdicts as in-process.
    assert data["trial"]["mode"] == "apply, import, revert, in a child of the probe server"
    assert "trial" not in data["timing"]["sections"] and "probe_server" in data["timing"]["sections"]
    assert data["environment"]["torch"]["status"] == "imported"
    from ftshims.doctor.shims import run_trial, shim_rows

    local = {row["id"]: (row["status"], row["verdict"]) for row in shim_rows(run_trial(True), True)}  # reverts itself
    assert {row["id"]: (row["status"], row["verdict"]) for row in data["shims"]} == local
    probe_problems = {p["id"]: p["message"] for p in data["summary"]["problems"] if p["source"] == "probe"}
    assert set(probe_problems) == set(unfixable)
    for shim_id, covering in unfixable.items():
        assert all(advisory_id in probe_problems[shim_id] for advisory_id in covering)


def test_probe_keys_and_values_are_documented():
    doc = (ROOT / "docs" / "doctor-json.md").read_text()
    for key in probes._base_row(probes.Task(0, "x")):
        assert f"| `{key}` |" in doc, key
    for key in report_mod.skeleton(report_mod.Options())["probes"]:
        assert f"| `{key}` |" in doc, key
    for value in probes.VERDICTS + ("ok", "unsupported", "error", "timeout", "crashed", "not run", "no probe", "skipped", "fork", "inline"):
        assert f"`{value}`" in doc, value
