"""Reversible patching: every change ftshims makes goes through a :class:`Patcher`.

A *slot* is one place ftshims writes to: an attribute of a module or class, or
an item of a mapping (a registry such as transformers' mask-function table).
Each slot remembers the object that was there before ftshims touched it and a
stack of *layers*, one per shim that patched it. Writing is always "original,
then every active layer on top", so that

* removing the last layer writes back the very object that was there
  (``module.f is original`` after ``revert()``), or deletes the attribute again
  when it was inherited rather than defined on the class;
* removing a layer from the middle of the stack (two shims on one function,
  reverted out of order) rebuilds the stack without it;
* a slot that someone else re-patched after us is left alone: our layers turn
  into pass-throughs (each wrapper checks its layer's ``active`` flag) and a
  warning says so, instead of clobbering the other patch.

*Foreign patches* (Liger, unsloth, axolotl, LLaMA-Factory and the like replacing
the same targets) are detected both ways and reported in ``status()`` notes
(:func:`foreign_origin`, :meth:`Patcher.foreign_notes`):

* already there when ftshims patches the slot (the object's code lives outside
  the package it is found in): a *wrapper* composes with it (ftshims' layer
  calls the foreign function) and a note says so; an outright replacement
  (``replace``/``set_item``) would discard the other patch, so it steps aside
  (:class:`ForeignPatch`, a :class:`TargetMissing`: the shim, or that part of
  it, is skipped with the reason);
* arriving after ftshims (the slot no longer holds what ftshims wrote): the
  slot is no longer counted as patched, a note says whether the newcomer still
  calls ftshims' wrapper, and ``revert()`` leaves the newcomer in place.

A wrapper is a *plain Python function* whenever the patched object is one
(module functions, methods defined in a class body, registry entries): it
carries ``__wrapped__`` and the original's name and signature, and
``torch.compile`` traces *it*. A ``wrapt.FunctionWrapper`` proxy would not do
there: it passes ``isinstance(w, types.FunctionType)``, so dynamo traces the
wrapped original's code and the shim silently vanishes from the compiled
graph (or dynamo's guards on ``__closure__``/``__defaults__`` fail). Anything
else (classmethod/staticmethod objects, builtins, callable instances) is
wrapped with ``wrapt.FunctionWrapper``, which binds those correctly. Either
way the shim's wrapper has wrapt's signature ``(wrapped, instance, args,
kwargs)``.

Size: slots, layers and the :class:`Patcher` are one unit: revert works out from the recorded layers,
and splitting the slot bookkeeping from the layers that write through it would spread that invariant over
files. The import races live in :mod:`ftshims.imports`, foreign-patch detection in :mod:`ftshims.foreign`.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import sys
import types
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import wrapt

from ._util import LOCK  # one lock for the slots, the import hooks and the manager's state
from ._util import module_globals
from .foreign import MISSING as _MISSING
from .foreign import ForeignPatch, _code_of, describe_object, foreign_origin, is_shim_wrapper  # noqa: F401  (re-exported)
from .imports import on_import
from .spec import TargetMissing

log = logging.getLogger("ftshims")


# Whether each layer is active, by layer key. A module-level dict, not an attribute of the layer
# object: a plain wrapper reached through an object created inside a torch.compile trace has
# no "source" for dynamo, which then cannot handle arbitrary objects in its closure, but it
# can always read (and guard on) a module global.
_ACTIVE: Dict[int, bool] = {}
_KEYS = itertools.count()


class _Layer:
    __slots__ = ("shim_id", "build", "key")

    def __init__(self, shim_id: str):
        self.shim_id = shim_id
        self.build: Callable[[Any], Any] = lambda inner: inner
        self.key = next(_KEYS)
        _ACTIVE[self.key] = True

    @property
    def active(self) -> bool:
        return _ACTIVE.get(self.key, False)

    @active.setter
    def active(self, value: bool) -> None:
        if value:
            _ACTIVE[self.key] = True
        else:
            _ACTIVE.pop(self.key, None)


class _Slot:
    """One attribute or mapping item, with the stack of shims patching it."""

    def __init__(self, container: Any, key: Any, is_item: bool, label: Optional[str] = None):
        self.container = container
        self.key = key
        self.is_item = is_item
        self.label = label
        self.layers: List[_Layer] = []
        own = self._read_own()
        self.had_own = own is not _MISSING
        if self.had_own:
            self.original = own
        elif is_item:
            raise KeyError(key)
        else:
            # Inherited attribute: the raw descriptor from the MRO, so that a
            # wrapped classmethod/staticmethod keeps its binding behaviour.
            self.original = inspect.getattr_static(container, key)
        self.written: Any = _MISSING

    def describe(self) -> str:
        if self.label:
            return self.label
        name = getattr(self.container, "__qualname__", None) or getattr(self.container, "__name__", None)
        if name is None:
            name = type(self.container).__name__
        return f"{name}[{self.key!r}]" if self.is_item else f"{name}.{self.key}"

    def _read_own(self) -> Any:
        if self.is_item:
            return self.container.get(self.key, _MISSING) if hasattr(self.container, "get") else _MISSING
        return vars(self.container).get(self.key, _MISSING)

    def _write(self, value: Any) -> None:
        if self.is_item:
            self.container[self.key] = value
        else:
            setattr(self.container, self.key, value)

    def _restore(self) -> None:
        if self.had_own:
            self._write(self.original)
        elif self.is_item:
            self.container.pop(self.key, None)
        elif self.key in vars(self.container):
            delattr(self.container, self.key)

    def tampered(self) -> bool:
        """True when the slot no longer holds what we last wrote (someone re-patched it)."""
        return self.written is not _MISSING and self._read_own() is not self.written

    def takeover(self) -> Optional[str]:
        """A note when someone re-patched the slot after ftshims: who, and whether ftshims' layer still runs."""
        if not self.tampered():
            return None
        now = self._read_own()
        chained = _calls_into(now, self.written)
        who = describe_object(now) if now is not _MISSING else "nothing (deleted)"
        effect = (
            "it wraps ftshims' wrapper, which still runs inside it"
            if chained
            else "ftshims' wrapper there is no longer called (unless the new code calls it); revert() will leave the new code in place"
        )
        return f"{self.describe()} was replaced by foreign code after ftshims patched it ({who}): {effect}"

    def rebuild(self) -> None:
        if self.tampered():
            log.warning(
                "%s was replaced by other code after ftshims patched it; "
                "leaving the other patch in place (ftshims' wrapper there now passes through)",
                self.describe(),
            )
            return
        if not self.layers:
            self._restore()
            self.written = _MISSING
            return
        value = self.original
        for layer in self.layers:
            value = layer.build(value)
        self._write(value)
        self.written = value

    def current(self) -> Any:
        """What code that reads this slot now gets: our top layer, or the original."""
        return self.original if self.written is _MISSING else self.written


def _calls_into(outer: Any, target: Any) -> bool:
    """Whether ``outer`` keeps ``target`` to call: through ``__wrapped__`` (functools.wraps) or a closure cell."""
    seen = set()
    todo = [outer]
    while todo and len(seen) < 32:
        value = _code_of(todo.pop())
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        if value is target:
            return True
        if is_shim_wrapper(value):
            continue
        wrapped = getattr(value, "__wrapped__", None)
        if wrapped is not None:
            todo.append(wrapped)
        for cell in getattr(value, "__closure__", None) or ():
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    return False


def _sweepable(value: Any) -> bool:
    """Only objects a shim built (wrappers, functions, classes) can have copies worth chasing.

    Never constants: ``None``, ``False`` or a small int are shared by every
    module, and "restoring" their copies would rewrite unrelated globals.
    """
    return isinstance(value, (wrapt.ObjectProxy, types.FunctionType, type))  # plain wrappers are functions


def _sweep_copies(replacements: Dict[int, Tuple[Any, Any]]) -> None:
    """Point module-level copies of replaced wrappers at their replacements.

    A module imported after a shim wrapped a module-level function may have
    copied the wrapper (``from peft.utils.other import f`` runs after the
    post-import hook patched ``f``). When the wrapper is taken away, those
    copies must get the original back too, or revert would not restore
    identity everywhere. ``replacements`` maps ``id(old)`` to ``(old, new)``.
    """
    if not replacements:
        return
    for module, attr, value in module_globals():
        hit = replacements.get(id(value))
        if hit is not None and hit[0] is value:
            vars(module)[attr] = hit[1]


# id(container), key, is_item -> slot. Containers are kept alive by the slot.
_SLOTS: Dict[Tuple[int, Any, bool], _Slot] = {}


def _slot(container: Any, key: Any, is_item: bool, label: Optional[str] = None) -> _Slot:
    ident = (id(container), key, is_item)
    slot = _SLOTS.get(ident)
    if slot is None:
        slot = _Slot(container, key, is_item, label)
        _SLOTS[ident] = slot
    return slot


def original_of(container: Any, key: Any) -> Any:
    """The object that was at ``container.key`` before any shim patched it (for tests)."""
    slot = _SLOTS.get((id(container), key, False))
    return slot.original if slot else getattr(container, key)


def _guarded(layer: _Layer, wrapper: Callable) -> Callable:
    """A wrapt wrapper that becomes a pass-through once its layer is deactivated."""

    def guarded(wrapped, instance, args, kwargs):
        if layer.active:
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    return guarded


class _Bound:
    """The ``wrapped`` a method wrapper receives: calls ``inner(obj, ...)`` directly.

    Not ``inner.__get__(obj)``: when the wrapped method graph-breaks under
    ``torch.compile``, dynamo resumes by rebuilding that bound method by name
    (``obj.forward``), which is the wrapper again: endless recursion (Qwen2-MoE on
    4.57 compiled with ftshims 0.1.0). ``__func__``/``__self__`` are kept as a bound
    method has them.
    """

    __slots__ = ("__func__", "__self__")

    def __init__(self, func: Callable, obj: Any) -> None:
        self.__func__, self.__self__ = func, obj

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)


def _plain_wrapper(inner: Callable, layer: _Layer, wrapper: Callable, method: bool) -> Callable:
    """A plain function calling ``wrapper(wrapped, instance, args, kwargs)`` like wrapt would.

    ``method``: ``inner`` sits in a class body, so the first argument is the
    instance (``obj.f(x)`` and ``Cls.f(obj, x)`` alike, as with wrapt). The
    wrapper passes through once its layer is deactivated; under
    ``torch.compile`` that flag is an ordinary guarded attribute.
    """
    key = layer.key
    if method:

        @functools.wraps(inner)
        def patched(self, *args, **kwargs):
            if _ACTIVE.get(key, False):
                return wrapper(_Bound(inner, self), self, args, kwargs)
            return inner(self, *args, **kwargs)

    else:

        @functools.wraps(inner)
        def patched(*args, **kwargs):
            if _ACTIVE.get(key, False):
                return wrapper(inner, None, args, kwargs)
            return inner(*args, **kwargs)

    patched.__ftshims_shim__ = layer.shim_id
    patched.__ftshims_self__ = weakref.ref(patched)  # which function the mark belongs to (foreign.is_shim_wrapper)
    return patched


def _wrapper_builder(layer: _Layer, wrapper: Callable, method: bool) -> Callable[[Any], Any]:
    def build(inner: Any) -> Any:
        if type(inner) is types.FunctionType:
            return _plain_wrapper(inner, layer, wrapper, method)
        return wrapt.FunctionWrapper(inner, _guarded(layer, wrapper))

    return build


def wrapper_depth(value: Any) -> int:
    """How many shim wrappers are stacked on ``value`` (for tests)."""
    depth = 0
    while is_shim_wrapper(value):
        depth += 1
        value = value.__wrapped__
    return depth


# ---------------------------------------------------------------------------


def resolve(module: Any, qualname: str) -> Tuple[Any, str]:
    """``(owner, attribute)`` for a dotted path inside ``module``; TargetMissing if absent."""
    owner = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = vars(owner).get(part, _MISSING) if inspect.ismodule(owner) else getattr(owner, part, _MISSING)
        if owner is _MISSING:
            raise TargetMissing(f"{module.__name__}.{qualname} not found ({part!r} is missing)")
    if not hasattr(owner, parts[-1]):
        raise TargetMissing(f"{module.__name__}.{qualname} not found")
    return owner, parts[-1]


def require_params(func: Any, names: Iterable[str], where: str) -> None:
    """TargetMissing unless ``func`` accepts every parameter in ``names``."""
    names = tuple(names)
    if not names:
        return
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError) as exc:
        raise TargetMissing(f"{where}: signature unreadable ({exc})") from exc
    missing = [n for n in names if n not in params]
    if missing:
        raise TargetMissing(f"{where}: signature changed, no parameter {', '.join(missing)}")


class Patcher:
    """Records every change one shim makes, so that ``undo()`` reverses it exactly.

    Shims receive a Patcher in ``install(patcher, options)`` and must make all
    their changes through it. Raising from ``install`` (TargetMissing or any
    other exception) makes the manager call ``undo()``: a shim is never left
    half-applied.
    """

    def __init__(
        self,
        shim_id: str,
        on_part_error: Optional[Callable[[str, BaseException], None]] = None,
        own: Iterable[str] = (),
    ):
        self.shim_id = shim_id
        # Top-level packages whose objects are not foreign in this shim's slots (see foreign_origin).
        self.own = tuple(own)
        self._layers: List[Tuple[_Slot, _Layer]] = []
        self._cancels: List[Callable[[], None]] = []
        self._on_part_error = on_part_error
        self.notes: List[str] = []
        # True while the shim's install() runs: a part failing then fails install() itself.
        self.installing = False
        # Modules whose parts of this shim are not installed yet (see when_imported).
        self.waiting: List[str] = []

    # -- primitives --------------------------------------------------------

    def _push(
        self,
        container: Any,
        key: Any,
        is_item: bool,
        make_build: Callable[[_Layer], Callable],
        label: Optional[str] = None,
        composes: bool = True,
    ) -> Any:
        with LOCK:
            fresh = _SLOTS.get((id(container), key, is_item)) is None
            slot = _slot(container, key, is_item, label)
            for existing, _ in self._layers:
                if existing is slot:  # one layer per shim per slot: patching twice is a no-op
                    return slot.written
            foreign = foreign_origin(container, slot.original, self.own) if slot.had_own else None
            if foreign:
                if not composes:
                    if fresh and not slot.layers:
                        _SLOTS.pop((id(container), key, is_item), None)
                    raise ForeignPatch(
                        f"{slot.describe()} already holds foreign code ({foreign}): "
                        "ftshims would replace it outright, so it steps aside and leaves the other patch in place"
                    )
                note = (
                    f"{slot.describe()} already held foreign code when ftshims patched it ({foreign}): "
                    "ftshims' wrapper composes with it (calls it)"
                )
                if note not in self.notes:
                    self.notes.append(note)
            layer = _Layer(self.shim_id)
            layer.build = make_build(layer)
            slot.layers.append(layer)
            self._layers.append((slot, layer))
            slot.rebuild()
            return slot.written

    def wrap(self, owner: Any, name: str, wrapper: Callable) -> Any:
        """Wrap ``owner.name`` with a wrapt-style ``wrapper(wrapped, instance, args, kwargs)``.

        On a class, a function defined in (or inherited into) the class body is
        wrapped as a method: ``instance`` is the object it was called on.
        """
        method = isinstance(owner, type)
        return self._push(owner, name, False, lambda layer: _wrapper_builder(layer, wrapper, method))

    def wrap_method(self, module: str, qualname: str, wrapper: Callable) -> Any:
        """Wrap ``Class.method`` of the imported ``module`` like :meth:`wrap`.

        Raises :class:`TargetMissing` when the class, or a callable ``method`` on it, is not there.
        """
        class_name, _, attr = qualname.partition(".")
        owner = getattr(sys.modules.get(module), class_name, None)
        if not isinstance(owner, type) or not callable(getattr(owner, attr, None)):
            raise TargetMissing(f"{module}.{qualname} is missing")
        return self.wrap(owner, attr, wrapper)

    def replace(self, owner: Any, name: str, new: Any) -> Any:
        """Replace ``owner.name`` with ``new`` outright (a class, a constant, a bound hook)."""
        return self._push(owner, name, False, lambda layer: lambda inner: new, composes=False)

    def set_item(self, mapping: Any, key: Any, new: Any, label: Optional[str] = None) -> Any:
        """Replace ``mapping[key]`` (the key must exist); ``label`` names the slot in reports."""
        return self._push(mapping, key, True, lambda layer: lambda inner: new, label, composes=False)

    def wrap_item(self, mapping: Any, key: Any, wrapper: Callable, label: Optional[str] = None) -> Any:
        """Wrap ``mapping[key]`` (a function in a registry) like :meth:`wrap`; ``label`` names it in reports."""
        return self._push(mapping, key, True, lambda layer: _wrapper_builder(layer, wrapper, False), label)

    def wrap_aliases(self, original: Any, wrapper: Callable, packages: Optional[Iterable[str]] = None) -> int:
        """Wrap every module-level name bound to ``original``, in ``packages`` or (None) in every module.

        ``from x import f`` copies ``f`` into the importing module; wrapping only
        the definition would miss those call sites (a trainer module, or the
        user's own script that imported the function before ``apply()``).
        Modules imported later pick up the wrapped object from the already
        patched definition site. Returns the number of sites wrapped.
        """
        prefixes = None if packages is None else tuple(packages)
        count = 0
        for mod_name, module in list(sys.modules.items()):
            if module is None or (prefixes is not None and mod_name.split(".", 1)[0] not in prefixes):
                continue
            try:
                namespace = vars(module)
            except TypeError:
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    self.wrap(module, attr, wrapper)
                    count += 1
        return count

    def when_imported(self, module_name: str, install_part: Callable[[Any], None]) -> None:
        """Run ``install_part(module)`` when ``module_name`` is imported (now if it is).

        For shims that patch a family of optional modules (one modeling file per
        model): each part is installed as its module appears. A part raising
        TargetMissing is skipped (that model lacks the target); any other error
        is reported to the manager, which rolls the whole shim back.
        """

        def run(module):
            if module_name in self.waiting:
                self.waiting.remove(module_name)
            try:
                install_part(module)
            except TargetMissing as exc:
                self.notes.append(str(exc))
            except Exception as exc:  # reported, and the shim rolled back, by the manager
                if self.installing or self._on_part_error is None:
                    raise
                self._on_part_error(self.shim_id, exc)

        self.waiting.append(module_name)
        self._cancels.append(on_import(module_name, run))

    def on_undo(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when this shim is reverted or rolled back (for state kept outside slots)."""
        self._cancels.append(callback)

    # -- inspection and undo -------------------------------------------------

    @property
    def patched(self) -> List[str]:
        """The places this shim holds now (a slot another patcher took over since is not counted)."""
        return [slot.describe() for slot, _ in self._layers if not slot.tampered()]

    def foreign_notes(self) -> List[str]:
        """Slots of this shim that foreign code replaced after ftshims patched them (computed now)."""
        with LOCK:
            notes = [slot.takeover() for slot, _ in self._layers]
        return [note for note in notes if note]

    @property
    def slots(self) -> List[Tuple[Any, Any, bool, Any]]:
        """``(container, key, is_item, original)`` for every place this shim patched."""
        return [(slot.container, slot.key, slot.is_item, slot.original) for slot, _ in self._layers]

    def undo(self) -> None:
        with LOCK:
            for cancel in self._cancels:
                cancel()
            self._cancels.clear()
            self.waiting.clear()
            replacements: Dict[int, Tuple[Any, Any]] = {}
            for slot, layer in reversed(self._layers):
                layer.active = False
                if layer in slot.layers:
                    slot.layers.remove(layer)
                before = slot.current()
                slot.rebuild()
                after = slot.current()
                if inspect.ismodule(slot.container) and after is not before and _sweepable(before) and not slot.tampered():
                    replacements[id(before)] = (before, after)
                if not slot.layers and not slot.tampered():
                    _SLOTS.pop((id(slot.container), slot.key, slot.is_item), None)
            self._layers.clear()
            _sweep_copies(replacements)
