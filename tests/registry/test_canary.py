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
