"""The list of shims, loaded on demand.

Shim modules are cheap to import (a spec, a docstring and functions whose
bodies import the heavy packages), so loading the registry never imports
torch, transformers, peft or trl.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple, runtime_checkable

from .shims import SHIM_IDS
from .spec import ShimSpec


@runtime_checkable
class ShimModule(Protocol):
    """What a module in ``ftshims/shims/`` provides (checked when the registry loads it).

    ``SPEC`` is its :class:`~ftshims.spec.ShimSpec`; ``install(patcher, options)``
    makes every change through the :class:`~ftshims.patching.Patcher` (raising
    ``TargetMissing`` when a target is absent or changed); an optional
    ``probe(**scenario) -> Observation`` reproduces the bug on a tiny model, for
    the tests and the doctor. Adding a shim, the checklist (tests/registry/test_checklist.py
    enforces it): the module; its id in ``SHIM_IDS``; ``tests/shims/test_<id>.py``,
    whose tests fail against a no-op version (``nox -s mutation_check``); evidence
    from a matrix run (``python -m ftshims.matrix --evidence DIR --record``); the
    regenerated COMPAT_MATRIX.md (``python -m ftshims.matrix``).
    """

    SPEC: ShimSpec

    def install(self, patcher: Any, options: Mapping[str, Any]) -> None: ...


@dataclass(frozen=True)
class Shim:
    spec: ShimSpec
    module: ModuleType

    @property
    def id(self) -> str:
        return self.spec.id

    def install(self, patcher, options) -> None:
        self.module.install(patcher, options)

    @property
    def probe(self):
        """The shim's reproduction (``probe() -> Observation``), or None if it has none."""
        return getattr(self.module, "probe", None)


_CACHE: Optional[Dict[str, Shim]] = None
_ERRORS: Dict[str, str] = {}


def shims() -> Dict[str, Shim]:
    """All loadable registered shims by id, in registry order.

    A shim module that fails to import (or declares the wrong id) is left out
    and its error kept in :func:`load_errors`, so that one broken shim cannot
    make ``apply()`` raise into user code.
    """
    global _CACHE
    if _CACHE is None:
        _ERRORS.clear()
        loaded: Dict[str, Shim] = {}
        for shim_id in SHIM_IDS:
            try:
                module = importlib.import_module(f"ftshims.shims.{shim_id}")
                if not isinstance(module, ShimModule) or not isinstance(getattr(module, "SPEC", None), ShimSpec):
                    raise RuntimeError(f"ftshims/shims/{shim_id}.py lacks SPEC = ShimSpec(...) or install(patcher, options)")
                spec = module.SPEC
                if spec.id != shim_id:
                    raise RuntimeError(f"ftshims/shims/{shim_id}.py declares id {spec.id!r}")
            except Exception as exc:  # reported by status() and the doctor as a failed shim
                _ERRORS[shim_id] = f"shim module failed to load: {type(exc).__name__}: {exc}"
                continue
            loaded[shim_id] = Shim(spec, module)
        _CACHE = loaded
    return _CACHE


def load_errors() -> Dict[str, str]:
    """Shim ids whose module could not be loaded, with the reason."""
    shims()
    return {shim_id: reason for shim_id, reason in _ERRORS.items() if shim_id in SHIM_IDS}


def get(shim_id: str) -> Shim:
    try:
        return shims()[shim_id]
    except KeyError:
        raise ValueError(f"unknown shim id {shim_id!r}; known: {', '.join(shims())}") from None


def ids() -> Tuple[str, ...]:
    return tuple(shims())


def packages() -> Tuple[str, ...]:
    """Every distribution named by any shim's ``requires``, sorted."""
    names = set()
    for shim in shims().values():
        names.update(shim.spec.requires)
    return tuple(sorted(names))


def import_shim_modules() -> Dict[str, Optional[str]]:
    """Import every module a registered shim waits for, so deferred shims install now.

    Returns ``{module: None or "ExceptionType: message"}``; an import that fails
    is reported, not raised (the package may be absent or broken).
    """
    results: Dict[str, Optional[str]] = {}
    for shim in shims().values():
        for name in shim.spec.modules:
            if name in results:
                continue
            try:
                importlib.import_module(name)
                results[name] = None
            except Exception as exc:
                results[name] = f"{type(exc).__name__}: {exc}"
    return results
