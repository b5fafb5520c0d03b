"""The resume parity gate (``nox -s resume``): collected only when ``FTSHIMS_RESUME_GATE`` is set (the session
sets it), like tests/clients: its launches take minutes of CPU, so the default suite (``nox -s tests``, plain
``pytest``) leaves it out. ``FTSHIMS_RESUME_ENGINES`` (comma-separated: single, ddp, fsdp2, zero2, zero3; default
all) narrows it. At the end the gate's table (case x engine) is printed. This file imports nothing heavy."""

import os

if not os.environ.get("FTSHIMS_RESUME_GATE"):
    collect_ignore_glob = ["test_*.py", "worker.py"]
else:
    collect_ignore_glob = ["worker.py"]

TABLE = {}  # (case, engine) -> outcome text, filled by the tests


def pytest_terminal_summary(terminalreporter):
    if not TABLE:
        return
    cases = sorted({case for case, _ in TABLE}, key=lambda c: list(dict.fromkeys(c for c, _ in TABLE)).index(c))
    engines = list(dict.fromkeys(engine for _, engine in TABLE))
    terminalreporter.write_sep("=", "resume parity gate: case x engine")
    terminalreporter.write_line("| case | " + " | ".join(engines) + " |")
    terminalreporter.write_line("|---|" + "---|" * len(engines))
    for case in cases:
        terminalreporter.write_line(f"| {case} | " + " | ".join(TABLE.get((case, e), "-") for e in engines) + " |")
