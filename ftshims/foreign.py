"""Foreign patches: another patcher's object where ftshims wants to patch.

Liger, unsloth, axolotl and LLaMA-Factory replace some of the same functions
and classes ftshims wraps. An object counts as *foreign* when its code lives
outside the package it is found in (a ``transformers`` module attribute whose
code is in ``liger_kernel``) and outside ftshims. :class:`~ftshims.patching.Patcher`
asks :func:`foreign_origin` before it writes and when it finds a slot changed
under it: a wrapper composes with a foreign function (ftshims' layer calls it),
an outright replacement steps aside (:class:`ForeignPatch`), and the reason
goes into ``status()`` notes.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Iterable, List, Optional, Tuple

import wrapt

from .spec import TargetMissing

MISSING = object()  # "nothing there": a slot's empty value (patching uses the same sentinel)


def is_shim_wrapper(value: Any) -> bool:
    """True for an object a shim installed with :meth:`~ftshims.patching.Patcher.wrap` (plain function or wrapt proxy)."""
    if isinstance(value, wrapt.FunctionWrapper):
        return True
    # the mark must be this function's own: ``functools.wraps`` copies a function's __dict__, so a function someone
    # defined with ``@wraps`` of a patched one carries the mark too (TRL 0.8's ``SFTTrainer.train`` is
    # ``@wraps(Trainer.train)``): it is theirs, not a layer of ftshims
    if type(value) is not types.FunctionType:
        return False
    own = vars(value).get("__ftshims_self__")
    return "__ftshims_shim__" in vars(value) and own is not None and own() is value


class ForeignPatch(TargetMissing):
    """A target ftshims would replace outright already holds another patcher's object: ftshims steps aside."""


def _top(name: Optional[str]) -> str:
    return (name or "").split(".", 1)[0]


def _home_module(container: Any) -> Optional[str]:
    """The module a slot belongs to: the module itself, a class's module, else the container's type's module."""
    if inspect.ismodule(container):
        return container.__name__
    if isinstance(container, type):
        return container.__module__
    return getattr(type(container), "__module__", None)


def _package_dirs(names: Iterable[str]) -> List[str]:
    """Directories (with a trailing separator) of the imported top-level packages ``names``, and the stdlib."""
    import os

    dirs = []
    for name in names:
        top = sys.modules.get(name)
        for path in list(getattr(top, "__path__", None) or []):
            dirs.append(os.path.abspath(path) + os.sep)
        if not getattr(top, "__path__", None) and getattr(top, "__file__", None):
            dirs.append(os.path.abspath(top.__file__))
    return dirs + list(_stdlib_dirs())


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> Tuple[str, ...]:
    """The standard library's directory (``os``'s), never site-packages: in a venv sysconfig's ``platstdlib``
    is the venv's ``lib/python3.X``, which holds site-packages too."""
    import os

    return (os.path.dirname(os.path.abspath(os.__file__)) + os.sep,)


def _code_of(value: Any) -> Any:
    """The function whose code runs when ``value`` is called (through bound methods, partials, descriptors)."""
    for _ in range(8):
        if isinstance(value, (staticmethod, classmethod, types.MethodType)):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        else:
            break
    return value


def describe_object(value: Any) -> str:
    """``module.qualname`` of what runs when ``value`` is called, with its file where ``__module__`` misleads."""
    import os

    func = _code_of(value)
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__
    code = getattr(func, "__code__", None)
    where = f"{module}.{name}"
    if code is not None and not code.co_filename.startswith("<"):
        expected = module.replace(".", os.sep)
        if not (code.co_filename.endswith(expected + ".py") or code.co_filename.endswith(os.path.join(expected, "__init__.py"))):
            where += f" ({code.co_filename}:{code.co_firstlineno})"
    return where


_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"builtins", "__future__"}


def foreign_origin(container: Any, value: Any, own: Iterable[str] = ()) -> Optional[str]:
    """Where ``value`` comes from when it is *foreign* in ``container``: another patcher put it there. Else None.

    ``own``: top-level packages whose objects legitimately sit in the slot besides the slot's own
    package (the shim's required packages: a transformers module holding a torch function is not a
    foreign patch); ``torch``, ``ftshims`` and the standard library always count as own.

    Foreign: a function (also reached through a bound method, partial, classmethod) whose code file
    lies outside every own package's directory (this catches ``functools.wraps`` wrappers, which copy
    the ``__module__``/``__qualname__`` of what they wrap, and code defined in ``__main__``), or a
    class or other object whose ``__module__`` names no own package. ftshims' wrappers are never
    foreign; constants and objects without a module are never judged.
    """
    if value is None or value is MISSING or is_shim_wrapper(value):
        return None
    home = _home_module(container)
    if not home:
        return None
    allowed = {_top(home), "torch", "ftshims", *(_top(n) for n in own)}
    func = _code_of(value)
    if is_shim_wrapper(func):
        return None
    module = getattr(func, "__module__", None)
    if not isinstance(module, str):
        return None
    code = getattr(func, "__code__", None)
    if code is not None and not code.co_filename.startswith("<") and _top(module) != "__main__":
        import os

        filename = os.path.abspath(code.co_filename)
        for directory in _package_dirs(sorted(allowed)):
            if filename.startswith(directory):
                rest = filename[len(directory):]
                if directory in _stdlib_dirs() and ("site-packages" in rest or "dist-packages" in rest):
                    continue
                return None
        return describe_object(func)
    if not (callable(func) or isinstance(func, type)):
        return None
    if _top(module) in allowed or _top(module) in _STDLIB:
        return None
    return describe_object(func)
