"""The detectors: each a small unit with its stable code(s) (``ftshims.monitor.options.CODES``).

A detector overrides only the moments it needs; :func:`build` lists each
detector under those, so a per-step hook calls no detector that does nothing there:

* ``begin(mon)``: once, at train begin (may read device values: it runs once);
* ``batch(mon, inputs, micro)``: every training forward, before it; device work only
  (results go into ``micro.ints`` / ``micro.floats``), except a check on CPU tensors;
* ``output(mon, micro, output)``: after every training forward; device work only;
* ``grads(mon)``: once per optimizer step, gradients complete, before the update; host facts only
  (``p.grad is None``), no device reads;
* ``updated(mon)``: right after the optimizer's update (its step post-hook; not called for a step the
  skip defence dropped); device work only;
* ``read(mon, view)``: at a read point, with the host values of one step (:class:`~ftshims.monitor.core.StepView`);
* ``check(mon)``: the periodic checks (logging steps, ``read_every``, the end);
* ``close(mon)``: at the end of training;
* ``saved(mon, directory, step)``: after a checkpoint was written (the Trainer's ``on_save``, or
  ``Monitor.saved()``), on every rank.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

MOMENTS = ("begin", "batch", "output", "grads", "updated", "read", "check", "close", "saved")


class Detector:
    codes: tuple = ()

    def begin(self, mon) -> None: ...

    def batch(self, mon, inputs, micro) -> None: ...

    def output(self, mon, micro, output) -> None: ...

    def grads(self, mon) -> None: ...

    def updated(self, mon) -> None: ...

    def read(self, mon, view) -> None: ...

    def check(self, mon) -> None: ...

    def close(self, mon) -> None: ...

    def saved(self, mon, directory, step) -> None: ...


def all_detectors() -> List[Detector]:
    from .checkpoint import CheckpointVerified
    from .data import DataChecks, SpecialTokenInvalid
    from .labels import EosNeverTarget, LabelsAllIgnored, LossCountMismatch
    from .nonfinite import NonFinite
    from .packing import PackingContaminated
    from .progress import LossNotMoving
    from .ranks import RanksIdenticalBatches
    from .rope import RopeLowPrecision
    from .schedule import LrScheduleCannotTrain
    from .spikes import GradNormSpike, LossSpike
    from .tokens import TokenIdOutOfRange
    from .trainable import FrozenParamChanged, NothingTrainable, TrainableNotInOptimizer, TrainableWithoutGrad
    from .progress import LossDiverging, ModelInEvalMode
    from .updates import UpdateStats

    return [
        TokenIdOutOfRange(), NothingTrainable(), TrainableWithoutGrad(), FrozenParamChanged(), NonFinite(),
        LossSpike(), GradNormSpike(), LabelsAllIgnored(), EosNeverTarget(), LossCountMismatch(),
        PackingContaminated(), RopeLowPrecision(), RanksIdenticalBatches(),
        SpecialTokenInvalid(), DataChecks(), LrScheduleCannotTrain(), LossNotMoving(),
        CheckpointVerified(),
        # learning progress from first principles (issue 35)
        LossDiverging(), UpdateStats(), TrainableNotInOptimizer(), ModelInEvalMode(),
    ]


def build(mon) -> SimpleNamespace:
    """The detectors whose codes are not all ``off``, listed per moment they override."""
    chosen = [d for d in all_detectors() if not set(d.codes) <= mon.options["off"]]
    table = {moment: [d for d in chosen if getattr(type(d), moment) is not getattr(Detector, moment)] for moment in MOMENTS}
    return SimpleNamespace(all=chosen, by_code={code: d for d in chosen for code in d.codes}, **table)
