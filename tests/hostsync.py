"""Count, on the CPU, the operations that would be a host-device synchronisation on an accelerator.

A synchronisation has a signature the CPU can see: the host reads a tensor's *value*. At the
dispatcher that is ``aten::_local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()`` of a
tensor, ``if t.any():``), ``aten::equal`` / ``aten::allclose``, and every op whose output *shape*
depends on values (``nonzero``, ``masked_select``, ``unique*``, ``bincount``, ``repeat_interleave``
without ``output_size``, indexing or ``index_put_`` with a boolean mask). Above the dispatcher,
``Tensor.tolist()``, ``.numpy()``, ``.cpu()`` and ``torch.tensor([...tensors...])`` read values without
dispatching an op on a CPU tensor, so a ``TorchFunctionMode`` watches those.

``SyncCounter`` is both modes at once; ``counter.step(key)`` puts what follows into bucket ``key``
(``None``: not counted). Every event records its op and its *site*: the innermost Python frame
outside torch and the standard library, ``path:line (function)``, the code that asked for the value.

Blind spot, by construction: a CPU run cannot tell a tensor that would live on the device from one
that really lives on the host (a collated batch before ``.to(device)``, optimizer state kept on the
CPU), nor a ``.to(device)`` that would copy to the host. The tests compare a run with ftshims against
the same run without, so what upstream does is counted on both sides, and each site is listed.
"""

from __future__ import annotations

import collections
import os
import sys
import sysconfig
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a value to the host, or whose output shape depends on values (by name, any overload)
VALUE_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal", "aten::allclose",
    "aten::nonzero", "aten::nonzero_numpy", "aten::argwhere", "aten::masked_select",
    "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
    "aten::unique_dim_consecutive", "aten::bincount", "aten::histc",
})
# ops that sync only in some calls: boolean-mask indexing, repeat_interleave without output_size
BOOL_INDEX_OPS = frozenset({"aten::index", "aten::_index_put_impl_", "aten::index_put", "aten::index_put_"})
REPEAT_OPS = frozenset({"aten::repeat_interleave"})
# Tensor methods / torch functions that read values without an op the dispatcher sees (on a CPU tensor)
HOST_METHODS = {"tolist", "numpy", "cpu"}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_SKIP_DIRS = (_TORCH_DIR, sysconfig.get_paths()["stdlib"] + os.sep)
_HERE = os.path.abspath(__file__)


def _site() -> str:
    """The innermost frame outside torch, the standard library and this file: who asked for the value."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if os.path.abspath(path) != _HERE and not path.startswith(_SKIP_DIRS) and "<frozen" not in path:
            return f"{_short(path)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "ftshims" + os.sep, os.sep + "tests" + os.sep):
        if marker in path:
            head, _, tail = path.rpartition(marker)
            return (marker.strip(os.sep) + "/" if marker != "site-packages" + os.sep else "") + tail
    return path


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(torch.is_tensor(i) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()) if i is not None)


def _holds_tensor(data) -> bool:
    if torch.is_tensor(data):
        return True
    if isinstance(data, (list, tuple)):
        return any(_holds_tensor(d) for d in data)
    return False


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.key is not None:
            name = func._schema.name
            if (name in VALUE_OPS
                    or (name in BOOL_INDEX_OPS and _has_bool_index(args))
                    or (name in REPEAT_OPS and kwargs.get("output_size") is None
                        and not (len(args) > 3 and args[3] is not None))):
                self.counter.record(func.name())
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counter.key is not None:
            name = getattr(func, "__name__", "")
            if name in HOST_METHODS and args and torch.is_tensor(args[0]) and args[0].device.type == "cpu":
                self.counter.record(f"Tensor.{name}")
            elif func in (torch.tensor, torch.as_tensor) and args and not torch.is_tensor(args[0]) and _holds_tensor(args[0]):
                self.counter.record(f"torch.{name}(tensors)")
        return func(*args, **kwargs)


class SyncCounter:
    """``with SyncCounter() as c: c.step("a"); ...``: ``c.counts["a"]`` is a Counter of (op, site)."""

    def __init__(self):
        self.key = None
        self.counts = collections.defaultdict(collections.Counter)
        self._modes = (_Function(self), _Dispatch(self))

    def step(self, key) -> None:
        self.key = key

    def record(self, op: str) -> None:
        key, self.key = self.key, None  # nothing the recording itself does is counted
        try:
            self.counts[key][(op, _site())] += 1
        finally:
            self.key = key

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self.key = None
        return False


def by_op(counts: collections.Counter) -> collections.Counter:
    out = collections.Counter()
    for (op, _), n in counts.items():
        out[op] += n
    return out


def added(plain: collections.Counter, shimmed: collections.Counter) -> dict:
    """Per op, how many more syncs ``shimmed`` has than ``plain`` (only the ops with more)."""
    a, b = by_op(plain), by_op(shimmed)
    return {op: b[op] - a[op] for op in b if b[op] > a[op]}


def describe(plain: collections.Counter, shimmed: collections.Counter) -> str:
    """The sites whose counts differ between the two runs, for a failure message."""
    lines = []
    for key in sorted(set(plain) | set(shimmed)):
        if plain[key] != shimmed[key]:
            lines.append(f"  {key[0]} at {key[1]}: {plain[key]} -> {shimmed[key]}")
    return "\n".join(lines) or "  (same sites)"


def format_stack(limit: int = 12) -> str:  # for debugging a site by hand
    return "".join(traceback.format_stack(limit=limit))
