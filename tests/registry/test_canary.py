"""The drift canary's static target check, on fabricated distributions (no network)."""

from __future__ import annotations

import io
import tarfile
import textwrap
import zipfile

from ftshims import canary
from ftshims.spec import Target

MODULE = textwrap.dedent(
    """
    from .helpers import exported as reexported

    class Mixin:
        def inherited(self, model, flag=True):
            pass

    class Model(Mixin):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            pass

        def flexible(self, **kwargs):
            pass

    def prepare(model, use_gradient_checkpointing=True):
        pass
    """
)
HELPERS = "def exported(x, y):\n    pass\n"
# A subpackage whose __init__ re-exports from a sibling module (peft.tuners.lora: `from .model import LoraModel`).
FILES = (
    ("fakepkg/__init__.py", ""),
    ("fakepkg/mod.py", MODULE),
    ("fakepkg/helpers.py", HELPERS),
    ("fakepkg/sub/__init__.py", "from .impl import Tuner\n"),
    ("fakepkg/sub/impl.py", "from ..mod import Mixin\n\nclass Tuner(Mixin):\n    pass\n"),
)


def _wheel(tmp_path):
    path = tmp_path / "fakepkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in FILES:
            zf.writestr(name, text)
    return canary.Source(path)


def _sdist(tmp_path):
    path = tmp_path / "fakepkg-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in FILES:
            data = text.encode()
            info = tarfile.TarInfo(f"fakepkg-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return canary.Source(path)


def test_targets_found_changed_missing(tmp_path):
    for source in (_wheel(tmp_path), _sdist(tmp_path)):
        check = lambda *a, **k: canary.check_target(source, Target("fakepkg.mod", *a, **k))  # noqa: E731
        assert check("Model.gradient_checkpointing_enable", params=("gradient_checkpointing_kwargs",))[0]
        ok, detail = check("Model.gradient_checkpointing_enable", params=("use_reentrant",))
        assert not ok and "signature changed" in detail
        assert check("Model.flexible", params=("anything",))[0], "**kwargs accepts any keyword"
        assert check("Model.inherited", params=("model",))[0], "found on a base class in the same module"
        assert check("prepare", params=("model",))[0]
        assert check("reexported", params=("x", "y"))[0], "followed through `from .helpers import`"
        ok, detail = canary.check_target(source, Target("fakepkg.sub", "Tuner.inherited", params=("model",)))
        assert ok, f"followed from a package __init__ into its module and up to an imported base: {detail}"
        ok, detail = check("vanished")
        assert not ok and "not defined" in detail
        ok, detail = canary.check_target(source, Target("fakepkg.nomodule", "f"))
        assert not ok and "not in the distribution" in detail


def test_report_fails_only_on_tracked_drift():
    good = canary.Finding("s", "p", "1.0", True, "t", True, "found")
    drift_newest = canary.Finding("s", "p", "2.0", False, "t", False, "not defined")
    text, code = canary.report([good, drift_newest])
    assert code == 0 and "ATTENTION" in text
    drift_tracked = canary.Finding("s", "p", "1.0", True, "t", False, "not defined")
    text, code = canary.report([good, drift_tracked])
    assert code == 1 and "ERROR" in text


# -- where downloads are kept ----------------------------------------------------------------------


def test_cache_is_the_users_cache_directory_never_the_package(monkeypatch, tmp_path):
    from pathlib import Path

    from ftshims import settings

    monkeypatch.delenv(settings.CANARY_CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert canary.cache_dir() == tmp_path / "home" / ".cache" / "ftshims" / "canary"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: relative paths are ignored
    assert canary.cache_dir() == tmp_path / "home" / ".cache" / "ftshims" / "canary"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert canary.cache_dir() == tmp_path / "xdg" / "ftshims" / "canary"
    package = Path(canary.__file__).resolve().parent.parent
    assert package not in canary.cache_dir().parents


def test_cache_variable_overrides_and_is_checked(monkeypatch, tmp_path):
    import pytest

    from ftshims import settings

    monkeypatch.setenv(settings.CANARY_CACHE_ENV, str(tmp_path / "mine"))
    assert canary.cache_dir() == tmp_path / "mine"  # created on use, not here
    monkeypatch.setenv(settings.CANARY_CACHE_ENV, "  ")
    assert canary.cache_dir().parts[-2:] == ("ftshims", "canary")  # empty counts as unset
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(settings.CANARY_CACHE_ENV, str(tmp_path / "a-file"))
    with pytest.raises(ValueError, match=rf"{settings.CANARY_CACHE_ENV}=.*is a file, not a directory"):
        canary.cache_dir()
    assert [p["variable"] for p in settings.environment_problems()] == [settings.CANARY_CACHE_ENV]
    with pytest.raises(SystemExit):  # the command line says so in one line (argparse's error), no traceback
        canary.main(["--tracked-only"])


# -- the monitor's attach points -------------------------------------------------------------------


def test_mentions_are_checked(tmp_path):
    source = _wheel(tmp_path)
    target = Target("fakepkg.mod", "Model")
    assert canary.check_target(source, target, ("Mixin",))[0]  # a name the class uses (its base)
    ok, detail = canary.check_target(source, target, ("clip_grad_norm_",))
    assert not ok and "no longer mentions clip_grad_norm_" in detail


def _fake_transformers(tmp_path, version, trainer_body, events):
    """A transformers release holding only what the monitor relies on: CallbackHandler's ``events`` and a
    Trainer whose training loop is ``trainer_body``."""
    handler = "class CallbackHandler:\n" + "".join(
        f"    def {event}(self, args, state, control, **kwargs):\n        pass\n" for event in events)
    trainer = ("class Trainer:\n    def __init__(self, model=None, args=None, callbacks=None):\n        pass\n\n"
               "    def add_callback(self, callback):\n        pass\n\n"
               f"    def _inner_training_loop(self, model):\n        {trainer_body}\n")
    path = tmp_path / f"transformers-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("transformers/__init__.py", "")
        zf.writestr("transformers/trainer_callback.py", handler)
        zf.writestr("transformers/trainer.py", trainer)
    return canary.Source(path)


def test_monitor_attach_points_drift_is_reported(tmp_path):
    base = ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_save", "on_train_end")
    clip = "return self.accelerator.clip_grad_norm_(model.parameters(), 1.0)"
    # 4.44: on_pre_optimizer_step did not exist yet (when=">=4.45"): nothing to report
    good = canary.check_monitor(_fake_transformers(tmp_path, "4.44.2", clip, base), "transformers", "4.44.2", True)
    assert good and all(f.ok and f.shim_id == canary.MONITOR for f in good), [f.detail for f in good if not f.ok]
    assert not any(f.target.endswith("on_pre_optimizer_step") for f in good)
    # a release whose Trainer computes the norm another way, and lost the pre-optimizer event
    moved = "return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])"
    bad = canary.check_monitor(_fake_transformers(tmp_path, "9.0.0", moved, base), "transformers", "9.0.0", True)
    failed = {f.target: f.detail for f in bad if not f.ok}
    assert set(failed) == {"transformers.trainer.Trainer", "transformers.trainer_callback.CallbackHandler.on_pre_optimizer_step"}, failed
    assert "no longer mentions clip_grad_norm_" in failed["transformers.trainer.Trainer"]
    text, code = canary.report(bad)
    assert code == 1 and "ERROR     monitor: transformers 9.0.0: transformers.trainer.Trainer" in text


def _installed_release(tmp_path, package):
    """The installed ``package``'s modules that the monitor's attach points name, as a wheel (no network)."""
    import importlib.util
    from pathlib import Path

    top = package.replace("-", "_")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]).parent
    from ftshims.versions import installed_version

    path = tmp_path / f"{top}-{installed_version(package)}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for target, _ in canary.monitor_points()[package]:
            parts = target.module.split(".")
            for i in range(1, len(parts)):  # the packages on the way: relative imports start there
                init = root.joinpath(*parts[:i], "__init__.py")
                name = "/".join(parts[:i]) + "/__init__.py"
                if init.exists() and name not in zf.namelist():
                    zf.writestr(name, init.read_text())
            module = root.joinpath(*parts[:-1], parts[-1] + ".py")
            name = "/".join(parts) + ".py"
            if module.exists() and name not in zf.namelist():
                zf.writestr(name, module.read_text())
    return canary.Source(path), installed_version(package)


def test_monitor_attach_points_hold_on_the_installed_releases(tmp_path):
    """Every attach point of the installed transformers, accelerate and deepspeed (those installed) is there:
    the same check the canary makes on the tracked and newest releases."""
    checked = []
    for package in sorted(canary.monitor_points()):
        found = _installed_release(tmp_path, package)
        if found is None:
            continue
        source, version = found
        findings = canary.check_monitor(source, package, version, True)
        assert findings and all(f.ok for f in findings), [(f.target, f.detail) for f in findings if not f.ok]
        checked.append(package)
    assert "transformers" in checked
