"""ftshims: fixes for the known bugs of *your installed* torch / transformers / peft / trl stack.

    import ftshims
    ftshims.apply()          # or: import ftshims.auto

Importing this package patches nothing and imports none of the packages it
patches; the machinery loads on the first call below. See README.md for the
environment variables and COMPAT_MATRIX.md for what each shim fixes.
"""

from __future__ import annotations

import contextlib

__version__ = "0.3.0"  # ftshims/releases.py lists every release; pyproject.toml says the same

__all__ = ["apply", "revert", "applied", "status", "summary", "fingerprint", "ShimError", "__version__"]


def apply(only=None, exclude=None, strict=False, include=None, options=None, propagate=False, release=None):
    """Apply the shims whose bugs exist in the installed versions; return a report.

    only:    apply just these shim ids (speed shims listed here are included).
    exclude: never apply these shim ids.
    strict:  raise ``ShimError`` when a shim fails to install, instead of
             rolling it back and reporting it.
    include: opt-in shims (``kind="speed"``) to apply on top of the defaults.
    options: per-shim options, ``{"shim_id": {"option": value}}``.
    propagate: also export this selection in ``FTSHIMS_AUTO`` so that child
             processes (torchrun ranks, spawned DataLoader workers) apply the
             same shims at start-up, through the ``ftshims-auto.pth`` hook.
    release: apply only what that ftshims release applied (``"0.1"``):
             shims added or changed since are left out and listed in
             ``status()`` as newer than the pinned release, with what they
             would fix. An unknown release is a ``ValueError``; naming a newer
             shim in ``only``/``include`` under a pin is one too.

    Shim ids are case-insensitive and ``-`` stands for ``_``. Every setting
    (ids, option names and values, and the ``FTSHIMS_*`` variables the
    selected shims read) is checked before anything is installed: a bad one
    is a ``ValueError`` naming it, and nothing changes (see
    :mod:`ftshims.settings`).

    Idempotent and thread-safe: shims already applied are left as they are.
    Shims on modules that are not imported yet are installed by a post-import
    hook when they are. Apart from ``strict=True`` and those ``ValueError`` exceptions,
    no exception escapes.
    """
    from . import _manager

    report = _manager.apply(only=only, exclude=exclude, strict=strict, include=include, options=options, release=release)
    if propagate:
        _manager.export_to_children(only=only, exclude=exclude, strict=strict, include=include, options=options,
                                    release=release)
    return report


def revert(only=None):
    """Undo applied shims (all, or those in ``only``); the original objects are restored."""
    from . import _manager

    return _manager.revert(only=only)


def status():
    """The current report: one entry per registered shim."""
    from . import _manager

    return _manager.status()


def summary() -> str:
    """One line: how many shims are applied and deferred (the counts ``status()`` gives) and what each applied
    one did so far, e.g. ``ftshims: 8 shims applied, 2 deferred (waiting for import of trl); acted:
    packing_block_mask 12 block masks built; rope_inv_freq_fp32 ...``.
    ``FTSHIMS_SUMMARY=1`` prints it at exit (on rank 0)."""
    from . import _manager

    return _manager.summary_line()


def fingerprint() -> dict:
    """What the active shims compute, as a short stable hash plus the dict it hashes.

    ``{"hash": "3f9c0a1b2c4d", "ftshims": "0.2.0", "release": None or the pin,
    "versions": {distribution: version} that gate the active shims,
    "shims": [{"id", "since": release, "options": {non-default options}}, ...]}``
    (sorted by id).
    Two runs with the same hash applied the same fixes; the monitor writes it
    at train begin, the doctor's JSON carries it, ``FTSHIMS_SUMMARY=1`` prints it.
    """
    from . import _manager

    return _manager.fingerprint()


@contextlib.contextmanager
def applied(only=None, exclude=None, strict=False, include=None, options=None, release=None):
    """Apply shims for the duration of a ``with`` block, then revert the ones this call applied."""
    from . import _manager

    before = {entry.id for entry in _manager.status() if entry.active}
    report = _manager.apply(only=only, exclude=exclude, strict=strict, include=include, options=options, release=release)
    newly = [entry.id for entry in report if entry.active and entry.id not in before]
    try:
        yield report
    finally:
        if newly:
            _manager.revert(only=newly)


def __getattr__(name):
    if name == "ShimError":
        from ._manager import ShimError

        return ShimError
    raise AttributeError(f"module 'ftshims' has no attribute {name!r}")
