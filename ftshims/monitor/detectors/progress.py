"""Learning progress from the loss: ``loss_not_moving`` and ``loss_diverging``.

``loss_not_moving``: the loss does not change at all over the first ``loss_steps`` optimizer steps.

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
from typing import List, Optional, Tuple

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


class LossDiverging(Detector):
    """``loss_diverging``: the loss climbs and stays up, judged from the first step (no warm-up blind spot).

    Two references, both known from the start:

    * the loss of a *uniform predictor* over the classes the head scores: ``ln C``, with ``C`` the last
      dimension of the logits the first training forward returns (a shape: host metadata, no device read):
      the vocabulary of an LM head, ``num_labels`` of a classifier. A model that scores worse than guessing
      has lost what it knew. Not used where the loss is no cross-entropy over those logits (a regression or
      multi-label ``problem_type``, ``C`` < 2) or where the model returns no logits;
    * the run's own *early level* ``E``: the median of the first ``EARLY`` optimizer steps' losses.

    A step is *up* when its loss is above ``max(U, L1) + max(0.5, 0.1 max(U, L1))``, with ``L1`` the first
    step's loss (the weights before any update: worse than both guessing and the start), or above
    ``max(diverge_factor x E, E + 1)`` (far above its early level; only where ``E`` > 0: an RL objective near or
    below zero is no cross-entropy). ``diverge_steps``
    consecutive steps up: a finding, once. A run that starts above ``ln C`` (an unusual initialisation) is
    judged against its own start, so it must climb to be flagged. The values are the monitor's per-step
    losses (host values at a read); a model that returns no loss feeds the Trainer's logged loss, judged
    against its early level only. Non-finite losses are ``nonfinite_loss``'s.
    """

    codes = ("loss_diverging",)
    EARLY = 5

    def __init__(self):
        self.classes: Optional[int] = None
        self.looked = False
        self.early: List[float] = []
        self.run: List[Tuple[int, float]] = []  # the consecutive steps up
        self.done = False
        self.model_losses = False

    def output(self, mon, micro, output) -> None:
        if self.looked:
            return
        self.looked = True
        import torch

        logits = output.get("logits") if hasattr(output, "get") else getattr(output, "logits", None)
        if not torch.is_tensor(logits) or not logits.is_floating_point() or logits.dim() < 2:
            return
        from .. import facts

        problem = getattr(facts.config(mon.model), "problem_type", None)
        if problem in ("regression", "multi_label_classification"):
            return
        classes = int(logits.shape[-1])
        self.classes = classes if classes >= 2 else None

    def read(self, mon, view) -> None:
        loss = view.loss
        if loss is not None:
            self.model_losses = True
        self.observe(mon, view.step, loss, view.lr, uniform=True)

    def logged(self, mon, step: int, logs) -> None:
        """The Trainer's logged loss, used only when the model returns none (its early level only)."""
        if any("loss" in micro.floats for micro in mon._pending):  # not read yet (an accelerator), but there
            self.model_losses = True
        if not self.model_losses and isinstance(logs.get("loss"), (int, float)):
            self.observe(mon, step, float(logs["loss"]), logs.get("learning_rate"), uniform=False)

    def observe(self, mon, step: int, loss, lr, uniform: bool) -> None:
        if self.done or loss is None or not math.isfinite(loss):
            return
        if len(self.early) < self.EARLY:
            self.early.append(loss)
        early = sorted(self.early)[len(self.early) // 2]
        factor = mon.options["diverge_factor"]
        # a ratio to the early level means something for a positive loss (a cross-entropy); an RL objective near or
        # below 0 (GRPO's, a custom compute_loss) is judged against the uniform predictor only, where it has one
        limits = {"early": max(factor * early, early + 1.0)} if early > 0 else {}
        guess = math.log(self.classes) if (uniform and self.classes) else None
        if guess is not None:
            # against the start: the first step's loss (the weights before any update), which a divergence from
            # step 2 on cannot raise; the median above is the robust level for the factor test
            top = max(guess, self.early[0])
            limits["uniform"] = top + max(0.5, 0.1 * top)
        if not limits:
            return
        threshold = min(limits.values())
        if loss <= threshold:
            self.run = []
            return
        self.run.append((step, loss))
        if len(self.run) < mon.options["diverge_steps"]:
            return
        self.done = True
        which = min(limits, key=limits.get)
        first = self.run[0][0]
        values = [round(v, 4) for _, v in self.run]
        if which == "uniform":
            why = (f"above the loss of a uniform predictor over the {self.classes} classes the head scores "
                   f"(ln {self.classes} = {guess:.3g}): the model predicts worse than guessing")
        else:
            why = f"more than {factor:g} x its early level {early:.4g} (the median of the first {len(self.early)} steps)"
        lr_text = f" at learning rate {lr:.3g}" if isinstance(lr, (int, float)) else ""
        mon.report("loss_diverging", step,
                   f"the loss diverged: {len(self.run)} consecutive optimizer steps from step {first} above "
                   f"{threshold:.4g} (now {loss:.4g}), {why}{lr_text}; usual causes: a learning rate far too high "
                   "(or no warmup), no gradient clipping, fp16 overflow; lower the learning rate, add warmup and "
                   "max_grad_norm", (),
                   {"loss": loss, "threshold": threshold, "criterion": which, "early_level": early,
                    "uniform_loss": guess, "classes": self.classes, "steps": [s for s, _ in self.run],
                    "losses": values, "lr": lr})


class ModelInEvalMode(Detector):
    """``model_in_eval_mode``: an optimizer step whose forwards ran with the model in eval mode (``model.training``
    False, gradients on) and none in train mode: a custom loop that evaluated (``model.eval()``) and never called
    ``model.train()`` again. Dropout is then off (and batch-norm statistics frozen), so the run is not the one
    configured, and every per-batch check of the monitor sees nothing (it watches training forwards). Reported only
    where train mode changes the computation: a dropout module with p > 0, a config ``*dropout``/``*_pdrop`` > 0
    (functional dropout), or a batch-norm layer. A host counter, no device work. The Trainer calls
    ``model.train()`` itself: a custom-loop mistake."""

    codes = ("model_in_eval_mode",)

    def __init__(self):
        self.done = False

    def grads(self, mon) -> None:
        if self.done or not mon.eval_forwards or any(m.step == mon.step and m.call is not None for m in mon._pending):
            return
        self.done = True
        changes = _train_mode_changes(mon.model)
        if not changes:
            return
        mon.report("model_in_eval_mode", mon.step,
                   f"the optimizer stepped after {mon.eval_forwards} forward(s) made with the model in eval mode "
                   f"(model.training is False, gradients on) and none in train mode: {', '.join(changes[:3])} "
                   "behave as at inference, and the monitor's per-batch checks see nothing; call model.train() after "
                   "evaluating", (), {"eval_forwards": mon.eval_forwards, "train_mode_changes": changes[:10]})


def _train_mode_changes(model) -> List[str]:
    """What train mode changes in ``model``: dropout modules with p > 0, config dropout rates > 0, batch norms."""
    import torch

    from .. import facts

    found: List[str] = []
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropouts:
        found.append(f"{len(dropouts)} dropout module(s) (p={dropouts[0].p:g})")
    cfg = facts.config(model)
    for name, value in sorted((getattr(cfg, "__dict__", None) or {}).items()):
        if (name.endswith("dropout") or name.endswith("_pdrop") or name.endswith("dropout_prob")) \
                and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.append(f"config.{name}={value:g}")
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        found.append("batch norm layers")
    return found
