"""Every setting is checked up front, by one path (``ftshims.settings``), from ``apply()`` or from ``FTSHIMS_*``.

Each bad value ends in a one-line ``ValueError`` (naming the setting, what was
given, what is allowed, the closest match), in one ``ftshims: `` line on stderr
from the start-up hook, or in a doctor problem; a good value has its documented
meaning. Nothing is ignored silently.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import ftshims
from ftshims import _manager, hook, registry, settings
from ftshims.doctor.report import Options, collect

ROOT = Path(__file__).resolve().parents[2]
GUARD = "max_positions_guard"
LORA = "lora_reentrant_checkpointing"
POLICY_ENV = "FTSHIMS_MAX_POSITIONS_POLICY"
BACKEND_ENV = "FTSHIMS_ROTARY_BACKEND"
QUICK = Options(trial_imports=False, check_flash_attn=False)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (settings.DISABLE_ENV, settings.AUTO_ENV, POLICY_ENV, BACKEND_ENV):
        monkeypatch.delenv(name, raising=False)


def _nothing_active() -> bool:
    return not [entry.id for entry in ftshims.status() if entry.active]


# -- option names and values ---------------------------------------------------------------------


def test_bad_option_value_raises_at_apply_before_anything_is_installed():
    with pytest.raises(ValueError) as caught:
        ftshims.apply(options={GUARD: {"policy": "explode"}})
    message = str(caught.value)
    assert "policy" in message and "'explode'" in message and "auto, error, warn, truncate" in message
    assert _nothing_active()  # the other shims were not installed either


def test_bad_option_value_suggests_the_close_match_and_good_ones_are_normalised():
    with pytest.raises(ValueError, match="did you mean 'truncate'"):
        ftshims.apply(only=[GUARD], options={GUARD: {"policy": "truncat"}})
    ftshims.apply(only=[GUARD], options={GUARD: {"policy": " Truncate "}})
    assert _manager._RECORDS[GUARD].options["policy"] == "truncate"


def test_unknown_option_name_and_malformed_options_raise():
    with pytest.raises(ValueError, match=r"unknown key 'polcy'.*did you mean 'policy'"):
        ftshims.apply(options={GUARD: {"polcy": "warn"}})
    with pytest.raises(ValueError, match="expected a dict of options"):
        ftshims.apply(options={GUARD: "warn"})
    with pytest.raises(ValueError, match=r"options: unknown shim id 'max_position_guard'.*did you mean 'max_positions_guard'"):
        ftshims.apply(options={"max_position_guard": {"policy": "warn"}})
    assert _nothing_active()


def test_option_env_var_goes_through_the_same_check(monkeypatch):
    monkeypatch.setenv(POLICY_ENV, "trunc")
    with pytest.raises(ValueError, match=rf"{POLICY_ENV}: got 'trunc'.*did you mean 'truncate'"):
        ftshims.apply()
    assert _nothing_active()
    # Checked even when the apply() option wins over it: a typo is never ignored silently.
    with pytest.raises(ValueError, match=POLICY_ENV):
        ftshims.apply(only=[GUARD], options={GUARD: {"policy": "warn"}})
    monkeypatch.setenv(POLICY_ENV, "WARN")
    ftshims.apply(only=[GUARD])
    assert _manager._RECORDS[GUARD].options["policy"] == "warn"
    ftshims.revert()
    ftshims.apply(only=[GUARD], options={GUARD: {"policy": "error"}})  # the option wins
    assert _manager._RECORDS[GUARD].options["policy"] == "error"


def test_shim_ids_in_keywords_are_checked_with_a_close_match():
    with pytest.raises(ValueError, match=r"only: unknown shim id 'max_position_guard'.*did you mean"):
        ftshims.apply(only=["max_position_guard"])
    with pytest.raises(ValueError, match="exclude: unknown shim id"):
        ftshims.apply(exclude=["nope"])
    with pytest.raises(ValueError, match="include: unknown shim id"):
        ftshims.apply(include=[3])
    assert _nothing_active()
    report = ftshims.apply(only=["Max-Positions-Guard"])  # case and '-' for '_', as documented
    assert report[GUARD].active


# -- FTSHIMS_DISABLE -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nope", "lora_reentrant_checkpointin", f"{LORA},nope", "a b"])
def test_disable_with_an_unknown_id_raises(monkeypatch, value):
    monkeypatch.setenv(settings.DISABLE_ENV, value)
    with pytest.raises(ValueError) as caught:
        ftshims.apply()
    message = str(caught.value)
    assert message.startswith(f"{settings.DISABLE_ENV}={value!r}: unknown shim id") and LORA in message
    assert "\n" not in message
    if value == "lora_reentrant_checkpointin":
        assert f"did you mean {LORA!r}" in message
    assert _nothing_active()


@pytest.mark.parametrize(
    "value, disabled",
    [
        ("*", "all"),
        ("all", "all"),
        (" ALL ", "all"),
        ("LORA_REENTRANT_CHECKPOINTING", {LORA}),
        ("lora-reentrant-checkpointing", {LORA}),
        (f"{LORA} {GUARD}", {LORA, GUARD}),
        (f" {LORA},\t{GUARD} ,", {LORA, GUARD}),
        ("", set()),
    ],
)
def test_disable_grammar(monkeypatch, value, disabled):
    monkeypatch.setenv(settings.DISABLE_ENV, value)
    expected = set(registry.ids()) if disabled == "all" else disabled
    assert settings.parse_disable() == expected
    report = ftshims.apply()
    assert {entry.id for entry in report if entry.status == "disabled" and "FTSHIMS_DISABLE" in entry.reason} == expected


# -- FTSHIMS_AUTO --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, meaning",
    [
        (None, {}),  # unset: an explicit `import ftshims.auto` applies the defaults
        ("", None),
        ("0", None),
        ("false", None),
        ("No", None),
        (" off ", None),
        ("1", {}),
        ("TRUE", {}),
        ("yes", {}),
        ("on", {}),
        ('{"exclude": ["lora_reentrant_checkpointing"], "strict": true}', {"exclude": [LORA], "strict": True}),
    ],
)
def test_auto_grammar(value, meaning):
    assert settings.parse_auto(value) == meaning


@pytest.mark.parametrize(
    "value, hint",
    [
        ("[1]", "expected 0/false/no/off, 1/true/yes/on, or a JSON object"),
        ('{"exclud": []}', "did you mean 'exclude'"),
        ("maybe", "expected 0/false/no/off"),
        ("{not json", "not valid JSON"),
        ('{"strict": "yes"}', "strict must be true or false"),
        ('{"propagate": true}', "unknown key 'propagate'"),
    ],
)
def test_auto_rejects_everything_else(value, hint):
    with pytest.raises(ValueError, match=r"^FTSHIMS_AUTO=") as caught:
        settings.parse_auto(value)
    assert hint in str(caught.value)


def _python(code: str, env: dict, flags=()) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    # site-packages as a plain path entry: importable, but its .pth files (an installed hook) do not run under -S
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), sysconfig.get_path("purelib"), full.get("PYTHONPATH", "")])
    full.update(env)
    return subprocess.run(
        [sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=300
    )


STATUSES = """
import json, ftshims
print(json.dumps(sorted(e.id for e in ftshims.status() if e.active)))
"""


@pytest.mark.parametrize(
    "env",
    [
        {"FTSHIMS_AUTO": "[1]"},
        {"FTSHIMS_AUTO": '{"exclud": []}'},
        {"FTSHIMS_AUTO": "maybe"},
        {"FTSHIMS_AUTO": '{"only": ["nope"]}'},
        {"FTSHIMS_AUTO": "1", "FTSHIMS_DISABLE": "nope"},
        {"FTSHIMS_AUTO": "1", POLICY_ENV: "explode"},
    ],
)
def test_start_up_hook_with_a_bad_setting_prints_one_line_and_applies_nothing(env):
    result = _python("import ftshims.auto\n" + STATUSES, env)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ftshims: ") and "no shims applied" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_start_up_hook_off_and_on():
    off = _python("import ftshims.auto\n" + STATUSES, {"FTSHIMS_AUTO": "false"})
    assert off.returncode == 0 and off.stderr == "", off.stderr
    assert json.loads(off.stdout.strip().splitlines()[-1]) == []
    on = _python("import ftshims.auto\n" + STATUSES, {"FTSHIMS_AUTO": "yes"})
    assert on.returncode == 0, on.stderr
    active = json.loads(on.stdout.strip().splitlines()[-1])
    assert active == sorted(
        e.id for e in _manager.apply() if e.active
    ), "FTSHIMS_AUTO=yes applies what apply() applies"


def test_the_hook_line_leaves_the_value_to_ftshims_auto():
    # -S: no site-packages, so no installed .pth runs; the line is executed as site.py would.
    code = hook.LINE + "import sys\nprint('ftshims.auto' in sys.modules)\n"
    assert _python(code, {}, flags=("-S",)).stdout.strip() == "False"  # unset: only a dict lookup
    for value in ("0", "false", "{...}"):
        result = _python(code, {"FTSHIMS_AUTO": value}, flags=("-S",))
        assert result.stdout.strip() == "True" and result.returncode == 0
        assert len(result.stderr.strip().splitlines()) == (1 if value == "{...}" else 0), result.stderr


# -- FTSHIMS_ROTARY_BACKEND ----------------------------------------------------------------------


def test_rotary_backend_is_checked_when_a_rotary_shim_is_selected(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cpuu")
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV}: got 'cpuu'.*did you mean 'cpu'"):
        ftshims.apply(include=["rope_fused_kernel"])
    assert _nothing_active()
    ftshims.apply(only=[LORA])  # no rotary shim selected: the kernel's variable is not apply()'s business here


def test_rotary_backend_reference_never_builds_the_extension(monkeypatch):
    pytest.importorskip("transformers")
    import torch

    from ftshims.kernels import _build, rotary
    from ftshims.shims import flash_attn_rotary_kernel, rope_fused_kernel

    def refuse(*args, **kwargs):
        raise AssertionError("the C++ extension was loaded or built although FTSHIMS_ROTARY_BACKEND=reference")

    monkeypatch.setattr(_build, "load", refuse)
    monkeypatch.setattr(_build, "jit_build", refuse)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    report = ftshims.apply(only=["rope_fused_kernel"])
    assert report["rope_fused_kernel"].active, report["rope_fused_kernel"].reason
    from transformers.models.llama import modeling_llama

    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    before = dict(rope_fused_kernel.STATS)
    modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert rope_fused_kernel.STATS["fallback"] == before["fallback"] + 1  # transformers' own code ran
    assert rope_fused_kernel.STATS["fused"] == before["fused"]
    # The kernel called directly, and flash-attn's core on it, take the reference too.
    x = torch.randn(2, 5, 3, 8)
    rotary.apply_rotary(x, rope_theta=10000.0)
    table = torch.randn(9, 4)
    flash_attn_rotary_kernel.rotary_core(x, table, table, seqlen_offsets=2)


def test_rotary_backend_bad_value_from_the_kernel(monkeypatch):
    import torch

    from ftshims.kernels import rotary

    monkeypatch.setenv(BACKEND_ENV, "refrence")
    with pytest.raises(ValueError, match=rf"{BACKEND_ENV}: got 'refrence'.*did you mean 'reference'"):
        rotary.apply_rotary(torch.randn(1, 2, 1, 4), rope_theta=10000.0)


# -- the doctor, and the logs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, value",
    [("FTSHIMS_DISABLE", "nope"), ("FTSHIMS_AUTO", "[1]"), (POLICY_ENV, "explode"), (BACKEND_ENV, "gpu"),
     (settings.CANARY_CACHE_ENV, __file__)],  # the canary's cache must be a directory, not a file
)
def test_doctor_reports_a_bad_setting_as_a_problem(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    report = collect(QUICK)
    problems = [p for p in report["summary"]["problems"] if p["source"] == "setting"]
    assert [p["id"] for p in problems] == [name] and value in problems[0]["message"]
    assert report["summary"]["exit_code"] == 1
    assert report["ftshims"]["env_errors"][0]["variable"] == name
    assert report["errors"] == []  # a bad setting is the user's problem, not a failed doctor step
    assert report["shims"], "the shims are still listed (from version gating)"
    assert _nothing_active()


def test_doctor_has_no_setting_problem_for_good_values(monkeypatch):
    monkeypatch.setenv(settings.DISABLE_ENV, "lora-reentrant-checkpointing all")
    monkeypatch.setenv(settings.AUTO_ENV, '{"include": ["rope_fused_kernel"]}')
    monkeypatch.setenv(POLICY_ENV, "Warn")
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert settings.environment_problems() == []


def test_log_messages_carry_no_doubled_prefix(caplog):
    with caplog.at_level(logging.INFO, logger="ftshims"):
        ftshims.apply()
    assert caplog.records
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("ftshims:")]


def test_shim_warnings_point_at_the_callers_frame():
    pytest.importorskip("transformers")
    from ftshims.shims import max_positions_guard as guard

    ftshims.apply(only=[GUARD], options={GUARD: {"policy": "warn"}})
    model = guard.build("llama")
    ids = __import__("torch").randint(3, 100, (1, guard.LONG))
    with pytest.warns(guard.PositionLimitWarning) as caught:
        model(input_ids=ids)
    assert caught[0].filename == __file__
