"""Run a shim's reproduction without the shim and with it: shared by the tests and the doctor.

Each shim module may define ``probe(**scenario) -> Observation``: its minimal
reproduction on a tiny random model, in the installed stack. :func:`compare`
runs it twice, first with the shim reverted and then with it applied, and says
whether the installed versions are inside the shim's range. The tests assert
on the outcome (the bug must show without the shim exactly where the registry
says it exists) and the doctor reports it.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

from . import _manager, registry
from .report import ShimStatus
from .spec import Observation
from .versions import explain_mismatch, installed_versions


@dataclass
class ProbeOutcome:
    shim_id: str
    affected: bool  # the installed versions are inside the shim's range
    range_reason: Optional[str]  # why not, when not
    status: ShimStatus  # the shim's status while the "with" run happened
    without: Observation
    with_shim: Observation

    @property
    def fixed(self) -> bool:
        return self.without.bug and not self.with_shim.bug


def in_affected_range(shim_id: str):
    """``(affected, reason)``: whether the installed versions are inside the shim's range."""
    spec = registry.get(shim_id).spec
    reason = explain_mismatch(spec.requires, installed_versions(spec.requires))
    return reason is None, reason


@contextlib.contextmanager
def accelerate_environment_kept():
    """A probe that builds a Trainer leaves ``ACCELERATE_MIXED_PRECISION`` (and the other ``ACCELERATE_*``
    settings TrainingArguments exports) in the environment, and the next Accelerator of the process reads them: a
    TRL config's default bf16 put the probes run after it (the doctor runs them all in one process) under bf16
    autocast. Each probe run gets the environment back as it found it."""
    before = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_")}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("ACCELERATE_") and k not in before]:
            del os.environ[key]
        os.environ.update(before)


def compare(shim_id: str, options=None, **scenario) -> ProbeOutcome:
    """Run ``probe(**scenario)`` with the shim off, then on; restore its previous state after."""
    shim = registry.get(shim_id)
    if shim.probe is None:
        raise ValueError(f"shim {shim_id} has no probe")
    was_active = _manager.status()[shim_id].active
    if was_active:
        _manager.revert(only=[shim_id])
    try:
        with accelerate_environment_kept():
            without = shim.probe(**scenario)
        report = _manager.apply(only=[shim_id], options={shim_id: options} if options else None)
        try:
            state = report[shim_id]
            with accelerate_environment_kept():
                with_shim = shim.probe(**scenario)
        finally:
            _manager.revert(only=[shim_id])
    finally:
        if was_active:
            _manager.apply(only=[shim_id])
    affected, reason = in_affected_range(shim_id)
    return ProbeOutcome(shim_id, affected, reason, state, without, with_shim)
