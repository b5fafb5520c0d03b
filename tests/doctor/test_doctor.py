"""``python -m ftshims.doctor``: the report, its three formats, exit codes and fault injection.

Most tests run the doctor in-process (the imports it triggers are paid once per
session); a few run ``python -m ftshims.doctor`` in a subprocess where only a
subprocess can show the behaviour (argparse's exit status, a torch whose import
raises). Fault injection: fake dist-info directories and fake packages on
``sys.path`` / ``PYTHONPATH`` via ``tmp_path``, monkeypatched metadata, and fake
shims swapped into the registry.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import ftshims
from ftshims import _manager, registry
from ftshims.versions import installed_versions
from ftshims.doctor import cli, environment, flashattn, packages
from ftshims.doctor import formats
from ftshims.doctor import report as report_mod
from ftshims.doctor.report import Options, collect
from ftshims.patching import resolve
from ftshims.probing import in_affected_range
from ftshims.spec import ShimSpec, TargetMissing

ROOT = Path(__file__).resolve().parents[2]
QUICK = Options(trial_imports=False, check_flash_attn=False)

TOP_LEVEL = (
    "schema",
    "schema_version",
    "created",
    "ftshims",
    "options",
    "environment",
    "packages",
    "flash_attn",
    "trial",
    "shims",
    "probes",
    "advisories",
    "findings",
    "tested_stack",
    "frameworks",
    "summary",
    "timing",
    "errors",
)


# -- helpers ------------------------------------------------------------------


def fake_shim(shim_id, *, requires=None, modules=("json",), kind="fix", install=None):
    """A shim that is not in ftshims/shims/: for exit codes and faults the real stack cannot show."""
    spec = ShimSpec(
        id=shim_id,
        title=f"fake bug {shim_id}",
        symptom="fake symptom",
        why="a fake shim for the tests",
        requires=requires or {"packaging": ">=0"},
        fixed_in={},
        refs=("https://example.invalid/issues/1",),
        targets=(),
        modules=modules,
        kind=kind,
    )
    module = types.ModuleType(f"fake_shim_{shim_id}")
    module.SPEC = spec
    module.install = install or (lambda patcher, options: None)
    return registry.Shim(spec, module)


@pytest.fixture
def only_shims(monkeypatch):
    """Replace the registry with the given shims for one test."""
    used = []

    def use(*shims):
        monkeypatch.setattr(registry, "_CACHE", {s.id: s for s in shims})
        for s in shims:
            used.append(s.id)
            _manager._RECORDS.pop(s.id, None)

    yield use
    for shim_id in used:
        _manager._RECORDS.pop(shim_id, None)


def run_main(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def write_module(root: Path, dotted: str, source: str) -> None:
    parts = dotted.split(".")
    directory = root.joinpath(*parts[:-1])
    directory.mkdir(parents=True, exist_ok=True)
    if len(parts) > 1:
        (directory / "__init__.py").touch()
    (directory / f"{parts[-1]}.py").write_text(source)


def fake_package(root: Path, name: str, source: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(source)


def dist_info(root: Path, name: str, version: str, metadata) -> None:
    directory = root / f"{name}-{version}.dist-info"
    directory.mkdir(parents=True)
    if metadata is not None:
        (directory / "METADATA").write_bytes(metadata if isinstance(metadata, bytes) else metadata.encode())


def doctor_subprocess(*args, env_extra=None, timeout=120):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "ftshims.doctor", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# -- the real stack -------------------------------------------------------------


@pytest.fixture(scope="module")
def full_report():
    """The full doctor on the installed stack, with trial imports (the expensive part, paid once)."""
    ftshims.revert()
    report = collect(Options(check_flash_attn=False))
    ftshims.revert()
    return report


def test_report_shape_and_json_round_trip(full_report):
    assert tuple(full_report) == TOP_LEVEL
    assert full_report["schema"] == "ftshims-doctor" and full_report["schema_version"] == 1
    assert json.loads(formats.to_json(full_report)) == json.loads(json.dumps(full_report, default=str))
    assert full_report["errors"] == [], full_report["errors"]
    probes = full_report["probes"]
    assert (probes["requested"], probes["seconds"], probes["results"]) == (False, None, [])
    assert full_report["findings"] == []  # no lint input given
    assert isinstance(full_report["advisories"], list)
    names = [row["name"] for row in full_report["packages"]]
    for name in packages.DEFAULT_PACKAGES:
        assert name in names
    for name in registry.packages():
        assert name in names
    assert full_report["environment"]["torch"]["status"] == "imported"
    assert full_report["timing"]["total_s"] > 0


def _bug_can_happen(spec) -> bool:
    """Inside the range, and with one of the distributions the bug needs (flash-attn for flash attention)."""
    if not in_affected_range(spec.id)[0]:
        return False
    return not spec.needs_any or any(installed_versions(spec.needs_any).values())


def test_every_shim_reported_with_its_range_and_trial_status(full_report):
    rows = {row["id"]: row for row in full_report["shims"]}
    assert list(rows) == list(registry.ids())
    imports = {row["module"]: row for row in full_report["trial"]["imports"]}
    for shim_id, row in rows.items():
        spec = registry.get(shim_id).spec
        affected = _bug_can_happen(spec)
        assert row["affected"] == affected, row
        if not affected:
            # out of range, or in range without what the bug needs (apply() still installs those)
            assert row["verdict"] == "not affected" and row["evidence"] == "absent"
            assert row["status"] in ("not needed", "disabled") or spec.needs_any
        elif not spec.by_default:  # speed, or opt-in
            assert row["verdict"] == "opt-in"
        elif all(imports.get(m, {"ok": True})["ok"] for m in spec.modules):
            # the trial imported the modules: the shim was really installed, or says why not
            assert row["status"] in ("applied", "disabled", "target missing", "failed"), row
            assert row["verdict"] == ("patched" if row["status"] == "applied" else "unpatched"), row
    summary = full_report["summary"]
    assert summary["known_bugs"] == [r["id"] for r in rows.values() if r["affected"] and r["kind"] == "fix"]
    assert summary["exit_code"] == (1 if summary["unpatched"] else 0)


def test_trial_leaves_nothing_patched():
    """Every target is the very same object after the doctor, and no shim is active."""
    before = {}
    for shim in registry.shims().values():
        for target in shim.spec.targets:
            module = sys.modules.get(target.module)
            if module is None:
                continue
            try:
                owner, attr = resolve(module, target.qualname)
            except TargetMissing:
                continue
            before[target.dotted] = (owner, attr, vars(owner).get(attr))
    report = collect(Options(check_flash_attn=False))
    assert report["trial"]["mode"] == "apply, import, revert"
    assert not [entry.id for entry in ftshims.status() if entry.active]
    for dotted, (owner, attr, original) in before.items():
        assert vars(owner).get(attr) is original, dotted


def test_doctor_keeps_shims_the_user_applied():
    """Used as a library after apply(): the doctor reports them and leaves them applied."""
    report = ftshims.apply()
    active = [entry.id for entry in report if entry.active]
    collect(QUICK)
    assert [entry.id for entry in ftshims.status() if entry.active] == active


def test_text_markdown_json_formats(capsys):
    code, text = run_main(capsys, "--no-import", "--no-flash-attn")
    assert code in (0, 1)
    for heading in ("Environment", "Packages", "flash-attn import", "Shims", "Summary"):
        assert re.search(rf"^{heading}", text, re.M), heading
    assert f"Exit code {code}; took " in text
    for shim_id in registry.ids():
        assert shim_id in text

    code_md, markdown = run_main(capsys, "--markdown", "--no-import", "--no-flash-attn")
    assert code_md == code
    assert markdown.startswith("### ftshims doctor")
    assert "| shim | kind | affected | apply() | verdict | detail |" in markdown
    for shim_id in registry.ids():
        assert f"`{shim_id}`" in markdown

    code_json, payload = run_main(capsys, "--json", "--no-import", "--no-flash-attn")
    data = json.loads(payload)
    assert code_json == code == data["summary"]["exit_code"]
    assert data["options"]["trial_imports"] is False


# -- exit codes -----------------------------------------------------------------


def test_exit_0_when_every_affected_bug_is_patched(capsys, only_shims):
    holder = types.SimpleNamespace(f=len)
    only_shims(fake_shim("fake_ok", install=lambda patcher, options: patcher.replace(holder, "f", abs)))
    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert code == 0
    (row,) = data["shims"]
    assert (row["affected"], row["status"], row["verdict"]) == (True, "applied", "patched")
    assert row["patched"] == ["SimpleNamespace.f"]
    assert data["summary"]["known_bugs"] == data["summary"]["patched_by_apply"] == ["fake_ok"]
    assert "fixes 1 of 1" in data["summary"]["message"]
    assert holder.f is len  # the trial reverted
    assert not ftshims.status()["fake_ok"].active


def test_exit_1_when_a_known_bug_stays_unpatched(capsys, only_shims, monkeypatch):
    def missing(patcher, options):
        raise TargetMissing("Foo.bar is gone")

    def broken(patcher, options):
        raise RuntimeError("boom")

    only_shims(
        fake_shim("fake_disabled"),
        fake_shim("fake_missing", install=missing),
        fake_shim("fake_failed", install=broken),
        fake_shim("fake_fine"),
    )
    monkeypatch.setenv("FTSHIMS_DISABLE", "fake_disabled")
    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert code == 1
    verdicts = {row["id"]: (row["status"], row["verdict"]) for row in data["shims"]}
    assert verdicts == {
        "fake_disabled": ("disabled", "unpatched"),
        "fake_missing": ("target missing", "unpatched"),
        "fake_failed": ("failed", "unpatched"),
        "fake_fine": ("applied", "patched"),
    }
    assert data["summary"]["unpatched"] == ["fake_disabled", "fake_missing", "fake_failed"]
    assert [p["id"] for p in data["summary"]["problems"]] == data["summary"]["unpatched"]
    reasons = {row["id"]: row["reason"] for row in data["shims"]}
    assert "FTSHIMS_DISABLE" in reasons["fake_disabled"] and "Foo.bar is gone" in reasons["fake_missing"]
    assert "RuntimeError: boom" in reasons["fake_failed"]
    assert data["ftshims"]["env"]["FTSHIMS_DISABLE"] == "fake_disabled"
    code_text, text = run_main(capsys, "--no-flash-attn")
    assert code_text == 1
    assert "UNPATCHED" in text and "Exit code 1" in text and "fixes 1 of 4" in text


def test_speed_shims_and_unaffected_shims_never_exit_1(capsys, only_shims, monkeypatch):
    only_shims(
        fake_shim("fake_speed", kind="speed"),
        fake_shim("fake_old", requires={"packaging": "<1"}),
    )
    monkeypatch.setenv("FTSHIMS_DISABLE", "*")
    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert code == 0
    verdicts = {row["id"]: row["verdict"] for row in data["shims"]}
    assert verdicts == {"fake_speed": "opt-in", "fake_old": "not affected"}
    assert data["summary"]["known_bugs"] == [] and data["summary"]["opt_in"] == ["fake_speed"]


def test_real_stack_disabled_exits_1_exactly_when_a_fix_shim_is_affected(capsys, monkeypatch):
    monkeypatch.setenv("FTSHIMS_DISABLE", "*")
    code, out = run_main(capsys, "--json", "--no-import", "--no-flash-attn")
    affected = [
        s.id for s in registry.shims().values() if s.spec.kind == "fix" and _bug_can_happen(s.spec)
    ]
    assert code == (1 if affected else 0)
    assert json.loads(out)["summary"]["unpatched"] == affected


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["--json", "--markdown"], ["--flash-attn-timeout", "-1"], ["--flash-attn-timeout", "soon"]],
)
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2


def test_usage_error_exit_2_from_the_command_line():
    started = time.perf_counter()
    result = doctor_subprocess("--no-such-flag")
    assert result.returncode == 2
    assert "usage: python -m ftshims.doctor" in result.stderr
    assert time.perf_counter() - started < 10  # argparse runs before any heavy import


def test_importing_the_doctor_imports_no_heavy_package():
    code = "import sys, ftshims.doctor, ftshims.doctor.cli, ftshims.doctor.report; " \
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


# -- --no-import ------------------------------------------------------------------


def test_no_import_statuses_come_from_version_gating(tmp_path, monkeypatch, only_shims, capsys):
    write_module(tmp_path, "ftshims_doctor_lazy_target", "VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ftshims_doctor_lazy_target", raising=False)
    only_shims(fake_shim("fake_lazy", modules=("ftshims_doctor_lazy_target",)))

    code, out = run_main(capsys, "--json", "--no-import", "--no-flash-attn")
    (row,) = json.loads(out)["shims"]
    assert code == 0
    assert (row["status"], row["verdict"]) == ("deferred", "patched on import")
    assert "ftshims_doctor_lazy_target" not in sys.modules
    assert not ftshims.status()["fake_lazy"].active  # the hook was cancelled

    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert (data["shims"][0]["status"], data["shims"][0]["verdict"]) == ("applied", "patched")
    assert [r["module"] for r in data["trial"]["imports"]] == ["ftshims_doctor_lazy_target"]
    assert "ftshims_doctor_lazy_target" in sys.modules


# -- fault injection: imports that raise -------------------------------------------


@pytest.mark.parametrize(
    "source, error",
    [
        ("raise RuntimeError('CUDA driver too old')\n", "RuntimeError: CUDA driver too old"),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
        ("import no_such_dependency_xyz\n", "ModuleNotFoundError"),
    ],
)
def test_a_patched_module_that_raises_on_import_is_reported(source, error, tmp_path, monkeypatch, only_shims, capsys):
    write_module(tmp_path, "ftshims_doctor_raises", source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ftshims_doctor_raises", raising=False)
    only_shims(fake_shim("fake_raises", modules=("ftshims_doctor_raises",)))
    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert code == 0  # it cannot be verified, but no known bug is left unpatched by ftshims
    (imp,) = data["trial"]["imports"]
    assert imp["ok"] is False and error in imp["error"]
    (row,) = data["shims"]
    assert (row["status"], row["verdict"]) == ("deferred", "unverified")
    assert error in row["reason"]
    assert any("ftshims_doctor_raises" in w for w in data["summary"]["warnings"])
    assert not ftshims.status()["fake_raises"].active
    for fmt in ("--markdown", "--text"):
        _, rendered = run_main(capsys, fmt, "--no-flash-attn")
        assert "ftshims_doctor_raises" in rendered


def test_torch_whose_import_fails_in_process(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    info = environment.torch_info()
    assert info["status"] == "import failed" and "halted; None in sys.modules" in info["error"]
    report = collect(QUICK)
    assert report["environment"]["torch"]["status"] == "import failed"
    assert any(w.startswith("torch does not import") for w in report["summary"]["warnings"])
    assert "import FAILED" in formats.to_text(report)
    assert "import FAILED" in formats.to_markdown(report)


def test_torch_whose_import_raises_from_the_command_line(tmp_path):
    """Also the exit code through ``python -m``: 1 when FTSHIMS_DISABLE=* leaves an affected bug unpatched."""
    fake_package(tmp_path, "torch", "raise RuntimeError('libcudart.so.12: cannot open shared object file')\n")
    env = {"PYTHONPATH": str(tmp_path), "FTSHIMS_DISABLE": "*"}
    result = doctor_subprocess("--json", "--no-import", "--no-flash-attn", env_extra=env)
    data = json.loads(result.stdout)
    affected = [s.id for s in registry.shims().values() if s.spec.kind == "fix" and in_affected_range(s.id)[0]]
    assert result.returncode == data["summary"]["exit_code"] == (1 if affected else 0), result.stderr
    torch = data["environment"]["torch"]
    assert torch["status"] == "import failed"
    assert "RuntimeError: libcudart.so.12" in torch["error"]
    assert data["errors"] == []


def test_a_failing_step_is_reported_and_the_rest_still_runs(monkeypatch, capsys):
    def explode():
        raise ValueError("doctor bug")

    monkeypatch.setattr(report_mod, "torch_info", explode)
    monkeypatch.setattr(report_mod, "run_trial", lambda trial_imports: explode())
    monkeypatch.setattr(report_mod.frameworks, "frameworks_section", explode)
    monkeypatch.setattr(report_mod, "ftshims_info", lambda: {"version": "1", "undocumented": True})  # not the section's shape
    code, out = run_main(capsys, "--json", "--no-flash-attn")
    data = json.loads(out)
    assert code in (0, 1)
    assert {e["section"] for e in data["errors"]} == {"environment", "trial", "frameworks", "ftshims"}
    empty = report_mod.skeleton(Options())
    assert data["ftshims"] == empty["ftshims"] and data["frameworks"] == empty["frameworks"]  # left at their empty values
    assert data["environment"]["torch"] == {"status": None, "error": None}
    assert [row["id"] for row in data["shims"]] == list(registry.ids())  # from version gating
    assert data["trial"]["mode"].startswith("failed")
    for fmt in ("--markdown", "--text"):
        _, rendered = run_main(capsys, fmt, "--no-flash-attn")
        assert "doctor error in environment" in rendered


def test_a_shim_module_that_raises_on_import(tmp_path, monkeypatch, capsys):
    """A broken shim module (the registry leaves it out): a failed, unpatched row and exit 1 (it cannot be vouched for)."""
    import ftshims.shims

    (tmp_path / "ftshims_doctor_broken_shim.py").write_text("raise RuntimeError('half-written shim')\n")
    monkeypatch.setattr(ftshims.shims, "__path__", list(ftshims.shims.__path__) + [str(tmp_path)])
    monkeypatch.setattr(registry, "SHIM_IDS", tuple(registry.SHIM_IDS) + ("ftshims_doctor_broken_shim",))
    monkeypatch.setattr(registry, "_CACHE", None)
    monkeypatch.setattr(registry, "_ERRORS", {})  # the registry keeps load errors module-wide: keep them to this test
    monkeypatch.delitem(sys.modules, "ftshims.shims.ftshims_doctor_broken_shim", raising=False)
    code, out = run_main(capsys, "--json", "--no-import", "--no-flash-attn")
    data = json.loads(out)
    assert code == 1
    (row,) = [r for r in data["shims"] if r["id"] == "ftshims_doctor_broken_shim"]
    assert (row["status"], row["verdict"]) == ("failed", "unpatched") and "half-written shim" in row["reason"]
    assert [r["name"] for r in data["packages"]][:2] == ["torch", "transformers"]
    assert {"source": "shim", "id": "ftshims_doctor_broken_shim"}.items() <= data["summary"]["problems"][-1].items()
    for fmt in ("--markdown", "--text"):
        _, rendered = run_main(capsys, fmt, "--no-import", "--no-flash-attn")
        assert "half-written shim" in rendered


def test_a_renderer_bug_falls_back_to_json(monkeypatch, capsys):
    monkeypatch.setattr(formats, "to_text", lambda report: 1 / 0)
    code, out = run_main(capsys, "--no-import", "--no-flash-attn")
    data = json.loads(out)
    assert data["errors"][-1]["section"] == "render" and code == data["summary"]["exit_code"]


# -- fault injection: broken metadata ---------------------------------------------


def test_broken_metadata_is_reported_not_raised(tmp_path, monkeypatch):
    dist_info(tmp_path, "bitsandbytes", "1.0", None)  # METADATA file missing
    dist_info(tmp_path, "deepspeed", "0.1", "Metadata-Version: 2.1\nName: deepspeed\nVersion: not a version!\n")
    dist_info(tmp_path, "triton", "3.0", b"\xff\xfe\x00garbage")  # undecodable
    second = tmp_path / "second"
    dist_info(tmp_path, "liger_kernel", "0.5.0", "Metadata-Version: 2.1\nName: liger-kernel\nVersion: 0.5.0\n")
    dist_info(second, "liger_kernel", "0.4.0", "Metadata-Version: 2.1\nName: liger-kernel\nVersion: 0.4.0\n")
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = {row["name"]: row for row in packages.collect_packages(packages.DEFAULT_PACKAGES)}
    assert rows["bitsandbytes"]["status"] == "broken metadata" and "no Version" in rows["bitsandbytes"]["detail"]
    assert rows["deepspeed"]["status"] == "broken metadata"
    assert rows["deepspeed"]["version"] == "not a version!" and "PEP 440" in rows["deepspeed"]["detail"]
    assert rows["triton"]["status"] == "broken metadata" and "UnicodeDecodeError" in rows["triton"]["detail"]
    assert rows["liger-kernel"]["status"] == "installed" and rows["liger-kernel"]["version"] == "0.5.0"
    assert "2 installs" in rows["liger-kernel"]["detail"]

    report = collect(QUICK)
    assert report["errors"] == []
    warned = " ".join(report["summary"]["warnings"])
    for name in ("bitsandbytes", "deepspeed", "triton", "liger-kernel"):
        assert name in warned
    assert "BROKEN METADATA" in formats.to_text(report) and "BROKEN METADATA" in formats.to_markdown(report)


def test_broken_metadata_of_a_gating_package(tmp_path, monkeypatch, only_shims):
    """A shadowing, unreadable dist-info of the package a shim gates on: reported, shim not affected."""
    dist_info(tmp_path, "packaging", "99.0", None)
    monkeypatch.syspath_prepend(str(tmp_path))
    only_shims(fake_shim("fake_gated"))
    report = collect(QUICK)
    (row,) = report["shims"]
    assert row["affected"] is False and "packaging is not installed" in row["range"]
    assert any("a shim gates on it" in w for w in report["summary"]["warnings"])


def test_metadata_lookup_that_raises(monkeypatch):
    from importlib import metadata

    real = metadata.distributions

    def flaky(**kwargs):
        if kwargs.get("name") == "accelerate":
            raise OSError("permission denied: site-packages")
        return real(**kwargs)

    monkeypatch.setattr(metadata, "distributions", flaky)
    rows = {row["name"]: row for row in packages.collect_packages(["accelerate", "wrapt"])}
    assert rows["accelerate"]["status"] == "broken metadata" and "permission denied" in rows["accelerate"]["detail"]
    assert rows["wrapt"]["status"] == "installed"


# -- flash-attn import check ---------------------------------------------------------

ABI_ERROR = (
    "/venv/lib/python3.11/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: "
    "undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
)
TORCH_CUDA = {"status": "imported", "version": "2.13.0+cu128", "cuda": "12.8", "cxx11_abi": True}


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    def make(source: str) -> None:
        fake_package(tmp_path, "flash_attn", source)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    return make


def test_flash_attn_abi_mismatch_gets_a_clear_message_and_fix(fake_flash_attn):
    fake_flash_attn(f"raise ImportError({ABI_ERROR!r})\n")
    result = flashattn.start(30, None).result(TORCH_CUDA)
    assert result["status"] == "abi mismatch" and result["ok"] is False
    assert result["symbol"].startswith("_ZN3c105ErrorC2")
    assert "torch 2.13.0+cu128" in result["message"]
    fix = result["fix"]
    assert "torch 2.13, CUDA 12.8, C++11 ABI TRUE" in fix
    assert "+cu12torch2.13cxx11abiTRUE" in fix and "--no-build-isolation" in fix


def test_flash_attn_abi_mismatch_in_every_format(fake_flash_attn, capsys):
    fake_flash_attn(f"raise ImportError({ABI_ERROR!r})\n")
    code, out = run_main(capsys, "--json", "--no-import")
    data = json.loads(out)
    assert data["flash_attn"]["status"] == "abi mismatch"
    assert data["packages"][[r["name"] for r in data["packages"]].index("flash-attn")]["status"] == "not installed"
    assert any("flash-attn does not import" in w for w in data["summary"]["warnings"])
    for fmt in ("--text", "--markdown"):
        _, rendered = run_main(capsys, fmt, "--no-import")
        assert "undefined symbol" in rendered and "--no-build-isolation" in rendered
    _, out = run_main(capsys, "--json", "--no-import", "--no-flash-attn")
    assert json.loads(out)["flash_attn"]["status"] == "skipped"


def test_flash_attn_hanging_import_times_out(fake_flash_attn):
    fake_flash_attn("import time\ntime.sleep(60)\n")
    started = time.perf_counter()
    result = flashattn.start(1.0, "2.8.3").result(TORCH_CUDA)
    assert time.perf_counter() - started < 10
    assert result["status"] == "timeout" and result["ok"] is False and result["version"] == "2.8.3"
    assert "1 s" in result["error"]


def test_flash_attn_other_outcomes(fake_flash_attn, tmp_path):
    fake_flash_attn("raise ImportError('libcudart.so.11.0: cannot open shared object file: No such file')\n")
    assert flashattn.start(30, None).result(TORCH_CUDA)["status"] == "missing library"
    (tmp_path / "flash_attn" / "__init__.py").write_text("raise ValueError('bad config')\n")
    result = flashattn.start(30, None).result(TORCH_CUDA)
    assert result["status"] == "import error" and "ValueError: bad config" in result["error"]
    (tmp_path / "flash_attn" / "__init__.py").write_text("import os\nos.abort()\n")
    result = flashattn.start(30, None).result(TORCH_CUDA)
    assert result["status"] == "crashed" and "signal" in result["error"]
    (tmp_path / "flash_attn" / "__init__.py").write_text("print('chatty import')\n__version__ = '2.8.3'\n")
    result = flashattn.start(30, None).result(TORCH_CUDA)
    assert (result["status"], result["ok"], result["imported_version"]) == ("ok", True, "2.8.3")


def test_flash_attn_absent_is_not_checked_but_broken_metadata_is(monkeypatch):
    monkeypatch.setattr(flashattn.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert flashattn.start(30, None) is None
    check = flashattn.start(30, None, broken_metadata=True)  # dist-info present but unreadable: still checked
    assert check is not None and check.result({})["ok"] is False


# -- torch runtime facts (the CUDA branch, with a fake torch) ----------------------------


def test_torch_details_on_a_fake_cuda_torch():
    props = [
        types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, total_memory=80 * 2**30),
        types.SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7, minor=0, total_memory=16 * 2**30),
    ]

    def device_properties(index):
        if index == 2:
            raise RuntimeError("CUDA error: unknown error")
        return props[index]

    cuda = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 3,
        get_device_properties=device_properties,
        is_bf16_supported=lambda: True,
    )
    fake = types.SimpleNamespace(
        __version__="2.13.0+cu128",
        version=types.SimpleNamespace(cuda="12.8", hip=None),
        backends=types.SimpleNamespace(
            cudnn=types.SimpleNamespace(is_available=lambda: True, version=lambda: 91002),
            mps=types.SimpleNamespace(is_available=lambda: False),
        ),
        compiled_with_cxx11_abi=lambda: True,
        cuda=cuda,
    )
    info = environment.torch_details(fake)
    assert (info["cuda"], info["cudnn"], info["cxx11_abi"], info["bf16_supported"]) == ("12.8", 91002, True, True)
    a100, v100, broken = info["devices"]
    assert (a100["capability"], a100["bf16"], a100["memory_gib"]) == ("8.0", True, 80.0)
    assert (v100["capability"], v100["bf16"]) == ("7.0", False)
    assert broken["name"] is None and "CUDA error" in info["field_errors"][0]
    report = report_mod.skeleton(Options())
    report["environment"]["torch"] = dict(info, status="imported", error=None)
    report["summary"] = report_mod.summarize(report)
    text = formats.to_text(report)
    assert "NVIDIA A100-SXM4-80GB, capability 8.0, 80.0 GiB" in text and "cuDNN 91002" in text
    assert "capability 8.0" in formats.to_markdown(report)


# -- the documented schema ----------------------------------------------------------------


def _keys(value, path=""):
    """Every key path of a report; maps keyed by package or shim names are not walked into."""
    dynamic = {"requires", "fixed_in", "versions", "sections", "env", "compared", "differences", "options"}
    if isinstance(value, dict):
        for key, item in value.items():
            yield key
            if key not in dynamic:
                yield from _keys(item, f"{path}.{key}")
    elif isinstance(value, list):
        for item in value:
            yield from _keys(item, path)


def test_every_key_is_documented(full_report):
    doc = (ROOT / "docs" / "doctor-json.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)`", doc))
    fa = flashattn._base("2.8.3", 1.0)
    missing = sorted({k for k in _keys(full_report) if k not in documented} | {k for k in fa if k not in documented})
    assert not missing, f"keys missing from docs/doctor-json.md: {missing}"
    assert f"`schema_version` | integer | `{full_report['schema_version']}`" in doc
    for verdict in ("patched", "patched on import", "unverified", "unpatched", "opt-in", "not affected"):
        assert f"`{verdict}`" in doc
    for status in ("ok", "not installed", "abi mismatch", "missing library", "import error", "timeout", "crashed"):
        assert f"`{status}`" in doc


# -- tested stacks (ftshims/data/stacks.toml) -------------------------------------------------------

from ftshims.doctor import stacks as stacks_mod  # noqa: E402

FAKE_STACKS = {
    "old": {"transformers": "4.46.3", "peft": "0.13.2", "trl": "0.12.2", "accelerate": "1.15.0", "datasets": "5.0.1"},
    "mid_a": {"transformers": "4.56.2", "peft": "0.17.1", "trl": "0.22.2", "accelerate": "1.15.0", "datasets": "5.0.1"},
    "mid_b": {"transformers": "4.57.6", "peft": "0.17.1", "trl": "0.24.0", "accelerate": "1.15.0", "datasets": "5.0.1"},
    "new": {"transformers": "4.57.6", "peft": "0.21.2", "trl": "1.16.0", "accelerate": "1.15.0", "datasets": "5.0.1"},
    "same_as_new": {"transformers": "4.57.6", "peft": "0.21.2", "trl": "1.16.0", "accelerate": "1.15.0", "datasets": "5.0.1"},
}


def test_tested_stack_exact_match():
    installed = dict(FAKE_STACKS["new"], transformers="4.57.6+local")  # a local label is the same release
    section = stacks_mod.compare(installed, FAKE_STACKS)
    assert section["status"] == "exact" and section["stacks"] == ["new", "same_as_new"]
    assert section["differences"] == {} and "exactly the tested stack new" in section["message"]


def test_tested_stack_nearest_by_transformers_then_peft_then_trl():
    # transformers 4.57.1: nearest to the 4.57.6 stacks; peft 0.17.1 then picks mid_b over new
    installed = {"transformers": "4.57.1", "peft": "0.17.1", "trl": "0.24.0", "accelerate": "1.15.0", "datasets": "5.0.1"}
    section = stacks_mod.compare(installed, FAKE_STACKS)
    assert section["status"] == "untested" and section["stacks"] == ["mid_b"]
    assert section["differences"] == {"mid_b": {"transformers": {"installed": "4.57.1", "tested": "4.57.6"}}}
    assert "nearest: mid_b (transformers 4.57.1 here, 4.57.6 tested)" in section["message"]
    assert "ranges were evaluated on your installed versions" in section["message"]
    # one package off, or not installed, is not a tested stack either
    section = stacks_mod.compare(dict(FAKE_STACKS["new"], datasets=None), FAKE_STACKS)
    assert section["status"] == "untested" and section["stacks"] == ["new", "same_as_new"]
    assert section["differences"]["new"] == {"datasets": {"installed": None, "tested": "5.0.1"}}


def test_tested_stack_on_the_real_stacks_file():
    from ftshims import datafiles

    default = datafiles.default_stack()
    section = stacks_mod.tested_stack(dict(datafiles.pinned_versions(default), torch="2.13.0+cpu"))
    assert section["status"] == "exact" and default in section["stacks"]
    near = dict(datafiles.pinned_versions("t4_56"), transformers="4.55.4", torch="2.13.0")
    section = stacks_mod.tested_stack(near)
    assert section["status"] == "untested" and section["stacks"] == ["t4_56"]


def test_tested_stack_compares_torch_too():
    """t5_25 runs torch 2.15.0, every other stack 2.13.0: the same Hugging Face stack on another torch is untested."""
    from ftshims import datafiles

    assert datafiles.torch_version("t5_25") == "2.15.0"
    hf = datafiles.pinned_versions("t5_25")
    section = stacks_mod.tested_stack(dict(hf, torch="2.15.0+cu132"))
    assert section["status"] == "exact" and section["stacks"] == ["t5_25"]
    assert "exactly the tested stack t5_25" in section["message"] and "torch 2.15.0+cu132" in section["message"]
    section = stacks_mod.tested_stack(dict(hf, torch="2.13.0+cpu"))
    assert section["status"] == "untested" and section["stacks"] == ["t5_25"]
    assert "torch 2.13.0+cpu here, 2.15.0 tested" in section["message"]
    section = stacks_mod.tested_stack(dict(datafiles.pinned_versions(datafiles.default_stack()), torch="2.15.0"))
    assert section["status"] == "untested" and "torch 2.15.0 here, 2.13.0 tested" in section["message"]


def test_tested_stack_is_unknown_without_tomllib(monkeypatch):
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python < 3.11: `import tomllib` fails
    section = stacks_mod.tested_stack({"transformers": "4.57.6"})
    assert section["status"] == "unknown" and section["stacks"] == []
    assert "unknown" in section["message"] and "3.11" in section["message"]


def test_tested_stack_in_the_three_formats(monkeypatch):
    monkeypatch.setattr(stacks_mod, "installed_versions", lambda rows: {"transformers": "4.57.1"})
    report = collect(QUICK)
    section = report["tested_stack"]
    assert section["status"] == "untested" and section["compared"]["transformers"] == "4.57.1"
    assert section["stacks"]
    assert "Tested stack" in formats.to_text(report) and section["message"] in formats.to_text(report)
    assert f"**Tested stack:** {section['message']}" in formats.to_markdown(report)
    assert json.loads(formats.to_json(report))["tested_stack"] == section
    assert "unverified" in report["summary"]  # the older key keeps its meaning (shims whose module did not import)


# -- advisories that concern certain model types -------------------------------------------------

DEEPSEEK = "deepseek_v2_yarn_missing_mscale"
TRANSFORMERS_4_57 = [{"name": "transformers", "version": "4.57.6"}]


def _advisory(rows, advisory_id):
    (row,) = [a for a in rows if a["id"] == advisory_id]
    return row


def _model(tmp_path, model_type):
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(path)


def test_model_specific_advisory_is_conditional_without_model():
    row = _advisory(report_mod.advisory_rows(TRANSFORMERS_4_57), DEEPSEEK)
    assert row["applies"] == "conditional" and row["model_types"] == ["deepseek_v2"]
    text = formats._applies_text(row, {})
    assert text.startswith("only if you train a deepseek_v2 model")
    report = report_mod.skeleton(QUICK)
    report["advisories"] = [row]
    summary = report_mod.summarize(report)
    assert not any(DEEPSEEK in w for w in summary["warnings"])  # not a warning of the stack
    assert "1 advisory applies only to certain model types (--model CONFIG tells)" in summary["message"]


@pytest.mark.parametrize("model_type,applies", [("deepseek_v2", "yes"), ("llama", "no")])
def test_model_specific_advisory_with_model(tmp_path, model_type, applies):
    options = Options(model=_model(tmp_path, model_type))
    row = _advisory(report_mod.advisory_rows(TRANSFORMERS_4_57, None, report_mod._model_type(options)), DEEPSEEK)
    assert row["applies"] == applies
    report = report_mod.skeleton(options)
    report["advisories"] = [row]
    summary = report_mod.summarize(report)
    assert any(DEEPSEEK in w for w in summary["warnings"]) == (applies == "yes")
    report["summary"] = summary
    text = formats.to_text(report)
    assert ("applies  yes: your model" in text) == (applies == "yes")
    assert ("applies  no: your model (--model) is not deepseek_v2" in text) == (applies == "no")
    assert "| applies |" in formats.to_markdown(report)


def test_advisories_without_model_types_always_apply():
    rows = report_mod.advisory_rows([{"name": "transformers", "version": "4.47.0"}], None, "llama")
    assert rows and all(r["applies"] == "yes" for r in rows if not r["model_types"])


def test_summary_names_opt_in_fixes_apart_from_speed_shims(full_report):
    """An opt-in fix (it changes what a run trains) is not offered as a speed shim, nor counted as a known bug."""
    rows = {row["id"]: row for row in full_report["shims"]}
    summary = full_report["summary"]
    message = summary["message"]
    for shim_id, row in rows.items():
        if row["verdict"] != "opt-in":
            continue
        assert shim_id in summary["opt_in"] and shim_id not in summary["known_bugs"]
        speed_part = message.split("Opt-in speed shims available:", 1)[1] if "speed shims" in message else ""
        if row["kind"] == "speed":
            assert shim_id in speed_part
        else:
            assert shim_id in message.split("Opt-in fixes that change what a run trains", 1)[1]
            assert shim_id not in speed_part


def test_a_speed_shim_in_range_is_available_not_affected(full_report):
    """A speed shim fixes no bug: in range it is offered (``available [speed]``), never shown as a bug (``AFFECTED``)."""
    speed = [row for row in full_report["shims"] if row["kind"] == "speed" and row["affected"]]
    from ftshims.versions import installed_version, in_range

    if not in_range(installed_version("transformers") or "0", "<5.25"):
        # rope_fused_kernel stays out from 5.25 (apply_rotary_pos_emb is a kernels hub-function module there)
        assert not any(row["id"] == "rope_fused_kernel" for row in speed)
        pytest.skip("no speed shim is in range on transformers >= 5.25")
    assert speed, "rope_fused_kernel (transformers >=4.30,<5.25) is in range on every other stack"
    text, markdown = formats.to_text(full_report), formats.to_markdown(full_report)
    assert "AFFECTED [speed]" not in text
    for row in speed:
        assert f"  {row['id']}: available [speed] {row['title']}" in text
        assert f"| `{row['id']}` | speed | available |" in markdown
    fixes = [row for row in full_report["shims"] if row["kind"] != "speed" and row["affected"]]
    for row in fixes:  # a bug this stack has still reads AFFECTED
        assert f"  {row['id']}: AFFECTED [{row['kind']}] {row['title']}" in text


def test_packages_without_bytecode_are_a_warning_only_when_python_will_not_write_it(tmp_path, monkeypatch):
    """Without .pyc files and with PYTHONDONTWRITEBYTECODE, every process compiles torch/transformers again."""
    import compileall

    for name in ("compiled_pkg", "source_pkg"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("VALUE = 1\n")
    assert compileall.compile_dir(str(tmp_path / "compiled_pkg"), quiet=1)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environment.packages_without_bytecode(("compiled_pkg", "source_pkg", "no_such_pkg")) == ["source_pkg"]

    report = report_mod.skeleton(QUICK)
    for writes, warned in ((True, False), (False, True)):
        report["environment"]["python"] = {"writes_bytecode": writes, "no_bytecode": ["torch", "transformers"]}
        warnings = report_mod.summarize(report)["warnings"]
        assert any("torch and transformers have no compiled bytecode" in w and "compileall" in w for w in warnings) == warned
    report["environment"]["python"] = {"writes_bytecode": False, "no_bytecode": []}
    assert not any("bytecode" in w for w in report_mod.summarize(report)["warnings"])
