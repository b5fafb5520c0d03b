"""The ``ftshims-auto.pth`` start-up hook: install, remove or inspect it.

    python -m ftshims.hook status
    python -m ftshims.hook install      # editable installs don't ship it; regular ones do
    python -m ftshims.hook uninstall

The hook is one line in site-packages that Python runs at start-up. It costs a
dictionary lookup unless ``FTSHIMS_AUTO`` is set; then it imports
``ftshims.auto``, which reads the value (``1``, ``0``/``false``/..., or a JSON
object of ``apply()`` arguments: one grammar, in :mod:`ftshims.settings`) and
applies the shims or nothing. That is how torchrun ranks, accelerate
workers and spawned DataLoader workers get the launcher's shims:
``FTSHIMS_AUTO=1 torchrun train.py``, or ``ftshims.apply(propagate=True)`` in
the launcher.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from pathlib import Path

NAME = "ftshims-auto.pth"
# Only "is it set": the value is ftshims.auto's to read, so this line never disagrees with the grammar.
# FTSHIMS_MONITOR (the training health monitor) is read by ftshims.monitor.startup the same way.
LINE = ("import os; 'FTSHIMS_AUTO' in os.environ and __import__('ftshims.auto'); "
        "'FTSHIMS_MONITOR' in os.environ and __import__('ftshims.monitor.startup')\n")


def site_packages() -> Path:
    return Path(sysconfig.get_path("purelib"))


def installed() -> bool:
    return (site_packages() / NAME).is_file()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ftshims.hook", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("status", "install", "uninstall"))
    args = parser.parse_args(argv)
    path = site_packages() / NAME
    if args.action == "install":
        path.write_text(LINE)
        print(f"installed {path}")
    elif args.action == "uninstall":
        if path.exists():
            path.unlink()
        print(f"removed {path}")
    else:
        print(f"{path}: {'installed' if installed() else 'not installed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
