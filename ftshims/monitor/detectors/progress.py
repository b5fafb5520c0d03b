"""``loss_not_moving``: the loss does not change at all over the first ``loss_steps`` optimizer steps.

A loss that is the same number step after step, while parameters require grad,
means that nothing the optimizer does reaches it: an optimizer that holds other
parameters than the model's (built before the model was re-created or wrapped),
a loss computed from detached outputs (and ``loss.requires_grad_()`` added to
silence the error), a learning rate of 0 on the same batch, outputs that do not
depend on the data and the weights. Real training moves the loss at every step,
if only because the batches differ. The values are the monitor's own per-step
losses (host values at a read); runs whose model returns no loss are not judged.
Not reported when ``labels_all_ignored`` already explains a constant loss (0 or NaN).
No catalogue bug is known to produce it.
"""

from __future__ import annotations

import math
from typing import List, Tuple

from . import Detector

CODE = "loss_not_moving"
TOLERANCE = 1e-6  # relative: "does not move at all"


class LossNotMoving(Detector):
    codes = (CODE,)

    def __init__(self):
        self.losses: List[Tuple[int, float]] = []
        self.done = False
        self.trainable = 0

    def begin(self, mon) -> None:
        self.trainable = sum(p.numel() for p in mon.model.parameters() if p.requires_grad)
        self.done = self.trainable == 0  # nothing_trainable's case

    def read(self, mon, view) -> None:
        if self.done:
            return
        loss = view.loss
        if loss is None:
            return
        if not math.isfinite(loss):
            self.done = True  # nonfinite_loss's case
            return
        self.losses.append((view.step, loss))
        steps = mon.options["loss_steps"]
        if len(self.losses) < steps:
            return
        self.done = True
        values = [value for _, value in self.losses]
        first = values[0]
        if max(values) - min(values) > TOLERANCE * max(1.0, abs(first)) or mon.seen("labels_all_ignored"):
            return
        mon.report(CODE, view.step,
                   f"the loss is {first:.6g} at each of the first {steps} optimizer steps while {self.trainable} "
                   "parameters are trainable: the updates do not reach the loss; check that the optimizer holds this "
                   "model's parameters (built after the model was created/wrapped), that the loss is not computed from "
                   "detached outputs (loss.requires_grad_() hides that), that the learning rate is not 0, and that "
                   "the batches differ",
                   (), {"loss": first, "steps": steps, "trainable_parameters": self.trainable,
                        "losses": values})
