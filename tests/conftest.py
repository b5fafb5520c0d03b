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
