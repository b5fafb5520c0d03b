"""Small helpers shared by the shims and the kernel; importing this module imports nothing heavy."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Optional

_IS_COMPILING: Optional[Callable[[], bool]] = None

# One lock for ftshims' state: the patcher's slots, the post-import hooks and the manager's
# records. apply(), revert() and the hooks all serialise on it (reentrant: a hook may run
# inside apply()).
LOCK = threading.RLock()


def module_globals():
    """``(module, name, value)`` for every global of every imported module.

    Both lists are snapshots, so a caller may set a module's globals while it
    iterates (the patcher restores copies of a wrapped function; the flash-attn
    shim wraps copies of one). Modules without a ``__dict__`` are skipped.
    """
    import sys

    for module in list(sys.modules.values()):
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for name, value in list(namespace.items()):
            yield module, name, value


@contextlib.contextmanager
def attributes_set(owner, values: dict):
    """Set ``owner``'s attributes from ``values`` for the duration, then put back exactly what was
    there (deleting the ones that were absent): the CPU stand-ins swap kernel names this way."""
    absent = object()
    saved = {name: vars(owner).get(name, absent) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def compiling() -> bool:
    """True while ``torch.compile`` (dynamo) traces the calling code.

    Inside a trace dynamo evaluates this to a constant, so ``if compiling():``
    selects a branch at trace time and costs nothing at run time. Shims use it
    to take a data-independent path there: a Python-side decision on tensor
    *values* (a ``.max()``, ``bool(t.any())``) would otherwise be a graph break,
    which ``fullgraph=True`` turns into an error.
    """
    global _IS_COMPILING
    if _IS_COMPILING is None:
        import torch

        compiler = getattr(torch, "compiler", None)
        _IS_COMPILING = getattr(compiler, "is_compiling", None) or torch._dynamo.is_compiling
    return _IS_COMPILING()


def _in_trace() -> bool:
    """:func:`compiling` without importing torch: before torch is imported nothing can be traced. (Checking only
    once ``compiling()`` had been called let the first trace through ``acted``/``warn_once`` run their side effects,
    which dynamo refuses.)"""
    if _IS_COMPILING is None and "torch" not in sys.modules:
        return False
    return compiling()


def method_binder(func) -> Callable[[tuple, dict], Optional[dict]]:
    """A trace-friendly ``bind(args, kwargs) -> {name: value} | None`` for a method ``func(self, ...)``.

    The parameter names are read once, at install time, so that binding a call
    is plain tuple/dict work that ``torch.compile`` traces without a graph break
    (``inspect.signature`` at call time would not be). ``bind`` returns None for
    more positional arguments than named parameters (``*args``), and always
    when ``func`` has no readable signature.
    """
    import inspect

    try:
        params = list(inspect.signature(func).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return lambda args, kwargs: None
    return _binder(params)


def function_binder(func) -> Callable[[tuple, dict], Optional[dict]]:
    """:func:`method_binder` for a plain function (no ``self`` to leave out)."""
    import inspect

    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return lambda args, kwargs: None
    return _binder(params)


def _binder(params) -> Callable[[tuple, dict], Optional[dict]]:
    import inspect

    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = tuple(p.name for p in params if p.kind in positional)

    def bind(args, kwargs):
        if len(args) > len(names):
            return None
        call = dict(zip(names, args))
        call.update(kwargs)
        return call

    return bind


def cache_length(past) -> int:
    """Tokens already in a KV cache: a ``Cache`` object (``get_seq_length``) or the legacy tuple of
    ``(key, value)`` with key ``[batch, heads, seq, dim]``; 0 for None or a shape it cannot read."""
    if past is None:
        return 0
    get = getattr(past, "get_seq_length", None)
    if callable(get):
        return int(get())
    try:
        return int(past[0][0].shape[-2])
    except (IndexError, TypeError, AttributeError, KeyError):
        return 0


_WARN_LOCK = threading.Lock()


def warn_once(seen: set, key: Any, emit: Callable[[], None]) -> bool:
    """Call ``emit()`` the first time ``key`` is seen in ``seen``; True when it did.

    The one warn-once of ftshims (the shims and the kernel keep their own ``seen``
    sets: per process, per model...). Thread-safe; never inside a ``torch.compile``
    trace, where a Python side effect has no place.
    """
    if _in_trace():
        return False
    with _WARN_LOCK:
        if key in seen:
            return False
        seen.add(key)
    emit()
    return True


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` that points at the first frame outside ftshims.

    Shims warn from deep inside wrappers (patching.py, the shim, its helpers),
    and the depth varies with the call path; counting the frames of ftshims
    (and of wrapt, when its pure-Python wrappers run) up to the first other
    one points the warning at the user's code, or at the library that called
    the patched function. Call it as the argument of ``warnings.warn``.
    """
    import sys

    frame = sys._getframe(1)  # the frame calling warnings.warn: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("ftshims", "wrapt"):
        frame = frame.f_back
        level += 1
    return level


# What each shim did, since it was last installed: {(shim id, action): times}. Shims call
# acted() where they change something (a mask built, a buffer recomputed, an input refused);
# status() reports the counts, and FTSHIMS_SUMMARY prints them at exit.
ACTIONS: dict = {}


def acted(shim_id: str, action: str, times: int = 1) -> None:
    """Count that ``shim_id`` did ``action`` (a plural noun: "block masks built"). An increment;
    nothing inside a ``torch.compile`` trace (a graph must not carry Python side effects)."""
    if _in_trace():
        return
    key = (shim_id, action)
    ACTIONS[key] = ACTIONS.get(key, 0) + times


def actions_of(shim_id: str) -> dict:
    return {action: n for (owner, action), n in list(ACTIONS.items()) if owner == shim_id}


def forget_actions(shim_id: str) -> None:
    for key in [key for key in list(ACTIONS) if key[0] == shim_id]:
        ACTIONS.pop(key, None)
