"""``loss_spike`` / ``grad_norm_spike``: robust statistics on the per-step values, after a warm-up.

A value is a spike when it exceeds the median of the last ``WINDOW`` finite
values by more than ``spike_sigmas`` robust standard deviations (1.4826 x MAD)
*and* by a relative floor of the median (loss: +50 %, grad norm: x3): the
floor keeps a run whose values barely vary (MAD near 0) quiet. Nothing is
judged before ``warmup`` steps and ``warmup`` values. One finding per episode
(consecutive spiking steps), at most ``MAX_FINDINGS`` per code. The values are
the monitor's own per-step loss and gradient norm (host values at a read); a
Trainer whose model returns no loss (TRL's DPO computes its own) feeds the loss
it logs instead. No catalogue bug of the registry is known to cause a spike: the
message says so.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

from . import Detector

WINDOW = 100
MAX_FINDINGS = 20


class _Spike(Detector):
    code = ""
    what = ""
    floor = 0.0

    def __init__(self):
        self.codes = (self.code,)
        self.history = deque(maxlen=WINDOW)
        self.in_episode = False

    def value(self, view):
        raise NotImplementedError

    def observe(self, mon, step: int, value) -> None:
        if value is None or not math.isfinite(value):
            return
        warm = mon.options["warmup"]
        if step > warm and len(self.history) >= warm:
            mid = median(self.history)
            spread = 1.4826 * median(abs(v - mid) for v in self.history)
            threshold = mid + max(mon.options["spike_sigmas"] * spread, self.floor * abs(mid))
            if value > threshold:
                mon.note_spike(self.code, step)  # policy "skip" drops this step's update
                if not self.in_episode and mon.seen(self.code) < MAX_FINDINGS:
                    mon.report(self.code, step,
                               f"the {self.what} jumped to {value:.4g} (median of the last {len(self.history)} steps "
                               f"{mid:.4g}, threshold {threshold:.4g})",
                               (), {"value": value, "median": mid, "mad_sigma": spread, "threshold": threshold}, once=False)
                self.in_episode = True
            else:
                self.in_episode = False
        self.history.append(value)

    def read(self, mon, view) -> None:
        self.observe(mon, view.step, self.value(view))


class LossSpike(_Spike):
    code = "loss_spike"
    what = "loss"
    floor = 0.5

    def __init__(self):
        super().__init__()
        self.model_losses = False

    def value(self, view):
        loss = view.loss
        if loss is not None:
            self.model_losses = True
        return loss

    def logged(self, mon, step: int, logs) -> None:
        """The Trainer's logged loss, used only when the model returns none (TRL's DPO, custom compute_loss)."""
        if any("loss" in micro.floats for micro in mon._pending):  # not read yet (an accelerator), but there
            self.model_losses = True
        if not self.model_losses and isinstance(logs.get("loss"), (int, float)):
            self.observe(mon, step, float(logs["loss"]))


class GradNormSpike(_Spike):
    code = "grad_norm_spike"
    what = "gradient norm"
    floor = 2.0

    def value(self, view):
        return view.grad_norm
