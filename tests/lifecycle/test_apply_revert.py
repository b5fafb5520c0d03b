"""The lifecycle machinery (``apply`` / ``revert`` / ``status`` / ``applied``), proven on fake shims.

The fakes (tests/fakes.py) patch a throwaway package, so every promise is checked
on an object the test controls: apply wraps and revert restores identity, cycle
after cycle; a second apply (sequential, from 8 threads, racing the import) wraps
once; each kind of slot (function, method, staticmethod, classmethod, inherited
attribute, mapping item, alias, constant) is restored; deferral to import hooks
(several modules, parts, half-imported and failing modules); every status and
reason apply() can report (disabled, not needed, deferred, applied, target
missing, failed) with rollback of whatever a failing install had patched;
selection, options, the report, logging. How the machinery handles a fault is
proven here, on fakes; nothing here depends on the transformers/peft/trl
versions, so conftest.DEFAULT_STACK_ONLY runs this file on the default stack only.

Left to the others: whether each *real* registered shim keeps these promises
in the installed stack (test_real_shims.py), and whether it holds up when its
own targets vanish or change, its modules raise on import, or threads race it
(test_hardening.py). The grammar of settings and FTSHIMS_* variables is
test_settings.py's.
"""

from __future__ import annotations

import logging
import sys
import threading

import pytest
from tests.fakes import FakeWorld, add_one_more, at_once_on_threads, wrap_add

import ftshims
from ftshims import _manager, patching
from ftshims.spec import Choice, Target, TargetMissing


@pytest.fixture
def world(tmp_path, monkeypatch):
    w = FakeWorld(tmp_path, monkeypatch)
    yield w
    w.cleanup()


def test_apply_wraps_and_revert_restores_identity_every_cycle(world):
    world.add_shim("wrap_add", wrap_add)
    target = world.module()
    original = target.add
    for cycle in range(5):
        report = ftshims.apply()
        assert report["wrap_add"].status == "applied", f"cycle {cycle}"
        assert target.add is not original and target.add(1) == 3, f"cycle {cycle}"
        assert target.add.__wrapped__ is original, f"cycle {cycle}"
        ftshims.revert()
        assert target.add is original, f"cycle {cycle}"
        assert ftshims.status()["wrap_add"].status == "not applied", f"cycle {cycle}"


def test_a_function_copying_a_wrappers_metadata_is_not_a_wrapper(world):
    """``functools.wraps`` copies __dict__: a function defined with ``@wraps`` of a patched one (TRL 0.8's
    ``SFTTrainer.train`` is ``@wraps(Trainer.train)``) carries ftshims' mark without being one of its layers."""
    import functools

    world.add_shim("wrap_add", wrap_add)
    target = world.module()
    ftshims.apply()
    assert patching.is_shim_wrapper(target.add)

    @functools.wraps(target.add)
    def theirs(*args):
        return target.add(*args)

    assert "__ftshims_shim__" in vars(theirs) and not patching.is_shim_wrapper(theirs)
    ftshims.revert()
    assert not patching.is_shim_wrapper(target.add)


def test_apply_is_idempotent(world):
    world.add_shim("wrap_add", wrap_add)
    target = world.module()
    ftshims.apply()
    wrapped_once = target.add
    second = ftshims.apply()
    assert target.add is wrapped_once, "a second apply() must change nothing"
    assert target.add(1) == 3, "wrapped exactly once"
    assert second["wrap_add"].status == "applied"


def test_methods_staticmethods_classmethods_and_inherited(world):
    target = world.module()
    raw = dict(vars(target.Greeter))

    def install(patcher, options):
        patcher.wrap(target.Greeter, "greet", lambda w, i, a, k: w(*a, **k) + "!")
        patcher.wrap(target.Greeter, "shout", lambda w, i, a, k: w(*a, **k) + "!")
        patcher.wrap(target.Greeter, "make", lambda w, i, a, k: (w(*a, **k), "made")[1])
        patcher.wrap(target.Child, "greet", lambda w, i, a, k: w(*a, **k) + "?")

    world.add_shim("methods", install)
    ftshims.apply()
    assert target.Greeter().greet("a") == "hello a!"
    assert target.Greeter.shout("x") == "X!" and target.Greeter().shout("x") == "X!"
    assert target.Greeter.make() == "made"
    assert target.Child().greet("b") == "hello b!?"
    assert target.Greeter.greet(target.Greeter(), "c") == "hello c!", "unbound call through the class"
    ftshims.revert()
    for name in ("greet", "shout", "make"):
        assert vars(target.Greeter)[name] is raw[name]
    assert "greet" not in vars(target.Child), "an inherited attribute is deleted again, not shadowed"


def test_mapping_items(world):
    target = world.module()
    original = target.REGISTRY["double"]
    world.add_shim("item", lambda p, o: p.wrap_item(target.REGISTRY, "double", add_one_more))
    ftshims.apply()
    assert target.REGISTRY["double"](2) == 5
    ftshims.revert()
    assert target.REGISTRY["double"] is original


def test_aliases_are_wrapped_and_restored(world):
    target = world.module()
    other = world.module("other")
    original = target.add
    world.add_shim("aliases", lambda p, o: p.wrap_aliases(original, add_one_more, packages=(world.package,)))
    ftshims.apply()
    assert other.add(1) == 3 and target.add(1) == 3
    ftshims.revert()
    assert other.add is original and target.add is original


def test_deferred_until_import(world):
    world.add_shim("wrap_add", wrap_add)
    assert world.target_module not in sys.modules
    report = ftshims.apply()
    assert report["wrap_add"].status == "deferred"
    assert world.target_module in report["wrap_add"].reason
    target = world.module()  # the post-import hook installs the shim now
    assert ftshims.status()["wrap_add"].status == "applied"
    assert target.add(1) == 3


def test_revert_cancels_a_deferred_shim(world):
    world.add_shim("wrap_add", wrap_add)
    ftshims.apply()
    ftshims.revert()
    target = world.module()
    assert target.add(1) == 2, "a reverted deferred shim must not install on import"
    assert ftshims.status()["wrap_add"].status == "not applied"


def test_deferred_waits_for_every_module(world):
    def install(patcher, options):
        patcher.wrap(sys.modules[world.target_module], "add", add_one_more)

    world.add_shim("two_modules", install, modules=(world.target_module, f"{world.package}.other"))
    ftshims.apply()
    import importlib

    importlib.import_module(world.target_module)
    # "other" imports target, so import target alone first: still waiting for "other"
    assert ftshims.status()["two_modules"].status == "deferred"
    world.module("other")
    assert ftshims.status()["two_modules"].status == "applied"


def test_missing_target_is_skipped_and_nothing_stays_patched(world):
    target = world.module()
    original = target.add

    def install(patcher, options):
        patcher.wrap(target, "add", add_one_more)
        raise TargetMissing("fake: target.vanished not found")

    world.add_shim("missing", install)
    report = ftshims.apply()
    assert report["missing"].status == "target missing"
    assert "vanished" in report["missing"].reason
    assert target.add is original, "the part installed before the failure was rolled back"


def test_declared_target_missing_or_changed(world):
    world.module()
    world.add_shim("absent", wrap_add, targets=[Target(world.target_module, "nope")])
    world.add_shim("changed", wrap_add, targets=[Target(world.target_module, "add", params=("x", "z"))])
    world.add_shim("fine", wrap_add, targets=[Target(world.target_module, "add", params=("x", "y"))])
    report = ftshims.apply()
    assert report["absent"].status == "target missing"
    assert report["changed"].status == "target missing" and "signature changed" in report["changed"].reason
    assert report["fine"].status == "applied"


def test_declared_target_outside_its_when_range_is_not_checked(world):
    world.module()
    world.add_shim("old_only", wrap_add, targets=[Target(world.target_module, "nope", when="<1", distribution="packaging")])
    assert ftshims.apply()["old_only"].status == "applied"


def test_install_exception_rolls_back_and_reports(world, caplog):
    target = world.module()
    original = target.add

    def install(patcher, options):
        patcher.wrap(target, "add", add_one_more)
        raise ZeroDivisionError("boom")

    world.add_shim("explodes", install)
    with caplog.at_level(logging.WARNING, logger="ftshims"):
        report = ftshims.apply()
    assert report["explodes"].status == "failed"
    assert "ZeroDivisionError: boom" in report["explodes"].reason
    assert target.add is original
    assert any("explodes" in r.getMessage() for r in caplog.records)


def test_strict_raises(world):
    world.module()

    def install(patcher, options):
        raise ZeroDivisionError("boom")

    world.add_shim("explodes", install)
    with pytest.raises(ftshims.ShimError, match="explodes"):
        ftshims.apply(strict=True)


def test_module_raising_on_import_leaves_shim_deferred(world):
    world.add_shim("on_broken", wrap_add, modules=(f"{world.package}.broken",))
    report = ftshims.apply()  # must not raise: apply imports nothing
    assert report["on_broken"].status == "deferred"
    with pytest.raises(RuntimeError, match="broken on purpose"):
        world.module("broken")  # the user's import fails as it would without ftshims
    assert ftshims.status()["on_broken"].status == "deferred"


def test_failing_deferred_part_rolls_back_whole_shim(world):
    target = world.module()
    original = target.add

    def install(patcher, options):
        patcher.wrap(target, "add", add_one_more)

        def part(module):
            raise ZeroDivisionError("part failed")

        patcher.when_imported(f"{world.package}.other", part)

    world.add_shim("parts", install)
    assert ftshims.apply()["parts"].status == "applied"
    world.module("other")
    assert ftshims.status()["parts"].status == "failed"
    assert target.add is original


def test_part_with_missing_target_is_noted_not_fatal(world):
    target = world.module()

    def install(patcher, options):
        patcher.wrap(target, "add", add_one_more)

        def part(module):
            raise TargetMissing("other has no such function")

        patcher.when_imported(f"{world.package}.other", part)

    world.add_shim("parts", install)
    ftshims.apply()
    world.module("other")
    assert ftshims.status()["parts"].status == "applied"
    assert _manager.notes("parts") == ["other has no such function"]


def test_concurrent_apply_from_8_threads(world):
    target = world.module()
    original = target.add
    world.add_shim("wrap_add", wrap_add)
    assert not at_once_on_threads(ftshims.apply)
    assert target.add(1) == 3, "wrapped exactly once"
    assert target.add.__wrapped__ is original
    ftshims.revert()
    assert target.add is original


def test_two_shims_on_one_target_revert_in_any_order(world):
    target = world.module()
    original = target.add
    world.add_shim("first", lambda p, o: p.wrap(target, "add", add_one_more))
    world.add_shim("second", lambda p, o: p.wrap(target, "add", lambda w, i, a, k: w(*a, **k) * 10))
    ftshims.apply()
    assert target.add(1) == (1 + 1 + 1) * 10
    ftshims.revert(only=["first"])
    assert target.add(1) == 20, "the second shim still applies on top of the original"
    assert target.add.__wrapped__ is original
    ftshims.revert(only=["second"])
    assert target.add is original


def test_someone_else_patching_on_top_is_left_alone(world, caplog):
    target = world.module()
    world.add_shim("wrap_add", wrap_add)
    ftshims.apply()
    theirs = lambda x, y=1: 100  # noqa: E731  (another library replacing the function after us)
    target.add = theirs
    with caplog.at_level(logging.WARNING, logger="ftshims"):
        ftshims.revert()
    assert target.add is theirs
    assert any("replaced by other code" in r.getMessage() for r in caplog.records)


def test_wrapper_left_under_someone_elses_patch_passes_through(world):
    target = world.module()
    original = target.add
    world.add_shim("wrap_add", wrap_add)
    ftshims.apply()
    ours = target.add
    target.add = lambda x, y=1: ours(x, y)  # another library wrapping our wrapper
    ftshims.revert()
    assert target.add(1) == original(1), "our layer is inert after revert even where it could not be removed"


def test_selection_only_exclude_include_and_env(world, monkeypatch):
    world.module()
    world.add_shim("a", wrap_add)
    world.add_shim("b", lambda p, o: None)
    world.add_shim("fast", lambda p, o: None, kind="speed")
    report = ftshims.apply(exclude=["a"])
    assert report["a"].status == "disabled" and report["b"].status == "applied"
    assert report["fast"].status == "disabled" and "opt-in" in report["fast"].reason
    ftshims.revert()
    report = ftshims.apply(include=["fast"])
    assert report["fast"].status == "applied"
    ftshims.revert()
    monkeypatch.setenv("FTSHIMS_DISABLE", "a, fast")
    report = ftshims.apply(include=["fast"])
    assert report["a"].status == "disabled" and "FTSHIMS_DISABLE" in report["a"].reason
    assert report["fast"].status == "disabled"
    ftshims.revert()
    monkeypatch.setenv("FTSHIMS_DISABLE", "*")
    assert {e.status for e in ftshims.apply()} == {"disabled"}


def test_only_selects_and_leaves_others_alone(world):
    world.module()
    world.add_shim("a", wrap_add)
    world.add_shim("b", lambda p, o: None)
    report = ftshims.apply(only=["b"])
    assert report["b"].status == "applied" and report["a"].status == "disabled"


def test_unknown_ids_and_options_are_value_errors(world):
    world.add_shim("a", wrap_add, options={"policy": "error"}, choices={"policy": Choice(values=("error", "warn"))})
    with pytest.raises(ValueError, match="unknown shim id"):
        ftshims.apply(only=["nope"])
    with pytest.raises(ValueError, match="unknown shim id"):
        ftshims.revert(only=["nope"])
    with pytest.raises(ValueError, match="unknown key"):
        ftshims.apply(options={"a": {"polic": "warn"}})


def test_options_reach_install(world):
    seen = {}
    world.module()
    world.add_shim(
        "opt", lambda p, o: seen.update(o), options={"policy": "error", "n": 1},
        choices={"policy": Choice(values=("error", "warn")), "n": Choice(type=int)},
    )
    ftshims.apply(options={"opt": {"policy": "warn"}})
    assert seen == {"policy": "warn", "n": 1}


def test_not_needed_when_out_of_range_or_absent(world):
    world.add_shim("old", wrap_add, requires={"packaging": "<1"})
    world.add_shim("absent", wrap_add, requires={"surely-not-installed-dist": ">=0"})
    report = ftshims.apply()
    assert report["old"].status == "not needed" and "outside <1" in report["old"].reason
    assert report["absent"].status == "not needed" and "not installed" in report["absent"].reason


def test_applied_context_manager_reverts_only_what_it_applied(world):
    target = world.module()
    original = target.add
    world.add_shim("a", wrap_add)
    world.add_shim("b", lambda p, o: p.wrap(target.Greeter, "greet", lambda w, i, a, k: "patched"))
    ftshims.apply(only=["a"])
    with ftshims.applied(only=["b"]) as report:
        assert report["b"].status == "applied"
        assert target.Greeter().greet("x") == "patched"
    assert target.Greeter().greet("x") == "hello x"
    assert target.add(1) == 3, "the shim applied outside the block is untouched"
    ftshims.revert()
    assert target.add is original


def test_report_is_printable_and_serialisable(world):
    import json

    world.module()
    world.add_shim("a", wrap_add)
    report = ftshims.apply()
    text = str(report)
    assert "a" in text and "applied" in text
    data = report.to_dict()
    json.dumps(data)
    assert data["shims"][0]["id"] == "a" and data["shims"][0]["patched"]


def test_info_logs_only_on_rank_zero(world, monkeypatch, caplog):
    world.module()
    world.add_shim("a", wrap_add)
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="ftshims"):
        ftshims.apply()
    assert not [r for r in caplog.records if r.levelno == logging.INFO]
    ftshims.revert()
    monkeypatch.setenv("RANK", "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ftshims"):
        ftshims.apply()
    assert [r for r in caplog.records if r.levelno == logging.INFO and "a applied" in r.getMessage()]


def test_patcher_wraps_each_slot_once_per_shim(world):
    target = world.module()

    def install(patcher, options):
        patcher.wrap(target, "add", add_one_more)
        patcher.wrap(target, "add", add_one_more)

    world.add_shim("twice", install)
    ftshims.apply()
    assert target.add(1) == 3
    assert patching.original_of(target, "add")(1) == 2


def test_broken_shim_module_is_reported_not_raised(monkeypatch):
    """A shim module that raises on import makes that shim "failed"; apply() still works for the rest."""
    from ftshims import registry

    monkeypatch.setattr(registry, "SHIM_IDS", ("lora_reentrant_checkpointing", "no_such_shim_module"))
    monkeypatch.setattr(registry, "_CACHE", None)
    monkeypatch.setattr(registry, "_ERRORS", {})
    monkeypatch.setattr(_manager, "_RECORDS", {})
    report = ftshims.apply()
    assert report["no_such_shim_module"].status == "failed"
    assert "failed to load" in report["no_such_shim_module"].reason
    assert report["lora_reentrant_checkpointing"].status != "failed"
    ftshims.revert()


def test_pending_parts_and_item_labels(world):
    target = world.module()

    def install(patcher, options):
        patcher.wrap_item(target.REGISTRY, "double", add_one_more, label="REGISTRY['double']")
        patcher.when_imported(f"{world.package}.other", lambda module: patcher.wrap(module, "add", add_one_more))

    world.add_shim("parts", install)
    entry = ftshims.apply()["parts"]
    assert entry.patched == ["REGISTRY['double']"]
    assert entry.waiting == [f"{world.package}.other"]
    world.module("other")
    entry = ftshims.status()["parts"]
    assert entry.waiting == [] and len(entry.patched) == 2


def test_copies_made_after_patching_are_restored_by_revert(world):
    """A module imported after the shim (copying the wrapper) gets the original back on revert."""
    world.add_shim("wrap_add", wrap_add)
    ftshims.apply()
    target = world.module()  # installs the shim
    original = patching.original_of(target, "add")
    other = world.module("other")  # `from target import add` copies the wrapper
    assert other.add(1) == 3
    ftshims.revert()
    assert target.add is original
    assert other.add is original, "the copy made after patching still held the wrapper"


def test_revert_of_a_replaced_constant_leaves_other_modules_alone(world):
    """Replacing a module constant (False) and reverting must not rewrite every other module's False."""
    import subprocess as sp

    target = world.module()
    target.FLAG = True
    world.add_shim("const", lambda p, o: p.replace(target, "FLAG", False))
    before = sp._mswindows
    ftshims.apply()
    assert target.FLAG is False
    ftshims.revert()
    assert target.FLAG is True
    assert sp._mswindows is before, "an unrelated module global equal to the replaced constant was rewritten"


def test_part_for_a_half_imported_module_waits_for_its_body(world):
    """The deferred shim fires while `late` is mid-import (it imports the trigger); its part must
    patch `late` once the body has run, not find a half-defined module."""

    def install(patcher, options):
        patcher.when_imported(f"{world.package}.late", lambda m: patcher.wrap(m, "defined_after", add_one_more))

    world.add_shim("late", install, modules=(f"{world.package}.trigger",))
    assert ftshims.apply()["late"].status == "deferred"
    late = world.module("late")
    assert ftshims.status()["late"].status == "applied"
    assert late.defined_after(1) == 2, "the part ran on the half-executed module and found nothing"
    assert _manager.notes("late") == []
    ftshims.revert()
    assert late.defined_after(1) == 1


def test_part_for_a_module_whose_import_fails_waits_for_a_later_import(world):
    def install(patcher, options):
        patcher.when_imported(f"{world.package}.late_broken", lambda m: patcher.wrap(m, "x", add_one_more))

    world.add_shim("late", install, modules=(f"{world.package}.trigger",))
    ftshims.apply()
    with pytest.raises(RuntimeError, match="late_broken fails"):
        world.module("late_broken")
    assert ftshims.status()["late"].status == "applied"
    assert ftshims.status()["late"].waiting == [f"{world.package}.late_broken"]


@pytest.mark.parametrize("appliers", [2, 4])
def test_concurrent_apply_and_import_stress(tmp_path, monkeypatch, appliers):
    """Threads applying while another imports the target, 25 times on fresh packages: never left
    deferred, never doubled."""
    for i in range(25):
        (tmp_path / str(i)).mkdir()
        world = FakeWorld(tmp_path / str(i), monkeypatch)
        world.add_shim("wrap_add", wrap_add)
        barrier = threading.Barrier(appliers + 1)

        def applier():
            barrier.wait()
            ftshims.apply()

        def importer():
            barrier.wait()
            world.module()

        threads = [threading.Thread(target=applier) for _ in range(appliers)] + [threading.Thread(target=importer)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # read the record directly: status() would settle a missed hook itself
        assert _manager._RECORDS["wrap_add"].status == "applied", f"iteration {i}"
        assert world.module().add(1) == 3, f"iteration {i}"
        world.cleanup()


def test_wrap_method_finds_the_target_or_raises_target_missing():
    """Patcher.wrap_method: Class.method of an imported module is wrapped (and restored by undo); a missing module,
    class or method is TargetMissing, with nothing patched."""
    import sys
    import types

    from ftshims.patching import Patcher
    from ftshims.spec import TargetMissing

    module = types.ModuleType("ftshims_test_wrap_method")

    class Target:
        def method(self, x):
            return x + 1

    module.Target = Target
    sys.modules[module.__name__] = module
    try:
        original = Target.method
        patcher = Patcher("wrap_method_test")
        patcher.wrap_method(module.__name__, "Target.method", lambda wrapped, instance, args, kwargs: wrapped(*args) * 10)
        assert Target().method(1) == 20
        for where, qualname in ((module.__name__, "Target.absent"), (module.__name__, "Absent.method"),
                                ("ftshims_no_such_module", "Target.method")):
            with pytest.raises(TargetMissing, match="is missing"):
                patcher.wrap_method(where, qualname, lambda wrapped, instance, args, kwargs: None)
        patcher.undo()
        assert Target.method is original and Target().method(1) == 2
    finally:
        del sys.modules[module.__name__]


def test_summary_counts_what_status_counts(world):
    """Issue 37: summary() counted deferred shims as applied ("17 shims applied" where status() said 11
    applied and 6 deferred). A deferred shim has installed nothing yet; the line says so, with its module."""
    world.add_shim("wrap_add", wrap_add)
    world.add_shim("on_late", lambda patcher, options: None, modules=(f"{world.package}.late",))
    world.module()
    report = ftshims.apply()
    assert (report["wrap_add"].status, report["on_late"].status) == ("applied", "deferred")
    line = ftshims.summary()
    assert line.startswith(f"ftshims: 1 shim applied, 1 deferred (waiting for import of {world.package});"), line
    assert "on_late" not in line, "a deferred shim is not 'not needed so far': it is not installed yet"
    world.module("late")
    assert ftshims.status()["on_late"].status == "applied"
    assert ftshims.summary().startswith("ftshims: 2 shims applied;"), ftshims.summary()
