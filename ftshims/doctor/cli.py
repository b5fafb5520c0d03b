"""``python -m ftshims.doctor``: argument parsing, output and the exit code.

Exit codes: 0 when no known bug affects the installed stack unpatched (every
affected fix shim is one that ``ftshims.apply()`` installs), 1 when one does,
2 on a usage error (argparse's own exit status).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

EPILOG = """\
exit codes: 0 no known bug affects this stack unpatched; 1 a known bug stays
unpatched even with ftshims.apply() (shim disabled, target missing or failed),
or the shims could not be evaluated; 2 usage error. The doctor patches nothing for good: it applies the shims,
imports the modules they patch, records what happened and reverts.
JSON keys are documented in docs/doctor-json.md.
"""


def build_parser() -> argparse.ArgumentParser:
    from .report import SCHEMA_VERSION
    from .flashattn import DEFAULT_TIMEOUT_S

    parser = argparse.ArgumentParser(
        prog="python -m ftshims.doctor",
        description="Report the fine-tuning stack and which known bugs affect it, and whether ftshims fixes them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", dest="format", action="store_const", const="json", help=f"JSON (schema version {SCHEMA_VERSION})")
    form.add_argument("--markdown", dest="format", action="store_const", const="markdown", help="Markdown, to paste into a bug report")
    form.add_argument("--text", dest="format", action="store_const", const="text", help="plain text (the default)")
    parser.add_argument(
        "--no-import",
        dest="trial_imports",
        action="store_false",
        help="do not import the modules shims patch (faster; statuses then come from version gating only)",
    )
    parser.add_argument(
        "--flash-attn-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit for the flash-attn import check (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--no-flash-attn", dest="check_flash_attn", action="store_false", help="skip the flash-attn import check")
    parser.set_defaults(format="text")
    return parser


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `doctor | head`: the reader left; that is not a crash
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: Optional[List[str]] = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)  # exits 2 on a usage error

    from .report import Options, collect
    from .formats import render, to_json

    options = Options(
        trial_imports=args.trial_imports,
        flash_attn_timeout=args.flash_attn_timeout,
        check_flash_attn=args.check_flash_attn,
    )
    report = collect(options, started=started)
    try:
        text = render(report, args.format)
    except Exception as exc:  # a renderer bug must not hide the report: fall back to JSON
        report["errors"].append({"section": "render", "error": f"{type(exc).__name__}: {exc}", "traceback": None})
        text = to_json(report)
    _write(text)
    return int(report["summary"].get("exit_code", 0))
