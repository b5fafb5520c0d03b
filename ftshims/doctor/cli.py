"""``python -m ftshims.doctor``: argument parsing, output and the exit code.

Exit codes: 0 when no known bug affects the installed stack unpatched (every
affected fix shim is one that ``ftshims.apply()`` installs, no probe shows a
bug the shim leaves in place) and the setup lint found no error; 1 when one
does; 2 on a usage error (argparse's own exit status).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

EPILOG = """\
live probes (--probe): every shim's minimal reproduction runs on a tiny model
in child processes, without and with the shim, offline, with a time limit per
probe; progress goes to stderr.

setup lint: --model CONFIG (a config.json or its directory; the model is built
on the meta device, no weights), --adapter (adapter_config.json), --tokenizer
DIR, --deepspeed DS_JSON, --train-config (TrainingArguments/SFTConfig JSON or
LLaMA-Factory YAML; its `deepspeed` file is read too). Each finding has a
severity, a rule id, the fix and a reference; --explain RULE says more about a rule.

exit codes: 0 no known bug affects this stack unpatched and the lint found no
error; 1 a known bug stays unpatched even with ftshims.apply() (shim disabled,
target missing or failed), a probe shows a bug that the shim does not remove,
an error-severity lint finding, or the shims could not be evaluated; 2 usage
error. The doctor patches nothing for good: it applies the shims, imports the
modules they patch, records what happened and reverts.
JSON keys are documented in docs/doctor-json.md.
"""


def build_parser() -> argparse.ArgumentParser:
    from .report import SCHEMA_VERSION
    from .flashattn import DEFAULT_TIMEOUT_S
    from .probes import DEFAULT_TIMEOUT_S as DEFAULT_PROBE_TIMEOUT_S

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

    probes = parser.add_argument_group("live probes")
    probes.add_argument("--probe", action="store_true", help="run every shim's reproduction without and with the shim")
    probes.add_argument(
        "--probe-all",
        action="store_true",
        help="also probe opt-in speed shims (their probes may compile a kernel); implies --probe",
    )
    probes.add_argument(
        "--probe-timeout",
        type=_positive_seconds,
        default=DEFAULT_PROBE_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit per probe (default {DEFAULT_PROBE_TIMEOUT_S:g})",
    )
    probes.add_argument(
        "--probe-jobs",
        type=_positive_int,
        default=None,
        metavar="N",
        help="probes run at once (default: 2 with two or more CPUs, else 1)",
    )
    probes.add_argument("--quiet", action="store_true", help="no progress lines on stderr")

    lint = parser.add_argument_group("setup lint")
    lint.add_argument("--model", metavar="CONFIG", help="model config.json (or its directory)")
    lint.add_argument("--adapter", metavar="ADAPTER_CONFIG", help="PEFT adapter_config.json (or its directory)")
    lint.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory")
    lint.add_argument("--deepspeed", metavar="DS_JSON", help="DeepSpeed config JSON")
    lint.add_argument(
        "--train-config",
        metavar="YAML_OR_JSON",
        help="training config: TrainingArguments/SFTConfig as JSON, or LLaMA-Factory YAML",
    )
    lint.add_argument("--explain", metavar="RULE", help="print what a lint rule checks and when it fires, and exit")

    checkpoint = parser.add_argument_group("checkpoint check (instead of the report)")
    checkpoint.add_argument("--checkpoint", metavar="DIR", help="re-check a saved checkpoint directory offline: manifest "
                            "hashes, what a resume needs, the weights, adapter config, tokenizer rows; exit 0 sound, "
                            "1 a finding, 2 unusable")
    checkpoint.add_argument("--reload", action="store_true", help="with --checkpoint: load the model and compare its "
                            "logits with the reference the monitor saved")
    checkpoint.add_argument("--reload-tolerance", type=_non_negative, default=0.0, metavar="ABS",
                            help="with --reload: the largest |logit difference| accepted (default 0: bit-identical)")
    parser.set_defaults(format="text")
    return parser


def _positive(kind, what: str):
    """An argparse type: ``kind(text)``, which must be > 0 (``what`` names the kind in the error)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
        return value

    return parse


_positive_seconds = _positive(float, "a number")


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value
_positive_int = _positive(int, "an integer")


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `doctor | head`: the reader left; that is not a crash
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def _explain(parser: argparse.ArgumentParser, rule: str) -> str:
    """The rule's explanation; an unknown rule is a usage error (exit 2) that names the closest rules."""
    import difflib

    from ..lint.findings import RULES, explain

    if rule in RULES:
        return explain(rule)
    close = difflib.get_close_matches(rule, list(RULES), n=3, cutoff=0.5)
    close += [r for r in RULES if rule and rule in r and r not in close][: 3 - len(close)]
    hint = f"did you mean: {', '.join(close)}?" if close else f"known rules: {', '.join(RULES)}"
    parser.error(f"--explain: unknown rule {rule!r}; {hint}")


def main(argv: Optional[List[str]] = None) -> int:
    started = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.explain is not None:
        _write(_explain(parser, args.explain))
        return 0
    if args.checkpoint is None and (args.reload or args.reload_tolerance):
        parser.error("--reload and --reload-tolerance need --checkpoint DIR")
    if args.checkpoint is not None:
        from .checkpoint import run

        text, code = run(args.checkpoint, args.format, reload=args.reload, tolerance=args.reload_tolerance)
        _write(text)
        return code

    from .report import Options, collect
    from .formats import render, to_json

    options = Options(
        trial_imports=args.trial_imports,
        flash_attn_timeout=args.flash_attn_timeout,
        check_flash_attn=args.check_flash_attn,
        probe=args.probe or args.probe_all,
        probe_all=args.probe_all,
        probe_timeout=args.probe_timeout,
        probe_jobs=args.probe_jobs,
        progress=None if args.quiet else sys.stderr,
        model=args.model,
        adapter=args.adapter,
        tokenizer=args.tokenizer,
        deepspeed=args.deepspeed,
        train_config=args.train_config,
    )
    report = collect(options, started=started)
    try:
        text = render(report, args.format)
    except Exception as exc:  # a renderer bug must not hide the report: fall back to JSON
        report["errors"].append({"section": "render", "error": f"{type(exc).__name__}: {exc}", "traceback": None})
        text = to_json(report)
    _write(text)
    return int(report["summary"].get("exit_code", 0))
