"""Every setting is checked when it is given; FTSHIMS_MONITOR attaches the callback to every Trainer through
the start-up hook and ftshims' Patcher, and ftshims.revert() removes it; importing the monitor stays light."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ftshims
import ftshims.monitor
from ftshims import hook, settings
from ftshims.monitor import attach

from .runs import default_stack_only

ROOT = Path(__file__).resolve().parents[2]

BAD_OPTIONS = [
    ({"polcy": "warn"}, "unknown option 'polcy'", "did you mean 'policy'?"),
    ({"policy": "rise"}, "got 'rise'", "did you mean 'raise'?"),
    ({"policy": {"loss_spik": "raise"}}, "unknown detector code 'loss_spik'", "did you mean 'loss_spike'?"),
    ({"policy": {"loss_spike": "stop"}}, "got 'stop'", "allowed: warn, raise"),
    ({"off": ["nan_loss"]}, "unknown detector code 'nan_loss'", "allowed: nothing_trainable"),
    ({"off": 3}, "expected a list of detector codes", ""),
    ({"warmup": 0}, "expected a positive int", ""),
    ({"grad_steps": True}, "expected a positive int", ""),
    ({"spike_sigmas": -1}, "expected a positive number", ""),
    ({"read": "sometimes"}, "got 'sometimes'", "allowed: auto, step, log"),
    ({"localize": "yes"}, "expected true or false", ""),
    ({"log": "/no/such/dir/run.jsonl"}, "directory /no/such/dir does not exist", ""),
    ({"data_steps": 0}, "expected a positive int", ""),
    ({"loss_steps": 1}, "expected an int >= 2", ""),
    ({"loss_steps": 2.5}, "expected an int >= 2", ""),
    ({"no_target_share": 1.5}, "expected a share in [0, 1)", ""),
    ({"truncated_share": 1}, "expected a share in [0, 1)", ""),
    ({"padding_share": "0.1"}, "expected a share in [0, 1)", ""),
    ({"shifted_share": True}, "expected a share in [0, 1)", ""),
    ({"lr_zero_share": -0.1}, "expected a share in [0, 1)", ""),
    ({"doubled_share": None}, "expected a share in [0, 1)", ""),
    ({"off": ["bos_double"]}, "unknown detector code 'bos_double'", "did you mean 'bos_doubled'?"),
    # issue 35: the skip defence and learning progress
    ({"policy": {"labels_all_ignored": "skip"}}, "'labels_all_ignored' takes 'warn' or 'raise'", "allowed: warn, raise"),
    ({"policy": "skip"}, "got 'skip'", "allowed: warn, raise"),
    ({"policy": {"nonfinite_loss": "skp"}}, "got 'skp'", "did you mean 'skip'?"),
    ({"max_skips": 0}, "expected a positive int", ""),
    ({"diverge_steps": 2.0}, "expected a positive int", ""),
    ({"diverge_factor": 1}, "expected a number > 1", ""),
    ({"update_every": -1}, "expected a positive int", ""),
    ({"update_ratio_min": 0}, "expected a positive number", ""),
    ({"update_ratio_max": float("inf")}, "expected a positive number", ""),
    ({"update_ratio_min": 2.0}, "must be below update_ratio_max", ""),
    ({"lost_share": 1.0}, "expected a share in [0, 1)", ""),
    ({"off": ["update_lost"]}, "unknown detector code 'update_lost'", "did you mean 'updates_lost'?"),
]

pytestmark = default_stack_only


@pytest.mark.parametrize("given,problem,hint", BAD_OPTIONS, ids=[str(list(b[0])[0]) + "-" + str(i) for i, b in enumerate(BAD_OPTIONS)])
def test_bad_option_raises_when_given(given, problem, hint):
    for make in (ftshims.monitor.callback, ftshims.monitor.attach_to_trainers):
        with pytest.raises(ValueError) as raised:
            make(**given)
        assert problem in str(raised.value) and hint in str(raised.value)
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        settings.parse_monitor(json.dumps(given))
    assert not attach.attached()


def test_monitor_rejects_bad_options_before_touching_the_model():
    import torch

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown option 'warmpu'"):
        ftshims.monitor.Monitor(model, warmpu=3)
    assert not model._forward_pre_hooks and not model._forward_hooks


@pytest.mark.parametrize("raw,problem", [
    ("2", "expected 0/false/no/off, 1/true/yes/on, or a JSON object"),
    ("{not json", "not valid JSON"),
    ('{"policy": "loud"}', "got 'loud'"),
    ('{"every": 3}', "unknown option 'every'"),
])
def test_bad_ftshims_monitor_value(raw, problem, tmp_path):
    with pytest.raises(ValueError, match=problem):
        settings.parse_monitor(raw)
    problems = settings.environment_problems({"FTSHIMS_MONITOR": raw})
    assert [p["variable"] for p in problems] == ["FTSHIMS_MONITOR"] and problem in problems[0]["message"]


def test_ftshims_monitor_values():
    for off in ("", " ", "0", "false", "No", "off"):
        assert settings.parse_monitor(off) is None
    for on in ("1", "true", "YES", "on"):
        assert settings.parse_monitor(on) == {}
    assert settings.parse_monitor('{"policy": "raise", "off": ["loss_spike"]}') == {"policy": "raise", "off": ["loss_spike"]}


def test_ftshims_monitor_log(tmp_path):
    assert settings.parse_monitor_log("") is None
    assert settings.parse_monitor_log(str(tmp_path / "run.jsonl")) == str(tmp_path / "run.jsonl")
    with pytest.raises(ValueError, match="is a directory"):
        settings.parse_monitor_log(str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        settings.parse_monitor_log(str(tmp_path / "missing" / "run.jsonl"))
    problems = settings.environment_problems({"FTSHIMS_MONITOR_LOG": str(tmp_path)})
    assert [p["variable"] for p in problems] == ["FTSHIMS_MONITOR_LOG"]


def test_attach_to_trainers_goes_through_the_patcher_and_revert_removes_it():
    from transformers import Trainer

    from ftshims import _manager

    init, revert = Trainer.__init__, _manager.revert
    ftshims.monitor.attach_to_trainers(warmup=5)
    assert attach.attached() and Trainer.__init__ is not init and _manager.revert is revert  # ftshims itself unpatched
    ftshims.revert(only=["packing_block_mask"])  # a narrowed revert leaves the monitor attached
    assert attach.attached()
    ftshims.revert()
    assert not attach.attached() and Trainer.__init__ is init and not _manager._ON_FULL_REVERT


def test_attached_monitor_joins_every_trainer_once():
    from ftshims import tiny
    from ftshims.monitor.trainer import MonitorCallback

    from .runs import corpus, rows_dataset, train

    ftshims.apply()
    ftshims.monitor.attach_to_trainers()
    result = train(tiny.tiny_llama(), rows_dataset(corpus(n=8, seq=8)), max_steps=1)
    callbacks = [cb for cb in result.trainer.callback_handler.callbacks if isinstance(cb, MonitorCallback)]
    assert callbacks == [result.callback], "the trainer's own monitor callback is kept; no second one"
    from transformers import Trainer

    from .runs import training_args

    plain = Trainer(model=tiny.tiny_llama(), args=training_args(str(ROOT / ".pytest-monitor-unused")))
    assert sum(isinstance(cb, MonitorCallback) for cb in plain.callback_handler.callbacks) == 1
    ftshims.revert()
    plain = Trainer(model=tiny.tiny_llama(), args=training_args(str(ROOT / ".pytest-monitor-unused")))
    assert not any(isinstance(cb, MonitorCallback) for cb in plain.callback_handler.callbacks)


def _python(code: str, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    environ.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=300)


START_UP = """
import sys
exec({line!r})  # what site.py does with the hook file's line at start-up
from ftshims.monitor import attach
waiting = attach._PATCHER[0].waiting if attach._PATCHER else None
print("ATTACHED", attach.attached(), waiting, sorted(m for m in ("torch", "transformers") if m in sys.modules))
import ftshims
print("ACTIVE", [e.id for e in ftshims.status() if e.active])
"""


def test_start_up_hook_attaches_on_ftshims_monitor_alone():
    result = _python(START_UP.format(line=hook.LINE), FTSHIMS_MONITOR="1")
    assert result.returncode == 0, result.stderr
    # waiting for transformers.trainer (Trainer.__init__ is wrapped when it is imported); nothing heavy imported
    assert "ATTACHED True ['transformers.trainer'] []" in result.stdout, result.stdout + result.stderr
    assert "ACTIVE []" in result.stdout, "FTSHIMS_MONITOR alone applies no shim"


def test_start_up_hook_with_a_bad_value_prints_one_line_and_attaches_nothing():
    result = _python(START_UP.format(line=hook.LINE), FTSHIMS_MONITOR='{"policy": "loud"}')
    assert result.returncode == 0, result.stderr
    assert "ATTACHED False None []" in result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("ftshims: ")]
    assert len(lines) == 1 and "FTSHIMS_MONITOR" in lines[0] and "monitor not attached" in lines[0], result.stderr


def test_ftshims_auto_also_attaches_it():
    """ftshims.auto imports the monitor's start-up module too: a hook file from before the monitor (one that
    only knows FTSHIMS_AUTO) still attaches it."""
    result = _python(START_UP.format(line="import ftshims.auto"), FTSHIMS_AUTO="0", FTSHIMS_MONITOR="1")
    assert result.returncode == 0, result.stderr
    assert "ATTACHED True ['transformers.trainer']" in result.stdout and "ACTIVE []" in result.stdout


def test_importing_the_monitor_is_light():
    result = _python("import sys, ftshims.monitor, ftshims.monitor.options, ftshims.monitor.report; "
                     "print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules))")
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_every_catalogue_link_and_code_is_real():
    """The symptom -> catalogue table names only registered shims and advisories; every code has its detector."""
    from ftshims import advisories, registry
    from ftshims.monitor import catalogue, options
    from ftshims.monitor.detectors import all_detectors

    known = set(registry.ids()) | {a.id for a in advisories.load()}
    for code, ids in catalogue.LINKS.items():
        assert code in options.CODES
        assert set(ids) <= known, (code, set(ids) - known)
    codes = [code for detector in all_detectors() for code in detector.codes]
    assert sorted(codes) == sorted(options.CODES), "one detector per code, each code with its detector"
    assert all(severity in ("error", "warning", "info") for severity, _ in options.CODES.values())


def test_data_check_options_are_normalised():
    from ftshims.monitor import options

    checked = options.check({"padding_share": 0, "no_target_share": 0.5, "loss_steps": 3, "data_steps": 2})
    assert checked["padding_share"] == 0.0 and isinstance(checked["padding_share"], float)
    assert checked["no_target_share"] == 0.5 and checked["loss_steps"] == 3 and checked["data_steps"] == 2
    assert set(options.SHARES) <= set(options.DEFAULTS)
    assert all(0 <= options.DEFAULTS[name] < 1 for name in options.SHARES)


def test_options_and_settings_import_one_way():
    """settings -> monitor.options -> _setting_base, and settings -> _setting_base: no circle. The error format
    and the log path are the same functions from both."""
    import ast

    from ftshims import _setting_base
    from ftshims.monitor import options

    def imported(path):
        tree = ast.parse((ROOT / path).read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names.update(f"{base}.{alias.name}" if not node.module else base for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        return names

    assert not {n for n in imported("ftshims/monitor/options.py") if n.endswith("settings")}, "options imports settings"
    assert not {n for n in imported("ftshims/_setting_base.py") if n.startswith(".") or n.startswith("ftshims")}
    assert settings.invalid is _setting_base.invalid is options.invalid
    assert settings.parse_monitor_log is _setting_base.parse_monitor_log is options.parse_monitor_log
    for first in ("ftshims.monitor.options", "ftshims.settings"):  # either import order works on its own
        result = _python(ONE_WAY.format(first=first))
        assert result.returncode == 0 and result.stdout.strip() == "{'warmup': 3}", result.stdout + result.stderr


ONE_WAY = """
import {first}, ftshims.settings as s
print(s.parse_monitor('{{"warmup": 3}}'))
"""
