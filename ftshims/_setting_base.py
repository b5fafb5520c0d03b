"""The pieces of :mod:`ftshims.settings` that the monitor's options need too: the one error format and the
monitor's log path.

Both :mod:`ftshims.settings` (which re-exports them) and :mod:`ftshims.monitor.options` import this module, so
the dependency runs one way: ``settings`` -> ``monitor.options`` -> here, and ``settings`` -> here. It imports
nothing of ftshims and nothing heavy (the start-up hook reaches it in every process where ``FTSHIMS_AUTO`` or
``FTSHIMS_MONITOR`` is set).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

# The training health monitor's JSON-lines log (ftshims.monitor): one file per rank.
MONITOR_LOG_ENV = "FTSHIMS_MONITOR_LOG"


def invalid(setting: str, given: Any, problem: str, allowed: Sequence[Any]) -> ValueError:
    """The one error format: ``setting: problem; allowed: ... (did you mean ...?)``, on one line."""
    import difflib  # only on an error: this module is imported at start-up by the hook

    names = [str(a) for a in allowed]
    lowered = {name.lower(): name for name in names}  # matched case-insensitively, suggested as spelled
    close = difflib.get_close_matches(str(given).strip().lower(), list(lowered), n=1)
    hint = f" (did you mean {lowered[close[0]]!r}?)" if close else ""
    return ValueError(f"{setting}: {problem}; allowed: {', '.join(names) or 'none'}{hint}")


def parse_monitor_log(raw: Optional[str] = None, setting: str = MONITOR_LOG_ENV) -> Optional[str]:
    """``FTSHIMS_MONITOR_LOG``: the monitor's JSONL path, or None (unset or empty). The path must not be a
    directory and its directory must exist (each rank of a distributed run writes ``<stem>.rank<N><suffix>``)."""
    raw = os.environ.get(MONITOR_LOG_ENV, "") if raw is None else raw
    if not isinstance(raw, (str, os.PathLike)):
        raise invalid(setting, raw, f"expected a file path, got {raw!r}", ["a path whose directory exists"])
    text = os.fspath(raw).strip()
    if not text:
        return None
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        raise invalid(f"{setting}={raw!r}", text, "is a directory, not a file", ["a path whose directory exists"])
    if not os.path.isdir(os.path.dirname(path)):
        raise invalid(f"{setting}={raw!r}", text, f"directory {os.path.dirname(path)} does not exist", ["a path whose directory exists"])
    return path
