"""``FTSHIMS_MONITOR``: importing this module attaches the monitor to every ``Trainer`` built in this process.

The start-up hook (``ftshims-auto.pth``) imports it when ``FTSHIMS_MONITOR`` is
set, in every Python process (torchrun ranks, accelerate workers,
``llamafactory-cli``, ``axolotl train``), as it imports ``ftshims.auto`` for
``FTSHIMS_AUTO``; ``ftshims.auto`` imports it too (so a hook file installed
before the monitor existed still works with ``FTSHIMS_AUTO`` set). The values
(``1``/``true``/``yes``/``on``, ``0``/``false``/``no``/``off`` or empty, or a JSON
object of monitor options; ``FTSHIMS_MONITOR_LOG``: the JSONL path) are parsed by
:mod:`ftshims.settings`. How it attaches: :mod:`ftshims.monitor.attach`.

A bad value attaches nothing and prints one ``ftshims: `` line on stderr: this
runs at start-up of every process, where a traceback would break programs that
never asked for the monitor. ``python -m ftshims.doctor`` reports the problem.
"""

import sys


def _from_environment() -> None:
    from ..settings import parse_monitor, parse_monitor_log
    from .attach import attach_to_trainers

    try:
        options = parse_monitor()
        parse_monitor_log()
        if options is not None:
            attach_to_trainers(**options)
    except ValueError as exc:  # checked before anything is attached: nothing was
        print(f"ftshims: {' '.join(str(exc).split())}; monitor not attached", file=sys.stderr)


_from_environment()
