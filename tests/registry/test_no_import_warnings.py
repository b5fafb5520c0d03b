"""No warning at import, on any supported Python.

Two checks:

* every ``.py`` file of the package (``ftshims/**``, shims, kernels, doctor, lint, monitor, ...) compiles
  with warnings turned into errors: an invalid escape sequence (``"\\ "``) is a DeprecationWarning on
  Python 3.11 and a SyntaxWarning from 3.12, raised at compile time, whether or not the module is ever
  imported in a test (the compiler does not warn again once a ``.pyc`` is cached, so the source is
  compiled from text here, not imported);
* ``import ftshims`` in a fresh interpreter run with ``-W error`` succeeds and prints nothing on stderr
  (a warning raised while importing would be an exception there).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ftshims"
SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_the_package_has_sources():
    assert len(SOURCES) > 20, SOURCES  # the glob found the package, not an empty directory
    assert PACKAGE / "__init__.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(PACKAGE.parent)) for p in SOURCES])
def test_module_compiles_without_warnings(path):
    source = path.read_text(encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile(source, str(path), "exec", dont_inherit=True)


def test_compile_check_catches_an_invalid_escape():
    """The check above can fail: the same compile() raises on the escape the lead fixed in ftshims/__init__.py."""
    bad = 'def f():\n    """Call apply(): a\\ b."""\n'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(SyntaxError if sys.version_info >= (3, 12) else (SyntaxError, DeprecationWarning)):
            compile(bad, "<bad>", "exec", dont_inherit=True)


def test_import_ftshims_with_warnings_as_errors():
    env_code = (
        "import sys, ftshims; "
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'trl', 'accelerate') if m in sys.modules]; "
        "print('ok', heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-X", "dev", "-c", env_code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(PACKAGE.parent),
        env={**_clean_env(), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []", result.stdout
    assert result.stderr == "", result.stderr


def _clean_env():
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "FTSHIMS_AUTO")}
    env["PYTHONPATH"] = str(PACKAGE.parent) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
