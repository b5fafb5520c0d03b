"""The mutation check's pytest plugin: ``--noop-shim ID`` installs shim ID as a no-op.

Loaded by ``tests/conftest.py``. With the option, every patch the named shim
makes through its :class:`~ftshims.patching.Patcher` is still *installed* (its
targets are looked up, checked and recorded; ``status()`` says applied and
``revert()`` works) but does nothing: a wrapper becomes a pass-through and a
replacement keeps the original. A shim's tests that still pass against such a
no-op cannot tell the shim from its absence. ``tools/mutation.py`` runs it.
"""

from __future__ import annotations


def _passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def make_noop(shim_ids) -> None:
    """Patch :class:`Patcher` so that the shims in ``shim_ids`` install pass-through layers (for this test process)."""
    from ftshims.patching import Patcher

    ids = frozenset(shim_ids)
    wrap, wrap_item, push = Patcher.wrap, Patcher.wrap_item, Patcher._push

    def noop_wrap(self, owner, name, wrapper):
        return wrap(self, owner, name, _passthrough if self.shim_id in ids else wrapper)

    def noop_wrap_item(self, mapping, key, wrapper, label=None):
        return wrap_item(self, mapping, key, _passthrough if self.shim_id in ids else wrapper, label)

    def noop_replace(self, owner, name, new):
        if self.shim_id in ids:
            return push(self, owner, name, False, lambda layer: lambda inner: inner)
        return push(self, owner, name, False, lambda layer: lambda inner: new)

    def noop_set_item(self, mapping, key, new, label=None):
        if self.shim_id in ids:
            return push(self, mapping, key, True, lambda layer: lambda inner: inner, label)
        return push(self, mapping, key, True, lambda layer: lambda inner: new, label)

    Patcher.wrap, Patcher.wrap_item = noop_wrap, noop_wrap_item
    Patcher.replace, Patcher.set_item = noop_replace, noop_set_item
