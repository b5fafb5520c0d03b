"""``import ftshims.auto`` applies the shims: the one-line form of ``ftshims.apply()``.

Importing this module *does* patch (that is its only purpose); ``import ftshims``
alone never does.

The selection comes from ``FTSHIMS_AUTO`` when it holds a JSON object of
``apply()`` arguments, e.g. ``{"include": ["rope_fused_kernel"], "options":
{"max_positions_guard": {"policy": "warn"}}}``; any other value applies the
defaults. The ``ftshims-auto.pth`` hook imports this module at interpreter
start-up when ``FTSHIMS_AUTO`` is set, which is how torchrun ranks, accelerate
workers and spawned DataLoader workers get the same shims as the launcher.
"""

import json
import os
import sys

import ftshims

AUTO_ENV = "FTSHIMS_AUTO"


def _arguments() -> dict:
    raw = os.environ.get(AUTO_ENV, "").strip()
    if not raw.startswith("{"):
        return {}
    try:
        arguments = json.loads(raw)
    except ValueError as exc:
        print(f"ftshims: ignoring {AUTO_ENV}, not valid JSON ({exc}); applying the defaults", file=sys.stderr)
        return {}
    allowed = {"only", "exclude", "include", "options", "strict"}
    unknown = set(arguments) - allowed
    if unknown:
        print(f"ftshims: ignoring unknown {AUTO_ENV} key(s) {sorted(unknown)}", file=sys.stderr)
    return {k: v for k, v in arguments.items() if k in allowed}


def _apply():
    arguments = _arguments()
    try:
        return ftshims.apply(**arguments)
    except ValueError as exc:  # an unknown shim id or option in FTSHIMS_AUTO must not kill the process
        print(f"ftshims: {AUTO_ENV} rejected ({exc}); no shims applied", file=sys.stderr)
        return ftshims.status()


report = _apply()
