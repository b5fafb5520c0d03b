"""Parameters that should train and do not, and parameters that should not and do.

* ``nothing_trainable`` (train begin): no parameter requires grad. With adapters,
  ``kbit_prep_keeps_adapters_trainable``'s bug produces it
  (``prepare_model_for_kbit_training`` on a model that already has adapters).
* ``trainable_without_grad`` (the first ``grad_steps`` optimizer steps): parameters
  with ``requires_grad`` whose ``.grad`` stayed ``None`` in every one of them,
  grouped by module. A host check (``mon.has_grad(p)``: ``p.grad``, or under DeepSpeed, which leaves it None, the monitor's note that a gradient arrived), no device read. With
  adapters under reentrant gradient checkpointing it is
  ``lora_reentrant_checkpointing``'s silent form: a trainable module after the
  checkpointed layers (``modules_to_save=["lm_head"]``) keeps the loss
  differentiable, the run trains, and the LoRA weights never move. Not judged
  when no parameter got a gradient at all, nor on a full fine-tune (no adapters)
  without gradient checkpointing: there every parameter the loss depends on gets a
  gradient, and those that do not are unused by design (a pooler the head never
  reads, a standalone decoder's cross-attention, a vision tower's unused tail, a
  VQ-GAN's decoder: 50 healthy zoo classes on transformers 4.57, 82 on 5.25 would
  be flagged), which nothing in the catalogue produces. With adapters or under
  checkpointing (reentrant checkpointing cuts the gradient of every layer before a
  segment whose input needs none) it is judged.
* ``frozen_param_changed`` (logging steps and the end): sampled frozen parameters
  whose checksum (float64 sum and sum of squares of up to 2**20 strided elements:
  two scalars each, no copy of the model) changed; in a PeftModel the base weights PEFT froze count as frozen
  even when something set ``requires_grad`` back on them.
  ``resize_embeddings_keeps_frozen`` explains moved embeddings (transformers < 4.36
  ``resize_token_embeddings`` makes new, trainable embedding parameters).
  Under DeepSpeed ZeRO-3 a parameter's ``.data`` is the full value only while the engine has it gathered and
  an empty tensor after it releases it: the checksum is then taken of the rank's own partition
  (``ds_tensor``, where ZeRO-3 keeps the value and writes an update), each rank judging its own part. Before,
  a resumed run (DeepSpeed's checkpoint load leaves the parameters gathered at train begin) compared full
  values against the empty views of later checks ("8 of 8 sampled frozen parameters changed" on every rank of
  a healthy LoRA resume), and a fresh run (parameters partitioned at train begin) sampled nothing at all.
"""

from __future__ import annotations

from typing import Dict, List

from . import Detector
from .. import facts


def _group(names) -> Dict[str, int]:
    """``{module path: parameters}``; an adapter's parameters count under the layer they adapt
    (``...q_proj.lora_A.default.weight`` -> ``...q_proj``)."""
    modules: Dict[str, int] = {}
    for name in sorted(names):
        module = name.rsplit(".", 1)[0] if "." in name else name
        if ".lora_" in module:
            module = module.split(".lora_", 1)[0]
        modules[module] = modules.get(module, 0) + 1
    return modules


def _unused_by_design(model) -> set:
    """Parameters no forward uses while an adapter is active: the ``original_module`` that PEFT's
    ``ModulesToSaveWrapper`` keeps beside the trained copy (peft < 0.5 leaves it ``requires_grad=True``: on
    peft 0.4.0 it would be reported beside the LoRA weights, although nothing is wrong with it)."""
    unused = set()
    for path, module in model.named_modules():
        if type(module).__name__ == "ModulesToSaveWrapper" and hasattr(module, "original_module"):
            prefix = f"{path}.original_module." if path else "original_module."
            unused.update(prefix + name for name, _ in module.original_module.named_parameters())
    return unused


class NothingTrainable(Detector):
    codes = ("nothing_trainable",)

    def begin(self, mon) -> None:
        total = sum(1 for _ in mon.model.parameters())
        if total == 0 or any(p.requires_grad for p in mon.model.parameters()):
            return
        adapters = facts.has_adapters(mon.model)
        what = "a model with adapters" if adapters else "the model"
        mon.report("nothing_trainable", 0, f"no parameter of {what} requires grad ({total} parameters, all frozen): "
                   "the run can update nothing",
                   ("kbit_prep_keeps_adapters_trainable",) if adapters else (), {"parameters": total, "adapters": adapters})


class TrainableWithoutGrad(Detector):
    codes = ("trainable_without_grad",)

    def __init__(self):
        self.never = None  # names that got no gradient in every step seen so far
        self.steps = 0
        self.judged = False
        self.any_grad = False
        self.unused = None  # names of parameters unused by design (PEFT's stand-by copies), found once

    def grads(self, mon) -> None:
        if self.judged:
            return
        if self.unused is None:
            self.unused = _unused_by_design(mon.model)
        missing = set()
        for name, p in mon.model.named_parameters():
            if p.requires_grad and name not in self.unused:
                if not mon.has_grad(p):
                    missing.add(name)
                else:
                    self.any_grad = True
        self.never = missing if self.never is None else self.never & missing
        self.steps += 1
        self.last_step = mon.step
        if self.steps >= mon.options["grad_steps"]:
            self.judge(mon)

    def close(self, mon) -> None:
        if not self.judged and self.steps:
            self.judge(mon)

    def judge(self, mon) -> None:
        self.judged = True
        if not self.never or not self.any_grad:
            return
        reentrant = facts.checkpointing(mon.model)
        adapters = facts.has_adapters(mon.model)
        if not adapters and reentrant is None:
            return  # a full fine-tune without checkpointing: what gets no gradient is unused by design
        names = sorted(self.never)
        modules = _group(names)
        what = "LoRA weights" if any("lora_" in name for name in names) else "trainable parameters"
        candidates = ()
        if reentrant:  # adapters, or a full fine-tune behind frozen input embeddings: the shim hooks both
            candidates = ("lora_reentrant_checkpointing",)
        shown = ", ".join(list(modules)[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        mon.report(
            "trainable_without_grad", self.last_step,
            f"{what} got no gradient in {self.steps} optimizer step{'s' if self.steps != 1 else ''}: {len(names)} "
            f"parameter{'s' if len(names) != 1 else ''} in {len(modules)} module{'s' if len(modules) != 1 else ''} ({shown})",
            candidates,
            {"parameters": len(names), "modules": dict(list(modules.items())[:50]), "steps": self.steps,
             "gradient_checkpointing": None if reentrant is None else ("reentrant" if reentrant else "non-reentrant")},
        )


class FrozenParamChanged(Detector):
    codes = ("frozen_param_changed",)

    def __init__(self):
        self.sample: List[tuple] = []  # (name, parameter, checksum, meant_frozen)
        self.done = False

    def begin(self, mon) -> None:
        model = mon.model
        named = list(model.named_parameters())
        frozen = [(n, p, False) for n, p in named if not p.requires_grad and _values(p).numel()]
        adapter_ids = facts.adapter_parameter_ids(model)
        meant = []
        if adapter_ids is not None:  # a PeftModel: its base weights are frozen by PEFT
            meant = [(n, p, True) for n, p in named if p.requires_grad and id(p) not in adapter_ids and _values(p).numel()]
        self.embeddings = facts.embedding_parameters(model)
        limit = mon.options["frozen_samples"]
        first = [c for c in meant if id(c[1]) in self.embeddings] + [c for c in frozen if id(c[1]) in self.embeddings]
        rest = meant + frozen
        chosen = {id(c[1]): c for c in first[:limit]}
        room = limit - len(chosen)
        if room > 0 and rest:
            stride = max(1, len(rest) // room)
            for candidate in rest[::stride]:
                if len(chosen) >= limit:
                    break
                chosen.setdefault(id(candidate[1]), candidate)
        self.sample = [(n, p, _checksum(p), m) for n, p, m in chosen.values()]

    def check(self, mon) -> None:
        if self.done or not self.sample:
            return
        changed = [(n, p, m) for n, p, before, m in self.sample if _values(p).numel() and _checksum(p) != before]
        if not changed:
            return
        self.done = True
        names = [n for n, _, _ in changed]
        meant = [n for n, _, m in changed if m]
        embeddings = [n for n, p, _ in changed if id(p) in self.embeddings]
        text = f"{len(names)} of {len(self.sample)} sampled frozen parameter{'s' if len(self.sample) != 1 else ''} changed value ({', '.join(names[:4])})"
        if meant:
            text += f"; {len(meant)} of them PEFT base weights that PEFT froze and that have requires_grad=True again"
        mon.report("frozen_param_changed", mon.completed_step, text,
                   ("resize_embeddings_keeps_frozen",) if embeddings else (),
                   {"changed": names, "sampled": len(self.sample), "peft_base_weights_trainable": meant, "embeddings": embeddings})


SAMPLED_ELEMENTS = 1 << 20  # a checksum reads at most this many elements of a parameter (a strided view)


def _values(p):
    """The values of ``p`` this rank keeps: under DeepSpeed ZeRO-3 (``ds_id``) its own partition ``ds_tensor``
    (``p.data`` is the full value only while gathered, 0 elements once released); else ``p`` itself. Values
    with 0 elements are neither sampled nor judged (a partition swapped out to NVMe may be one: not run here)."""
    part = getattr(p, "ds_tensor", None) if hasattr(p, "ds_id") else None
    return p if part is None else part


def _checksum(p) -> tuple:
    """Sum and sum of squares (float64) of up to SAMPLED_ELEMENTS evenly strided elements of ``_values(p)``:
    two scalars, read at begin and at each check, never per step, and no copy of the parameter."""
    import torch

    flat = _values(p).detach().reshape(-1)
    part = flat[:: max(1, flat.numel() // SAMPLED_ELEMENTS)]
    wide = part.to(torch.float32 if part.device.type == "mps" else torch.float64)
    return tuple(torch.stack([wide.sum(), wide.square().sum()]).tolist())


class TrainableNotInOptimizer(Detector):
    """``trainable_not_in_optimizer`` (train begin, host facts only): parameters with ``requires_grad`` that are
    in no parameter group of the optimizer. They get gradients (memory, compute) and never change: an optimizer
    built before ``get_peft_model`` / ``resize_token_embeddings`` / unfreezing layers / ``fully_shard``, or a
    custom one built on a filtered list. Compared by identity; a tied weight counts once. Not judged without a
    torch optimizer (the zoo gate's steps, a custom loop without one) or under DeepSpeed (its optimizer holds
    flattened partitions, not the model's parameters)."""

    codes = ("trainable_not_in_optimizer",)

    def begin(self, mon) -> None:
        import torch

        optimizer = mon.optimizer
        if mon._zero is not None or not isinstance(optimizer, torch.optim.Optimizer):
            return
        held = {id(p) for group in optimizer.param_groups for p in group.get("params", ())}
        if not held:
            return
        unused = _unused_by_design(mon.model)
        missing = [name for name, p in mon.model.named_parameters()
                   if p.requires_grad and id(p) not in held and name not in unused]
        if not missing:
            return
        trainable = sum(1 for p in mon.model.parameters() if p.requires_grad)
        modules = _group(missing)
        shown = ", ".join(list(modules)[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        none = len(missing) == trainable
        mon.report("trainable_not_in_optimizer", 0,
                   f"{len(missing)} of {trainable} trainable parameters are in no optimizer parameter group "
                   f"({'none of them is: ' if none else ''}{shown}): they get gradients and never change; build "
                   "the optimizer after the model is final (after get_peft_model, resize_token_embeddings, "
                   "unfreezing, fully_shard), from model.parameters(), or freeze what it should not train",
                   (), {"parameters": len(missing), "trainable": trainable, "modules": dict(list(modules.items())[:50]),
                        "optimizer": type(optimizer).__name__})
