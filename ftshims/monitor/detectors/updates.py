"""Update statistics: does each optimizer step change the weights by a sane amount, and at all?

The "parameter update ratio" ``||dw|| / ||w||`` per optimizer step is what a careful engineer looks at
before trusting a run: fine-tuning steps are around 1e-4..1e-2 of the weights' size. On a fixed sample
of trainable tensors (at most ``SAMPLED_TENSORS``, evenly over the model, input/output embeddings left
out, tensors that are all zero at train begin, such as LoRA's ``B`` and zero-initialised biases, left
out: their ratio is meaningless), ``SAMPLED_ELEMENTS`` evenly strided elements each:

* before the update (the optimizer's step pre-hook, gradients complete): a device copy of the sampled
  weights and a device mask of the sampled elements whose gradient is not zero;
* after it (the optimizer's step post-hook): per tensor ``||dw||``, ``||w||``, the elements that did not
  change although their gradient was not zero, and how many had one: four device scalars;
* on the first ``update_every`` optimizer steps and every ``update_every``-th after; read with the monitor's
  read points (the CPU: every step; an accelerator: the Trainer's logging steps), never per step.

Each sampled step is a JSONL ``updates`` record (``ratio``: the median ``||dw||/||w||`` of the sample;
``lost``: the share of unchanged elements with a gradient in bf16/fp16 tensors). Judged over windows of
``JUDGED_STEPS`` sampled steps whose learning rate is at least half the schedule's base (``initial_lr``;
warm-up and the end of a decay say nothing), the whole run long (each code once), or at the end with fewer:

* ``updates_lost``: in bf16/fp16 weights, more than ``lost_share`` of the sampled elements with a non-zero
  gradient did not change. The optimizer adds a step below half the spacing of the weight's format, and
  rounding gives back the old weight: bf16 has 8 significant bits, so a weight of 0.02 moves only by steps
  above ~6e-5, and AdamW's steps are about the learning rate (1e-5). transformers 5 loads bf16 checkpoints
  in bf16 by default (``dtype="auto"``). Fixes: float32 weights with bf16 autocast (``bf16=True``), or an
  optimizer with stochastic rounding or Kahan summation. Not judged when the optimizer says it has either
  (its ``defaults`` name ``bf16_stochastic_round``, ``kahan_sum`` ...).
* ``updates_vanishing``: the median ratio is below ``update_ratio_min`` (1e-6): nothing learns at that
  rate (a learning rate typed as 1e-8 for 1e-4; ``max_grad_norm`` far too small for SGD; Adam's ``eps``
  above the gradients).
* ``updates_too_large``: the median ratio of one of those steps is above ``update_ratio_max`` (1.0): a
  step moved the weights by more than their own size, overwriting instead of refining (the largest step
  is taken: after such a step the weights are large and the next ratios small).

Off under DeepSpeed (it keeps the fp32 master weights and partitions the parameters itself), without an
optimizer the monitor can hook (a custom loop that gives none), and in steps the skip defence dropped (no
update: the post-hook does not run). No catalogue bug is known to produce these: configuration mistakes.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from . import Detector
from .. import facts

SAMPLED_TENSORS = 8
SAMPLED_ELEMENTS = 1 << 14
CANDIDATES = 32  # tensors looked at (one read at train begin) to find SAMPLED_TENSORS that are not all zero
JUDGED_STEPS = 3
# an optimizer that says it keeps the low bits of bf16 weights (stochastic rounding, Kahan summation, master copies)
KEEPS_LOW_BITS = ("bf16_stochastic_round", "stochastic_round", "stochastic_rounding", "kahan_sum", "use_kahan",
                  "kahan_summation", "master_weights", "use_master_weights", "compensated")


def _local(tensor):
    """A DTensor's local shard (FSDP2), else the tensor: every statistic here is a sample anyway."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _view(tensor, stride: int):
    return _local(tensor).detach().reshape(-1)[::stride][:SAMPLED_ELEMENTS]


class UpdateStats(Detector):
    codes = ("updates_lost", "updates_vanishing", "updates_too_large")

    def __init__(self):
        self.sample: List[tuple] = []  # (name, parameter, stride, half precision)
        self.off: Optional[str] = None
        self.pending: Optional[tuple] = None  # (step, lr, base lr, [(index, weights before, gradient mask)])
        self.results: List[tuple] = []  # (step, lr, base lr, [indices], device tensor [n, 4])
        self.steps: List[Dict[str, Any]] = []  # host summaries of the sampled steps that qualify
        self.done = False
        self.judged_once = False
        self.keeps_low_bits: List[str] = []

    # -- train begin: choose the sample ----------------------------------------------------------------

    def begin(self, mon) -> None:
        import torch

        optimizer = mon.optimizer
        if mon._zero is not None:
            self.off = "DeepSpeed keeps fp32 master weights and partitions the parameters itself"
        elif optimizer is None or not mon.hooks_updates:
            self.off = "no torch optimizer to hook"
        if self.off:
            self.done = True
            return
        embeddings = facts.embedding_parameters(mon.model)
        trainable = [(n, p) for n, p in mon.model.named_parameters()
                     if p.requires_grad and p.is_floating_point() and p.numel() >= 16 and id(p) not in embeddings
                     and p.device.type != "meta"]
        matrices = [(n, p) for n, p in trainable if p.dim() >= 2]
        pool = matrices or trainable
        if not pool:
            self.done = True
            return
        step = max(1, len(pool) // CANDIDATES)
        candidates = pool[::step][:CANDIDATES]
        with torch.no_grad():  # one read at train begin (one copy per device): which candidates are not all zero
            peaks = _to_host([_local(p).detach().abs().amax().float() for _, p in candidates])
        nonzero = [c for c, peak in zip(candidates, peaks) if peak > 0]
        step = max(1, len(nonzero) // SAMPLED_TENSORS)
        for name, p in nonzero[::step][:SAMPLED_TENSORS]:
            stride = max(1, _local(p).numel() // SAMPLED_ELEMENTS)
            self.sample.append((name, p, stride, p.dtype in (torch.float16, torch.bfloat16)))
        if not self.sample:
            self.done = True
            return
        self.groups = {id(p): group for group in optimizer.param_groups for p in group.get("params", ())}
        for group in [getattr(optimizer, "defaults", {}) or {}] + list(optimizer.param_groups):
            self.keeps_low_bits += [key for key in KEEPS_LOW_BITS if group.get(key)]

    @staticmethod
    def _sampled(mon) -> bool:
        every = mon.options["update_every"]
        return mon.step <= every or mon.step % every == 0

    # -- before the update: device copies -------------------------------------------------------------

    def grads(self, mon) -> None:
        self.pending = None
        if self.done or not self._sampled(mon):
            return
        lrs, bases, entries = [], [], []
        for index, (_, p, stride, _) in enumerate(self.sample):
            grad = p.grad
            group = self.groups.get(id(p))
            if grad is None or group is None:
                continue
            lr = group.get("lr")
            if not isinstance(lr, (int, float)):  # a tensor learning rate stays on the device: not judged
                continue
            lrs.append(float(lr))
            bases.append(float(group.get("initial_lr", lr)))
            entries.append((index, _view(p, stride).clone(), _view(grad, stride).ne(0)))
        if entries:
            self.pending = (mon.step, max(lrs), max(bases), entries)

    # -- after the update: four device scalars per tensor ----------------------------------------------

    def updated(self, mon) -> None:
        pending, self.pending = self.pending, None
        if pending is None or pending[0] != mon.step:
            return
        import torch

        step, lr, base, entries = pending
        rows = []
        with torch.no_grad():
            for index, before, moved in entries:
                _, p, stride, _ = self.sample[index]
                after = _view(p, stride)
                wide = before.float()
                row = torch.stack([(after.float() - wide).norm(), wide.norm(),
                                   (after.eq(before) & moved).sum().float(), moved.sum().float()])
                # a model spread over devices: one device for the read (a device-to-device copy, no host sync)
                rows.append(row if not rows else row.to(rows[0].device, non_blocking=True))
            self.results.append((step, lr, base, [index for index, _, _ in entries], torch.stack(rows)))

    # -- at a read: host values, judged ---------------------------------------------------------------

    def read(self, mon, view) -> None:
        if not self.results:
            return
        results, self.results = self.results, []
        values = _to_host([r[4] for r in results])  # one copy per device for every sampled step since the last read
        for (step, lr, base, indices, _), rows in zip(results, values):
            ratios = [d / w for d, w, _, moved in rows if w > 0 and moved > 0]  # a tensor without gradient: no step
            half = [(same, moved) for (_, _, same, moved), i in zip(rows, indices) if self.sample[i][3]]
            moved_half = sum(m for _, m in half)
            record = {"step": step, "lr": lr, "ratio": statistics.median(ratios) if ratios else None,
                      "lost": (sum(s for s, _ in half) / moved_half) if moved_half else None, "tensors": len(ratios)}
            if mon.writer is not None:
                mon.writer.updates(record)
            if not ratios or not lr > 0 or lr < 0.5 * base:
                continue  # warm-up, a zero learning rate (lr_schedule_cannot_train's), LoRA's A at step 1 (B is zero)
            self.steps.append(record)
            if len(self.steps) >= JUDGED_STEPS:
                self.judge(mon)

    def close(self, mon) -> None:
        if self.steps and not self.judged_once:
            self.judge(mon)

    def judge(self, mon) -> None:
        """Judge the window of the last JUDGED_STEPS qualifying steps (each code is reported once), then start a
        new window: the statistics go on for the whole run (a JSONL ``updates`` record per sampled step)."""
        self.judged_once = True
        steps, self.steps = self.steps, []
        if all(mon.seen(code) or code in mon.options["off"] for code in self.codes):
            self.done = True  # nothing left to report: no more snapshots
        opts = mon.options
        lr = statistics.median(s["lr"] for s in steps)
        where = f"{len(steps)} optimizer step{'s' if len(steps) != 1 else ''} (from step {steps[0]['step']})"
        names = [name for name, _, _, _ in self.sample]
        detail = {"steps": [s["step"] for s in steps], "lr": lr, "sampled": names,
                  "ratios": [s["ratio"] for s in steps], "lost_shares": [s["lost"] for s in steps]}
        lost = [s["lost"] for s in steps if s["lost"] is not None]
        if lost and statistics.median(lost) > opts["lost_share"] and not self.keeps_low_bits:
            share = statistics.median(lost)
            dtypes = sorted({str(p.dtype).replace("torch.", "") for _, p, _, half in self.sample if half})
            mon.report("updates_lost", steps[-1]["step"],
                       f"{share:.0%} of the sampled weight elements with a non-zero gradient did not change in {where} "
                       f"at learning rate {lr:.3g}: the weights are {'/'.join(dtypes)} and the optimizer "
                       f"({type(mon.optimizer).__name__}) keeps no float32 master copy, so every step smaller than half "
                       "the format's spacing rounds back to the old weight (bf16 keeps 8 significant bits: a weight of "
                       "0.02 moves only by more than ~6e-5). transformers 5 loads bf16 checkpoints in bf16 by default "
                       "(dtype=\"auto\"). Fix: float32 weights (from_pretrained(..., dtype=torch.float32), or "
                       "model.float()) with bf16 autocast (bf16=True), or an optimizer with stochastic rounding or Kahan "
                       "summation (torchao's AdamW(bf16_stochastic_round=True), optimi's kahan_sum)", (),
                       {**detail, "lost_share": share, "dtypes": dtypes})
        ratios = [s["ratio"] for s in steps if s["ratio"] is not None]
        if not ratios:
            return
        ratio, largest = statistics.median(ratios), max(ratios)
        detail["ratio"] = ratio
        if ratio < opts["update_ratio_min"]:
            # clipping shrinks the steps of SGD-like optimizers; Adam-like ones divide the gradient's scale out
            clip = _max_grad_norm(mon) if "adam" not in type(mon.optimizer).__name__.lower() else None
            mon.report("updates_vanishing", steps[-1]["step"],
                       f"the optimizer's steps are {ratio:.2g} of the weights' size (median ||dw||/||w|| of "
                       f"{len(names)} sampled tensors over {where}, threshold {opts['update_ratio_min']:g}) at learning "
                       f"rate {lr:.3g}: nothing learns at this rate (fine-tuning steps are ~1e-4..1e-2 of the weights); "
                       "a learning rate far too small (1e-8 typed for 1e-4?)"
                       + (f", max_grad_norm {clip:g} far too small for this optimizer" if clip else "")
                       + ", or an optimizer eps larger than the gradients", (), {**detail, "max_grad_norm": clip})
        elif largest > opts["update_ratio_max"]:
            # the largest: a step that overwrites the weights makes them large, and the next steps' ratios small
            at = steps[ratios.index(largest)]["step"] if len(ratios) == len(steps) else steps[-1]["step"]
            mon.report("updates_too_large", at,
                       f"an optimizer step changed the sampled weights by {largest:.2g} x their own size (median "
                       f"||dw||/||w|| of {len(names)} sampled tensors at step {at}, threshold "
                       f"{opts['update_ratio_max']:g}) at learning rate {lr:.3g}: the weights are overwritten, not "
                       "refined (fine-tuning steps are ~1e-4..1e-2 of the weights); lower the learning rate, and clip "
                       "the gradients (max_grad_norm)", (), detail)


def _to_host(tensors) -> list:
    """Host values of ``tensors`` (0-d: a float; [n, 4]: n rows), in order: one concatenated copy per device."""
    import torch

    by_device: Dict[Any, List[int]] = {}
    for i, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(i)
    values: list = [None] * len(tensors)
    for indices in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices]).tolist()
        at = 0
        for i in indices:
            tensor = tensors[i]
            part = flat[at: at + tensor.numel()]
            at += tensor.numel()
            width = tensor.shape[-1] if tensor.dim() else 1
            values[i] = part[0] if tensor.dim() == 0 else [part[k: k + width] for k in range(0, len(part), width)]
    return values


def _max_grad_norm(mon) -> Optional[float]:
    args = (getattr(mon, "trainer_context", None) or {}).get("args")
    value = getattr(args, "max_grad_norm", None)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None
