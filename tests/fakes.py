"""Fake shims over a throwaway package, for lifecycle and fault-injection tests.

The package is written to a temporary directory so that "not imported yet",
"imported later" and "raises on import" are real import-system states, not
mocks. :func:`at_once_on_threads` starts the same call on several threads at once.
"""

from __future__ import annotations

import itertools
import sys
import textwrap
import threading
import types
from typing import Callable, Dict, Iterable, Optional

from ftshims import _manager, registry
from ftshims.spec import ShimSpec, Target

_COUNTER = itertools.count()

TARGET_SOURCE = textwrap.dedent(
    """
    def add(x, y=1):
        return x + y

    class Greeter:
        def greet(self, name):
            return "hello " + name

        @staticmethod
        def shout(text):
            return text.upper()

        @classmethod
        def make(cls):
            return cls()

    class Child(Greeter):
        pass

    REGISTRY = {"double": lambda x: 2 * x}
    """
)


class FakeWorld:
    """A fresh package ``fakepkg_N`` with a ``target`` module, and a registry of fake shims."""

    def __init__(self, tmp_path, monkeypatch):
        self.package = f"fakepkg_{next(_COUNTER)}"
        root = tmp_path / self.package
        root.mkdir()
        (root / "__init__.py").write_text("")
        (root / "target.py").write_text(TARGET_SOURCE)
        (root / "other.py").write_text(f"from {self.package}.target import add\n")
        (root / "broken.py").write_text("raise RuntimeError('this module is broken on purpose')\n")
        (root / "trigger.py").write_text("")
        # Imports `trigger` half-way through its body, like a modeling module importing modeling_utils.
        (root / "late.py").write_text(
            f"import {self.package}.trigger\n\ndef defined_after(x):\n    return x\n"
        )
        (root / "late_broken.py").write_text(
            f"import {self.package}.trigger\n\nraise RuntimeError('late_broken fails after the trigger')\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        self.shims: Dict[str, registry.Shim] = {}
        monkeypatch.setattr(registry, "_CACHE", self.shims)
        monkeypatch.setattr(_manager, "_RECORDS", {})

    @property
    def target_module(self) -> str:
        return f"{self.package}.target"

    def module(self, name: str = "target"):
        import importlib

        return importlib.import_module(f"{self.package}.{name}")

    def add_shim(
        self,
        shim_id: str,
        install: Callable,
        modules: Optional[Iterable[str]] = None,
        requires: Optional[dict] = None,
        targets: Iterable[Target] = (),
        kind: str = "fix",
        options: Optional[dict] = None,
        choices: Optional[dict] = None,
        since: str = "",
    ) -> registry.Shim:
        module = types.ModuleType(f"fake_shim_{shim_id}")
        module.SPEC = ShimSpec(
            id=shim_id,
            title=f"fake {shim_id}",
            symptom="fake symptom",
            why="a fake shim for the tests",
            requires=requires or {"packaging": ">=1"},
            fixed_in={},
            refs=("https://example.invalid/issue/1",),
            targets=tuple(targets),
            modules=tuple(modules) if modules is not None else (self.target_module,),
            kind=kind,
            options=options or {},
            choices=choices or {},
            since=since,
        )
        module.install = install
        shim = registry.Shim(module.SPEC, module)
        self.shims[shim_id] = shim
        return shim

    def cleanup(self) -> None:
        _manager.revert()
        for name in [m for m in sys.modules if m == self.package or m.startswith(self.package + ".")]:
            del sys.modules[name]


def add_one_more(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


def wrap_add(patcher, options):
    """Install function of a well-behaved fake shim: wraps target.add."""
    module = _target_of(patcher)
    patcher.wrap(module, "add", add_one_more)


def _target_of(patcher):
    shim = registry.shims()[patcher.shim_id]
    return sys.modules[shim.spec.modules[0]]



def at_once_on_threads(call: Callable[[], object], count: int = 8) -> list:
    """Run ``call`` on ``count`` threads released together by a barrier; the exceptions they raised."""
    barrier = threading.Barrier(count)
    errors = []

    def worker():
        try:
            barrier.wait()
            call()
        except Exception as exc:  # collected for the caller to assert on
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors
