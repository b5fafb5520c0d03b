"""Labels: batches with no target, EOS never trained, and a loss normalised by the wrong count.

All three count on the device, per training forward (a few reductions over the
label tensor), and judge the host values at a read:

* ``labels_all_ignored``: a micro-batch in which the loss scores no label (every
  label -100; for a causal LM, ``labels[..., 1:]``). Its loss is NaN (a mean over
  nothing) or 0 (summed), and the step learns nothing from it.
  ``trl_completion_only_template_miss`` (TRL's completion-only collator masking
  whole examples when its response template is not found) produces it.
* ``eos_never_target``: pad = EOS, EOS occurs in the inputs (attended positions),
  and no label is EOS over ``eos_steps`` steps: the collator masked every EOS
  with the padding, so the model never learns to stop.
  ``eos_label_kept_when_pad_is_eos`` (opt-in) and the TRL < 0.16.1 advisory.
* ``loss_count_mismatch``: the Trainer's ``num_items_in_batch`` (the denominator of
  the summed loss) differs from the number of labels the loss scores, summed over
  the step's micro-batches. ``num_items_in_batch_overcount`` (4.57-5.10.0) and its
  advisory (4.46.2-4.56) produce it: position 0 of every row counted. Judged in
  single-process runs (distributed runs count across ranks).
"""

from __future__ import annotations

import sys

from . import Detector
from .. import facts


def _scored(mon, inputs):
    """The labels the loss scores (a device tensor view), or None without labels."""
    shifted = inputs.get("shift_labels")
    if shifted is not None and hasattr(shifted, "ne"):
        return shifted
    labels = inputs.get("labels")
    if labels is None or not hasattr(labels, "ne") or labels.dim() < 1:
        return None
    return labels[..., 1:] if mon.shifts_labels else labels


class _Labels(Detector):
    def begin(self, mon) -> None:
        if not hasattr(mon, "shifts_labels"):
            mon.shifts_labels = facts.shifts_labels(mon.model)

    def batch(self, mon, inputs, micro) -> None:
        if "scored" not in micro.ints:
            scored = _scored(mon, inputs)
            if scored is not None:
                micro.ints["scored"] = scored.ne(-100).sum()


class LabelsAllIgnored(_Labels):
    codes = ("labels_all_ignored",)

    def __init__(self):
        self.batches = 0

    def read(self, mon, view) -> None:
        for values in view.values:
            if values.get("scored") == 0:
                self.batches += 1
                candidates = ("trl_completion_only_template_miss",) if "trl" in sys.modules else ()
                mon.report("labels_all_ignored", view.step, "a training batch has no label the loss scores (every "
                           "label is -100): its loss is NaN or 0 and it trains nothing", candidates,
                           {"first_step": view.step})

    def close(self, mon) -> None:
        if self.batches > 1:
            for finding in mon.findings:
                if finding.code == "labels_all_ignored":
                    finding.detail["batches"] = self.batches


class EosNeverTarget(_Labels):
    codes = ("eos_never_target",)

    def __init__(self):
        self.active = False
        self.eos_in = 0
        self.eos_labels = 0
        self.steps = 0

    def begin(self, mon) -> None:
        super().begin(mon)
        ids = facts.special_ids(mon.model, mon.tokenizer)
        self.eos = ids.eos
        self.pad = ids.pad
        self.active = bool(self.eos) and self.pad is not None and self.pad in self.eos

    def batch(self, mon, inputs, micro) -> None:
        if not self.active:
            return
        ids, labels = inputs.get("input_ids"), inputs.get("labels")
        if ids is None or labels is None or not hasattr(labels, "eq"):
            return
        eos = self.pad
        hits = ids.eq(eos)
        mask = inputs.get("attention_mask")
        if mask is not None and hasattr(mask, "shape") and mask.shape == ids.shape:
            hits = hits & mask.bool()
        micro.ints["eos_in"] = hits.sum()
        micro.ints["eos_label"] = labels.eq(eos).sum()

    def read(self, mon, view) -> None:
        if not self.active:
            return
        for values in view.values:
            self.eos_in += values.get("eos_in", 0)
            self.eos_labels += values.get("eos_label", 0)
        self.steps += 1
        if self.steps < mon.options["eos_steps"]:
            return
        self.active = False  # judged once, then the per-batch counting stops
        if self.eos_in and not self.eos_labels and not mon.seen("no_eos_target"):  # that finding named it already
            mon.report("eos_never_target", view.step,
                       f"pad = EOS (id {self.pad}) and EOS occurs {self.eos_in} times in the inputs of {self.steps} steps, "
                       "but no label is EOS: the collator masked every EOS with the padding, so the model never learns to stop",
                       ("eos_label_kept_when_pad_is_eos", "trl_sft_eos_label_masked_when_pad_is_eos"),
                       {"eos_id": self.pad, "eos_in_inputs": self.eos_in, "eos_labels": 0, "steps": self.steps})


class LossCountMismatch(_Labels):
    codes = ("loss_count_mismatch",)

    def begin(self, mon) -> None:
        super().begin(mon)
        self.steps = 0

    def batch(self, mon, inputs, micro) -> None:
        super().batch(mon, inputs, micro)
        if mon.world > 1 or "num_items" not in micro.ints:
            return
        labels = inputs.get("labels")
        if labels is not None and hasattr(labels, "ne"):
            micro.ints["targets"] = labels.ne(-100).sum()

    def read(self, mon, view) -> None:
        if mon.world > 1 or mon.seen("loss_count_mismatch"):
            return
        counted = [v for v in view.values if "num_items" in v and "scored" in v]
        if not counted or len(counted) != len(view.values):
            return
        num_items = counted[0]["num_items"]
        scored = sum(v["scored"] for v in counted)
        if num_items == scored:
            return
        targets = sum(v.get("targets", 0) for v in counted)
        why = ""
        if targets == num_items and mon.shifts_labels:
            why = " (it counts every label that is not -100, position 0 of each row included, which the shifted loss never scores)"
        mon.report("loss_count_mismatch", view.step,
                   f"num_items_in_batch is {num_items} but the loss scores {scored} labels{why}: the loss and gradients "
                   f"are scaled by {scored / num_items:.4g}" if num_items else
                   f"num_items_in_batch is {num_items} but the loss scores {scored} labels",
                   ("num_items_in_batch_overcount", "num_items_in_batch_overcount_4_46"),
                   {"num_items_in_batch": num_items, "scored_labels": scored, "labels_not_ignored": targets,
                    "micro_batches": len(counted)})
