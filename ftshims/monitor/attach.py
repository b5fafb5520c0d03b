"""Attach the monitor's callback to every ``Trainer`` built in this process (what ``FTSHIMS_MONITOR=1`` does).

``ftshims.monitor.startup`` calls :func:`attach_to_trainers` with the options of
``FTSHIMS_MONITOR``; code can call it directly (``ftshims.monitor.attach_to_trainers()``).

It goes through ftshims' own :class:`~ftshims.patching.Patcher`:
``transformers.trainer.Trainer.__init__`` is wrapped (now, or when
``transformers.trainer`` is imported) to ``add_callback(callback(**options))``
after the original ran, unless the trainer already has one; and
``ftshims.revert()`` (all shims, no ``only=``) undoes it
(``_manager.on_full_revert``). The shims' selection is untouched:
``FTSHIMS_MONITOR=1`` alone applies no shim.

Bad options are a ``ValueError`` before anything is attached.
"""

from __future__ import annotations

import logging

from . import options as options_mod

log = logging.getLogger("ftshims.monitor")

_PATCHER = []  # the active Patcher, if attached


def attach_to_trainers(**options) -> None:
    """Every ``Trainer`` built from now on gets ``ftshims.monitor.callback(**options)``; ``ftshims.revert()`` undoes it."""
    options_mod.check(options)  # ValueError now, not at the first Trainer
    from .. import _manager
    from ..patching import LOCK, Patcher

    with LOCK:
        detach_from_trainers()
        patcher = Patcher("monitor", on_part_error=_part_failed)

        def install(module) -> None:
            patcher.wrap(module.Trainer, "__init__", _trainer_init(dict(options)))

        patcher.when_imported("transformers.trainer", install)
        _PATCHER.append(patcher)
        _manager.on_full_revert(detach_from_trainers)


def detach_from_trainers() -> None:
    """Trainers built from now on get no monitor (callbacks already added stay)."""
    from ..patching import LOCK

    with LOCK:
        while _PATCHER:
            _PATCHER.pop().undo()


def attached() -> bool:
    return bool(_PATCHER)


def _trainer_init(options):
    def init(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        from .trainer import MonitorCallback, callback

        handler = getattr(instance, "callback_handler", None)
        if handler is not None and not any(isinstance(cb, MonitorCallback) for cb in handler.callbacks):
            instance.add_callback(callback(**options))
        return result

    return init


def _part_failed(owner: str, exc: BaseException) -> None:
    log.warning("could not attach to transformers' Trainer (%s: %s); monitor not attached",
                type(exc).__name__, exc)
    detach_from_trainers()
