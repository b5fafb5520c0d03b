"""``lr_schedule_cannot_train``: a learning-rate schedule under which the run cannot learn.

In a Trainer run the callback hands the monitor the Trainer's arguments, state and
learning-rate scheduler (``mon.trainer_context``). At the first optimizer step,
before the first update, the schedule is read on the host (the scheduler's own
``lr_lambdas`` evaluated over the run's ``max_steps``, at most ``SAMPLES`` of them;
no tensor is touched):

* a warmup longer than the run (the schedule's ``num_warmup_steps`` > ``max_steps``):
  the learning rate never leaves the warmup ramp;
* a learning rate of 0 at more than ``lr_zero_share`` of the run's steps
  (``learning_rate=0``, or a schedule that is 0 most of the time);
* a scheduler built on another optimizer than the one that trains (no parameter in
  common): it never moves the learning rate that is used.

Then, over the learning rates the monitor records per step (the optimizer's
``param_groups[0]["lr"]``, a host value), judged at the end: a learning rate that
never moved from its first value over at least ``OBSERVED_MIN`` steps while the
schedule moves it (its scheduler is not stepped); without a known schedule (a custom
loop), a learning rate of 0 at more than ``lr_zero_share`` of the steps seen.
No catalogue bug produces these: they are configuration mistakes.
"""

from __future__ import annotations

from typing import List, Optional

from . import Detector

CODE = "lr_schedule_cannot_train"
SAMPLES = 4096  # schedule values evaluated at train begin (evenly spaced over a longer run)
OBSERVED_MIN = 10  # steps of recorded learning rates before "never moves" is judged
OBSERVED_MAX = 1000  # learning rates kept


def _inner(scheduler):
    """The torch scheduler under accelerate's ``AcceleratedScheduler``."""
    return getattr(scheduler, "scheduler", scheduler)


def _params(optimizer) -> set:
    return {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())}


class LrScheduleCannotTrain(Detector):
    codes = (CODE,)

    def __init__(self):
        self.planned = False
        self.expected: Optional[List[float]] = None  # the schedule's learning rates for the first steps
        self.observed: List[float] = []

    def grads(self, mon) -> None:
        if not self.planned:
            self.planned = True
            self.plan(mon)

    def plan(self, mon) -> None:
        context = getattr(mon, "trainer_context", None) or {}
        scheduler = _inner(context.get("lr_scheduler"))
        max_steps = getattr(context.get("state"), "max_steps", None)
        if scheduler is None or not isinstance(max_steps, int) or max_steps < 1:
            return
        self._other_optimizer(mon, scheduler)
        lambdas, bases = getattr(scheduler, "lr_lambdas", None), getattr(scheduler, "base_lrs", None)
        if not lambdas or not bases or not callable(lambdas[0]):
            return  # not a LambdaLR (every Trainer schedule is one): judged on the recorded values only
        schedule, base = lambdas[0], float(bases[0])
        if max_steps <= SAMPLES:
            steps = list(range(max_steps))
        else:
            steps = sorted({round(i * (max_steps - 1) / (SAMPLES - 1)) for i in range(SAMPLES)})
        try:
            lrs = [base * float(schedule(step)) for step in steps]
        except Exception:  # noqa: BLE001 - a user's lambda that cannot be evaluated ahead: no judgement
            return
        self.expected = lrs[:OBSERVED_MAX] if max_steps <= SAMPLES else None
        keywords = getattr(schedule, "keywords", None) or {}
        warmup = keywords.get("num_warmup_steps")
        peak = max(lrs)
        detail = {"max_steps": max_steps, "learning_rate": base, "warmup_steps": warmup, "peak_lr": peak}
        if isinstance(warmup, int) and warmup > max_steps:
            mon.report(CODE, 0,
                       f"the warmup ({warmup} steps) is longer than the run ({max_steps} optimizer steps): the learning "
                       f"rate never leaves the ramp and peaks at {peak:.3g} ({_share(peak, base):.1%} of learning_rate "
                       f"{base:g}); set warmup_steps (or warmup_ratio) well below max_steps, or check max_steps / "
                       "num_train_epochs", (), detail)
            return
        zero = sum(1 for lr in lrs if lr == 0)
        if _share(zero, len(lrs)) > mon.options["lr_zero_share"]:
            detail["zero_fraction"] = _share(zero, len(lrs))
            mon.report(CODE, 0,
                       f"the learning rate is 0 at {_share(zero, len(lrs)):.0%} of the run's {max_steps} optimizer steps "
                       f"(learning_rate {base:g}, schedule {_name(schedule)}): "
                       "those steps change nothing; set a learning_rate > 0 and a schedule that is not 0 most of the time",
                       (), detail)

    def _other_optimizer(self, mon, scheduler) -> None:
        import torch

        mine, theirs = mon.optimizer, getattr(scheduler, "optimizer", None)
        if not (isinstance(mine, torch.optim.Optimizer) and isinstance(theirs, torch.optim.Optimizer)):
            return
        used, steered = _params(mine), _params(theirs)
        if used and steered and used.isdisjoint(steered):
            lr = mine.param_groups[0].get("lr")
            mon.report(CODE, 0,
                       f"the learning-rate scheduler ({type(scheduler).__name__}) steps another optimizer than the one "
                       f"that trains (no parameter in common): the learning rate in use stays at {lr} for the whole run; "
                       "build the scheduler on the optimizer you pass to the Trainer",
                       (), {"lr": lr, "scheduler": type(scheduler).__name__})

    def read(self, mon, view) -> None:
        lr = view.lr
        if isinstance(lr, (int, float)) and len(self.observed) < OBSERVED_MAX:
            self.observed.append(float(lr))

    def close(self, mon) -> None:
        seen = self.observed
        if not seen or mon.seen(CODE):
            return
        if self.expected is not None:
            expected = self.expected[: len(seen)]
            if (len(seen) >= OBSERVED_MIN and len(expected) == len(seen) and all(lr == seen[0] for lr in seen)
                    and max(expected) - min(expected) > 1e-6 * max(abs(v) for v in expected)):
                mon.report(CODE, mon.completed_step,
                           f"the learning rate stayed at {seen[0]:g} for {len(seen)} optimizer steps while the schedule "
                           f"moves it (from {expected[0]:.3g} to {expected[-1]:.3g}): its scheduler is not stepped; let "
                           "the Trainer step it, or call scheduler.step() after each optimizer step",
                           (), {"lr": seen[0], "steps": len(seen), "expected_first": expected[0], "expected_last": expected[-1]})
            return
        context = getattr(mon, "trainer_context", None) or {}
        if context.get("lr_scheduler") is not None and self.planned:
            return  # a schedule that could not be evaluated: nothing to compare with
        zero = sum(1 for lr in seen if lr == 0)
        if len(seen) >= 2 and _share(zero, len(seen)) > mon.options["lr_zero_share"]:
            mon.report(CODE, mon.completed_step,
                       f"the learning rate was 0 at {zero} of {len(seen)} optimizer steps seen: those steps change "
                       "nothing; set a learning rate > 0 (and check the scheduler)",
                       (), {"zero_steps": zero, "steps": len(seen), "zero_fraction": _share(zero, len(seen))})


def _share(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _name(schedule) -> str:
    """A schedule's name: the function a ``functools.partial`` wraps (transformers' schedules), or its own."""
    target = getattr(schedule, "func", schedule)
    return getattr(target, "__name__", type(schedule).__name__)
