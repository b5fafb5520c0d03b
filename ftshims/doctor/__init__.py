"""The ftshims doctor: what your fine-tuning stack is, and which known bugs affect it.

    python -m ftshims.doctor              # text, for a terminal
    python -m ftshims.doctor --markdown   # paste into a bug report
    python -m ftshims.doctor --json       # for tools; keys in docs/doctor-json.md
    python -m ftshims.doctor --probe      # + every shim's reproduction, without and with the shim
    python -m ftshims.doctor --model CONFIG [--adapter A] [--tokenizer DIR] [--deepspeed DS] [--train-config Y]
                                          # + a lint of the training setup

It reports Python, the platform, torch (CUDA, cuDNN, GPUs, bf16), the installed
versions of the stack's packages (from metadata), whether flash-attn really
imports (in a subprocess, with a timeout), and for every registered shim
whether the installed versions are affected and what ``ftshims.apply()`` does
about it. Nothing stays patched. It never crashes on a broken package: a
failure is a line in the report. ``--probe`` adds live evidence (:mod:`.probes`:
each shim's probe in isolated child processes, offline, time-limited), the
lint options add findings about the user's own files (:mod:`.lint`), and the
advisories of :mod:`ftshims.advisories` that match the stack are listed.

Layout: :mod:`.packages` (metadata), :mod:`.environment` (Python, platform,
torch), :mod:`.flashattn` (the import check), :mod:`.shims` (the apply trial),
:mod:`.probes` and :mod:`._probe_worker` (live probes), :mod:`.lint` (setup
lint), :mod:`.report` (sections, summary, exit code), :mod:`.formats` (text,
Markdown, JSON) and :mod:`.cli`. Importing this package imports none of them.

Library use: ``ftshims.doctor.collect()`` returns the report dict;
``ftshims.doctor.render(report, "text")`` formats it.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

__all__ = ["collect", "render", "main", "Options", "SCHEMA_VERSION"]


def collect(options=None):
    """Run every check and return the report (a JSON-ready dict)."""
    from .report import collect as _collect

    return _collect(options)


def render(report, fmt: str = "text") -> str:
    """Format a report: ``"text"``, ``"markdown"`` or ``"json"``."""
    from .formats import render as _render

    return _render(report, fmt)


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)


def __getattr__(name):
    if name == "Options":
        from .report import Options

        return Options
    raise AttributeError(f"module 'ftshims.doctor' has no attribute {name!r}")
