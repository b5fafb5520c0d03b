"""``import ftshims.auto`` applies the shims: the one-line form of ``ftshims.apply()``.

Importing this module *does* patch (that is its only purpose); ``import ftshims``
alone never does.

``FTSHIMS_AUTO`` says what to apply (grammar in :mod:`ftshims.settings`):
unset, ``1``/``true``/``yes``/``on``: the defaults; ``0``/``false``/``no``/``off``
or empty: nothing; a JSON object of ``apply()`` arguments, e.g. ``{"include":
["rope_fused_kernel"], "options": {"max_positions_guard": {"policy": "warn"}}}``:
those. The ``ftshims-auto.pth`` hook imports this module at interpreter
start-up whenever ``FTSHIMS_AUTO`` is set, which is how torchrun ranks,
accelerate workers and spawned DataLoader workers get the same shims as the
launcher.

``report`` is the resulting ``ftshims.status()``, or None when ``FTSHIMS_AUTO``
is off. A bad ``FTSHIMS_*`` value applies nothing and prints one line on stderr: this
runs at start-up of every process, where a traceback or an exit would break
programs that never asked for ftshims.
"""

import os
import sys

import ftshims
from ftshims import settings

AUTO_ENV = settings.AUTO_ENV


def _apply():
    try:
        arguments = settings.parse_auto(os.environ.get(AUTO_ENV))
        if arguments is None:
            return None  # FTSHIMS_AUTO is off: not even the machinery is imported (this runs in every process)
        return ftshims.apply(**arguments)
    except ValueError as exc:  # settings are checked before anything is installed: nothing was applied
        print(f"ftshims: {' '.join(str(exc).split())}; no shims applied", file=sys.stderr)
        return ftshims.status()


report = _apply()

if settings.MONITOR_ENV in os.environ:
    # FTSHIMS_MONITOR: the training health monitor on every Trainer (the hook line imports this too; here
    # for hook files written before the monitor existed, and for an explicit `import ftshims.auto`)
    import ftshims.monitor.startup  # noqa: F401,E402
