"""Shared fixtures. The ``evidence`` fixture records, per shim and scenario, whether the
bug reproduced without the shim and whether it was gone with it. When
``FTSHIMS_EVIDENCE_OUT`` names a file, the records of the whole session are written
there as JSON (only from tests that passed); ``python -m ftshims.matrix --record`` turns a
complete matrix run into ftshims/data/verified.json,
which COMPAT_MATRIX.md is generated from.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


_RECORDS: dict = {}

try:
    from hypothesis import settings as _hypothesis_settings

    # Default runs stay quick; the rotary_flash session fuzzes the kernel with thousands of cases.
    _hypothesis_settings.register_profile("default", max_examples=60)
    _hypothesis_settings.register_profile("fuzz", max_examples=3000)
    _hypothesis_settings.load_profile("default")
except ImportError:  # hypothesis is a test dependency; the kernel fuzz tests skip without it
    pass


class Evidence:
    """One test's reproductions. They reach the evidence file only if the test passes
    (see ``pytest_runtest_makereport``): a failed or skipped test proves nothing."""

    def __init__(self, test_id: str):
        self.test_id = test_id
        self.pending = []

    def record(self, outcome, scenario: str, expect_bug: bool = True) -> None:
        """Record a :class:`ftshims.probing.ProbeOutcome` (``expect_bug``: whether the scenario shows the bug in range)."""
        self.record_raw(
            outcome.shim_id, scenario, outcome.affected, outcome.without.bug, outcome.with_shim.bug,
            outcome.status.status, expect_bug=expect_bug, without=outcome.without.detail, with_shim=outcome.with_shim.detail,
        )

    def record_raw(self, shim_id: str, scenario: str, affected: bool, bug_without: bool, bug_with: bool, status: str,
                   expect_bug: bool = True, without: str = "", with_shim: str = "") -> None:
        """Record a reproduction a test ran by hand (a real trainer path, say); ``without``/``with_shim``
        say what was measured each way."""
        self.pending.append((shim_id, scenario, {
            "affected": bool(affected),
            "expect_bug": bool(expect_bug),
            "bug_without_shim": bool(bug_without),
            "bug_with_shim": bool(bug_with),
            "status": status,
            "test": self.test_id,
            "without": str(without)[:300],
            "with_shim": str(with_shim)[:300],
        }))


# Tests of ftshims' own machinery (patching, kernels, the lint, the matrix tooling, process
# start-up): they do not depend on the transformers/peft/trl versions, so the pinned-version
# matrix leaves them to the default stack (nox -s tests) and spends its budget on the shims.
DEFAULT_STACK_ONLY = (
    "tests/kernels/",
    "tests/registry/",
    "tests/lint/",
    "tests/e2e/test_distributed.py",
    "tests/lifecycle/test_apply_revert.py",
    "tests/lifecycle/test_settings.py",
    "tests/lifecycle/test_release_pin.py",
    # the monitor's machinery; its catalogue-linked detectors run on every stack where their bug exists
    "tests/monitor/test_options.py",
    "tests/monitor/test_custom_loop_and_report.py",
    "tests/monitor/test_healthy.py",
    "tests/monitor/test_trl_healthy.py",
    "tests/monitor/test_distributed.py",
    # the monitor's data/configuration checks read batches and the Trainer's schedule, not a shim's target
    "tests/monitor/test_data_checks.py",
    # the doctor's and the start-up machinery (output formats, usage errors, fault injection, the probe worker's
    # protocol, the exit summary): what the installed versions change is in the real-stack tests, which stay
    "tests/doctor/test_faults.py",
    *(f"tests/doctor/test_doctor.py::{name}" for name in (
        "test_text_markdown_json_formats", "test_exit_0_when_every_affected_bug_is_patched",
        "test_exit_1_when_a_known_bug_stays_unpatched", "test_speed_shims_and_unaffected_shims_never_exit_1",
        "test_usage_errors_exit_2", "test_usage_error_exit_2_from_the_command_line",
        "test_importing_the_doctor_imports_no_heavy_package", "test_no_import_statuses_come_from_version_gating",
        "test_a_patched_module_that_raises_on_import_is_reported", "test_torch_whose_import_raises_from_the_command_line",
        "test_a_failing_step_is_reported_and_the_rest_still_runs", "test_a_shim_module_that_raises_on_import",
        "test_a_renderer_bug_falls_back_to_json", "test_broken_metadata_of_a_gating_package",
        "test_metadata_lookup_that_raises", "test_flash_attn_", "test_torch_details_on_a_fake_cuda_torch",
        "test_tested_stack_exact_match", "test_tested_stack_nearest_by_transformers_then_peft_then_trl",
        "test_tested_stack_compares_torch_too", "test_tested_stack_is_unknown_without_tomllib",
        "test_packages_without_bytecode_are_a_warning_only_when_python_will_not_write_it")),
    *(f"tests/doctor/test_probes.py::{name}" for name in (
        "test_hanging_and_crashing_probes_cannot_stop_the_others", "test_a_hanging_probe_is_killed_with_its_process_group",
        "test_probe_output_cannot_corrupt_the_protocol", "test_a_server_that_cannot_start_stops_the_run_with_a_reason",
        "test_the_doctor_runs_its_own_trial_when_the_server_cannot_start",
        "test_the_probe_environment_is_offline_and_unpatched", "test_the_worker_refuses_network_connections",
        "test_disabled_or_unfixing_shim_is_an_unpatched_bug", "test_cli_probe_exit_codes_and_clean_json",
        "test_speed_shims_are_probed_only_with_probe_all", "test_probe_usage_errors_exit_2",
        "test_summary_counts_probe_problems_from_rows", "test_probe_keys_and_values_are_documented")),
    "tests/lifecycle/test_effects.py::test_counts_start_again_with_each_installation",
    "tests/lifecycle/test_effects.py::test_exit_summary_is_opt_in_and_rank_0_only",
    "tests/lifecycle/test_effects.py::test_bad_summary_setting_is_an_error_at_apply",
    "tests/lifecycle/test_hardening.py::test_module_raising_on_import_never_breaks_apply",
    # engines and accelerate's clipping path: the default stack and the newest (below)
    "tests/monitor/test_grad_norm.py",
    "tests/monitor/test_deepspeed.py",
    "tests/deepspeed/",
    "tests/lifecycle/test_compile.py::test_wrapper_effect_is_in_the_compiled_graph_and_gone_after_revert",
    "tests/lifecycle/test_compile.py::test_default_shims_keep_transformers_compile_paths_working[llama-sdpa]",
    "tests/lifecycle/test_compile.py::test_default_shims_keep_transformers_compile_paths_working[mistral-sdpa]",
)
# ... except on a stack with a torch of its own (``torch = "..."`` in stacks.toml): what torch changes between
# releases (cpp_extension for the kernels, dynamo, the distributed APIs) runs there too.
# The same stack is the newest of everything (accelerate 1.16's clipping path, DeepSpeed on the newest transformers).
# The monitor's DeepSpeed runs (~160 s) stay on the default stack: what they read (the engine's norm, its
# partitioned gradients) is DeepSpeed's, pinned to the same release on both stacks.
TORCH_DEPENDENT = ("tests/kernels/", "tests/lifecycle/test_compile.py", "tests/e2e/test_distributed.py",
                   "tests/monitor/test_grad_norm.py", "tests/deepspeed/")
# torch.compile over the shims changes with transformers' mask and attention code, which changes by era, not with
# every release: besides the default stack and a stack with its own torch, one stack per era runs the compile tests
# (the _expand_mask era, 4.37's converter, 4.38's _update_causal_mask, masking_utils, v5 at the newest). They are
# half of a matrix stack's time (~60 s of ~250 s): 4.46 (the same _update_causal_mask era as 4.38) and the early-5.x
# stack (the same v5 masking_utils as the newest) were dropped from the list to keep CI within its hour.
COMPILE_TESTS = "tests/lifecycle/test_compile.py"
COMPILE_STACKS = ("t4_34", "t4_37", "t4_38", "t4_53", "t5_25")
# The doctor's whole probe run in its worker process (~30 s a stack): every probe also runs in its shim's own test on
# every stack, in process; the worker path runs on the oldest stack, one per mask era and the newest.
REAL_PROBE_RUN = "tests/doctor/test_probes.py::test_real_probe_run_end_to_end"
REAL_PROBE_STACKS = ("t4_30", "t4_37", "t4_46", "t4_53", "t5_1", "t5_25")


def pytest_addoption(parser):
    parser.addoption(
        "--noop-shim", action="append", default=[], metavar="ID",
        help="mutation check: install shim ID as a no-op (tests/noop_shims.py); its tests must then fail",
    )


def pytest_configure(config):
    if config.getoption("--noop-shim"):
        from tests.noop_shims import make_noop

        make_noop(config.getoption("--noop-shim"))


def _on_a_matrix_stack() -> bool:
    """Whether this run is one of the pinned-version matrix's non-default stacks."""
    from ftshims import datafiles

    return os.environ.get("FTSHIMS_STACK") in datafiles.matrix_stacks()


def _stack_has_its_own_torch() -> bool:
    from ftshims import datafiles

    return bool(datafiles.stacks().get(os.environ.get("FTSHIMS_STACK"), {}).get("torch"))


def pytest_collection_modifyitems(config, items):
    if not _on_a_matrix_stack():
        return
    own_torch = _stack_has_its_own_torch()
    compile_era = os.environ.get("FTSHIMS_STACK") in COMPILE_STACKS
    keep, dropped = [], []
    for item in items:
        default_only = item.nodeid.startswith(DEFAULT_STACK_ONLY)
        if default_only and own_torch and item.nodeid.startswith(TORCH_DEPENDENT):
            default_only = False
        if item.nodeid.startswith(COMPILE_TESTS) and not (compile_era or own_torch):
            default_only = True
        if item.nodeid.startswith(REAL_PROBE_RUN) and os.environ.get("FTSHIMS_STACK") not in REAL_PROBE_STACKS:
            default_only = True
        (dropped if default_only else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def evidence(request):
    recorder = Evidence(request.node.nodeid)
    request.node.ftshims_evidence = recorder
    return recorder


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Commit a test's evidence once its body has passed, after every assertion in it."""
    outcome = yield
    report = outcome.get_result()
    recorder = getattr(item, "ftshims_evidence", None)
    if recorder is not None and report.when == "call" and report.passed:
        for shim_id, scenario, entry in recorder.pending:
            _RECORDS.setdefault(shim_id, {})[scenario] = entry


@pytest.fixture(autouse=True)
def _no_shims_leak():
    """Every test starts and ends with no shim active, whatever it did in between."""
    import ftshims

    ftshims.revert()
    yield
    ftshims.revert()


@pytest.fixture(autouse=True)
def _fresh_accelerate_settings():
    """A Trainer leaves its settings behind for every Trainer built after it in the process: TrainingArguments
    exports ``ACCELERATE_MIXED_PRECISION`` (bf16, TRL's configs' default), which the next Accelerator reads, so a
    later fp32 test ran under bf16 autocast (a 3.7e-4 gap in a negative control, 0.2510 vs 0.2516 gradient
    norms, only in the full suite). Each test gets the process's ``ACCELERATE_*`` environment back."""
    from ftshims.probing import accelerate_environment_kept

    with accelerate_environment_kept():
        yield


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("FTSHIMS_EVIDENCE_OUT")
    if not out:
        return
    from ftshims import registry
    from ftshims.versions import installed_versions

    payload = {
        "stack": os.environ.get("FTSHIMS_STACK", "local"),
        "versions": installed_versions(("torch",) + registry.packages() + ("accelerate", "datasets")),
        "results": _RECORDS,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
