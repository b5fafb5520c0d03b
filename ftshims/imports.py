"""Post-import hooks, and the import races they close.

A shim on a module that is not imported yet is installed the moment that
module is imported: :func:`on_import` registers one ``wrapt`` post-import hook
per module name, fanning out to every waiting callback. Three races make that
harder than it looks, and each has its guard here:

* the hook fires while the module is still *initializing* (a submodule import
  triggered by the module's own body, or importlib calling hooks before the
  body finished): :func:`_after_initialization` defers the callback until the
  module's spec says it is done (swapping the spec's class for one that
  reports completion), so a shim never patches half-defined classes;
* ``apply()`` and an import of a watched module race in two threads: the hook
  may have missed the module (registered after its import began).
  :func:`settle` runs callbacks for modules that finished meanwhile, and
  :func:`wait_for_inflight_imports` waits on importlib's per-module lock
  (``importlib._bootstrap._ModuleLockManager``, private) *outside* ftshims'
  lock, so the importing thread can finish and the callback runs;
* a module imported, removed from ``sys.modules`` and imported again gets a
  fresh hook, and a cancelled callback never fires (:class:`_Once`).

Every structure here is guarded by :data:`ftshims._util.LOCK`, shared with
the patcher and the manager.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Iterable, List

import wrapt

from ._util import LOCK

_WAITERS: Dict[str, List[Callable[[Any], None]]] = {}



def initializing(module: Any) -> bool:
    """True while importlib is still executing the module's body (it is in sys.modules already)."""
    spec = getattr(module, "__spec__", None)
    return bool(spec is not None and getattr(spec, "_initializing", False))


def is_loaded(module_name: str) -> bool:
    """The module is imported and has finished executing."""
    module = sys.modules.get(module_name)
    return module is not None and not initializing(module)


class _Once:
    """A callback that runs at most once, whichever route (hook, completion, settle) reaches it first."""

    __slots__ = ("callback", "done")

    def __init__(self, callback: Callable[[Any], None]):
        self.callback = callback
        self.done = False

    def __call__(self, module: Any) -> None:
        if not self.done:
            self.done = True
            self.callback(module)

    def cancel(self) -> None:
        with LOCK:
            self.done = True


def _after_initialization(module: Any, once: _Once) -> bool:
    """Run ``once(module)`` when importlib marks ``module`` as initialized; False if impossible.

    A module enters ``sys.modules`` before its body runs. A post-import hook
    for *another* module can fire while this one is half-executed (a modeling
    module's ``from ..modeling_utils import ...`` is what triggers a deferred
    shim), and its classes do not exist yet. importlib sets
    ``spec._initializing = False`` right after the body has run; the spec's
    class is swapped for a subclass that notices that assignment, restores
    the class and runs the callbacks. Returns False when the spec cannot be
    instrumented (the caller then runs the callback at once).
    """
    spec = module.__spec__
    pending = vars(spec).get("_ftshims_pending")
    if pending is None:
        original = type(spec)

        class _NotifyWhenInitialized(original):
            _ftshims_notify = True

            def __setattr__(self, name, value):
                original.__setattr__(self, name, value)
                if name == "_initializing" and not value:
                    _unhook(self)
                    _initialized(module, vars(self).pop("_ftshims_pending", []))

        try:
            pending = []
            vars(spec)["_ftshims_pending"] = pending
            object.__setattr__(spec, "__class__", _NotifyWhenInitialized)
        except TypeError:
            vars(spec).pop("_ftshims_pending", None)
            return False
    pending.append(once)
    if not getattr(spec, "_initializing", False):
        # The body finished between the caller's check and the swap: importlib set the flag on the
        # plain class and nobody will call us. Run what is pending now (the caller holds LOCK).
        _unhook(spec)
        _initialized(module, vars(spec).pop("_ftshims_pending", pending))
    return True


def _unhook(spec: Any) -> None:
    if getattr(type(spec), "_ftshims_notify", False):
        object.__setattr__(spec, "__class__", type(spec).__mro__[1])


def _initialized(module: Any, callbacks: List[_Once]) -> None:
    with LOCK:
        ready = list(callbacks)
        callbacks.clear()
        if sys.modules.get(module.__name__) is not module:
            # The body raised and importlib removed the module: wait for a later, successful import.
            for once in ready:
                _watch(module.__name__, once)
            return
        for once in ready:
            once(module)


def _watch(module_name: str, once: _Once) -> None:
    """Route ``once`` to whichever completes first: the module's import, or its body. Caller holds LOCK."""
    module = sys.modules.get(module_name)
    if module is None:
        waiters = _WAITERS.get(module_name)
        if waiters is None:
            waiters = _WAITERS[module_name] = []
            waiters.append(once)
            wrapt.register_post_import_hook(_fire, module_name)
        else:
            waiters.append(once)
        # An import that had already passed its finders when the hook was registered never
        # reaches wrapt's loader; it shows up in sys.modules instead. Look once more.
        module = sys.modules.get(module_name)
        if module is None:
            return
    if initializing(module) and _after_initialization(module, once):
        return
    once(module)


def settle() -> None:
    """Run waiters whose module is loaded although no hook told us (an import that raced a registration)."""
    with LOCK:
        for name in [n for n, w in _WAITERS.items() if w and is_loaded(n)]:
            module = sys.modules[name]
            for once in _WAITERS.pop(name, []):
                once(module)


def wait_for_inflight_imports(module_names: Iterable[str]) -> None:
    """Let imports of these modules that were already under way finish, then settle their waiters.

    An import that passed the finders before a post-import hook was registered
    never reaches wrapt's loader, and can still be short of ``sys.modules``
    when ``on_import`` looks. Taking each module's import lock (briefly, and
    never while holding LOCK: the importing thread may need it for its own
    hooks) waits such an import out; ``settle()`` then runs its waiters.
    """
    try:
        from importlib._bootstrap import _DeadlockError, _ModuleLockManager
    except ImportError:  # not CPython's importlib: the next ftshims call or hook settles instead
        settle()
        return
    for name in module_names:
        if name in sys.modules:
            continue
        try:
            with _ModuleLockManager(name):
                pass
        except _DeadlockError:
            continue  # this thread is inside that import itself; its completion settles it
    settle()


def on_import(module_name: str, callback: Callable[[Any], None]) -> Callable[[], None]:
    """Call ``callback(module)`` once ``module_name`` is imported and executed (now, if it is).

    Returns a function that cancels the callback if it has not run yet.
    """
    once = _Once(callback)
    with LOCK:
        settle()
        _watch(module_name, once)
    return once.cancel


def _fire(module: Any) -> None:
    """wrapt's post-import hook: the body has run (``_initializing`` is reset just after)."""
    with LOCK:
        for once in _WAITERS.pop(module.__name__, []):
            once(module)
        settle()

