"""LoRA + the Trainer's own optimizer under DeepSpeed ZeRO: ``zip() argument 2 is longer than argument 1``.

Why: ``Trainer.create_optimizer`` always builds two parameter groups, one with weight decay and one without
(biases and norm weights). With only LoRA weights trainable (every LoRA tensor is a ``Linear`` weight) the
no-decay group is empty. Under DeepSpeed, transformers before 5.1 builds that optimizer *and* the
learning-rate scheduler in ``deepspeed_optim_sched`` (``integrations/deepspeed.py``, called by
``deepspeed_init``) before the engine exists: the scheduler's ``base_lrs`` (and ``LambdaLR``'s
``lr_lambdas``) get one entry per group, two. ``accelerator.prepare(model, optimizer)`` then hands the
optimizer to ``deepspeed.initialize``, and ``DeepSpeedEngine._configure_optimizer`` removes every group
without parameters from it, in place (``basic_optimizer.param_groups[:] = [pg for pg in ... if
len(pg["params"]) != 0]``; DeepSpeed has done so for client optimizers since at least 0.9.0, for every basic
optimizer since #4277). The Trainer's scheduler still holds that optimizer: one group against two learning
rates. Since torch 2.10 ``LRScheduler._update_lr`` zips them with ``strict=True``, so the first
``lr_scheduler.step()`` raises ``ValueError: zip() argument 2 is longer than argument 1`` on every rank, ZeRO-2
and ZeRO-3 alike. (Before 2.10 the zip silently dropped the last learning rate, the removed group's: with the
Trainer's groups, which share one learning rate and one schedule, nothing else changed.) With
``offload_optimizer`` it does not crash: accelerate builds a ``DeepSpeedCPUAdam`` from the Trainer's AdamW
(``map_pytorch_optim_to_deepspeed``), the engine trims that one's list, and the scheduler keeps the AdamW, whose
list still has both groups (the two share the group dicts, so the schedule still reaches the CPU optimizer).

The fix, a backport of transformers PR #43711 (5.1.0, "Fix scheduler initialization order"), which creates the
scheduler after ``accelerator.prepare`` from the optimizer the engine has already trimmed. The training loop
cannot be reordered from outside, so the shim brings about the same state one step earlier: it wraps
``Trainer.create_optimizer`` and, when the trainer runs under DeepSpeed (``is_deepspeed_enabled``: the optimizer
``create_optimizer`` then builds is the one ``deepspeed_init`` hands to the engine), removes the groups without
parameters from the new optimizer with DeepSpeed's own expression, before the scheduler is built from it. The
engine then finds nothing to remove, the scheduler has one learning rate per group the engine steps, and the
run computes exactly what it computes when the user leaves the empty group out by hand (the test checks this
bit for bit under ZeRO-2 and ZeRO-3). Why here: not in the scheduler (its per-group lists differ by class and
are restored from checkpoints), not in DeepSpeed (which behaves as documented), but where the two-group
optimizer is made, and only on the path that leads to a DeepSpeed engine: without DeepSpeed (one process, DDP,
FSDP) an empty group is legal, torch keeps it, and the shim returns the optimizer untouched. An optimizer
whose groups all hold parameters is never touched either, so every run that did not crash stays bit-identical.

Applies to transformers >=4.30,<5.1.0 (4.30 is where the Trainer hands DeepSpeed to accelerate and has
``is_deepspeed_enabled``; 4.30.2, 4.57.6 and 5.0.0 build the scheduler in ``deepspeed_optim_sched``, read),
deepspeed >=0.9.0 (the removal is in 0.9.0 and 0.19.8, read; older sources were not read) and torch >=2.10 (the
strict zip: 2.13 read; 2.10 per transformers #43692 and TRL #4951). Falls back: the trainer not under
DeepSpeed, an optimizer without a ``param_groups`` list (a ``DummyOptim`` when the DeepSpeed config has an
``optimizer`` section: the engine builds its own from a flat parameter list) or without empty groups: the
result goes back unchanged. Not reached: a subclass that overrides ``create_optimizer`` without calling it, and a
resumed run whose saved scheduler state carries the old group count (upstream's order does not handle it
either).

Follow-ups: #43780 (5.2.0: #43711's reordered prepare skipped accelerator.prepare under DeepSpeed unless the
scheduler was a DummyScheduler; the model and optimizer are prepared again) — not carried: the shim does not
reorder the training loop: prepare runs as before. 5.2.0 and 5.25.0 read: the scheduler is still created after
``accelerator.prepare``; no revert found.
"""

from __future__ import annotations

import logging
import sys

from .._util import acted
from ..spec import FollowUp, ShimSpec, Target

log = logging.getLogger("ftshims")

SPEC = ShimSpec(
    id="deepspeed_empty_param_group",
    since="0.3.0",
    title="DeepSpeed drops the Trainer's empty no-decay group after the scheduler was built: the first "
    "scheduler step crashes (LoRA, torch >= 2.10)",
    symptom="LoRA (or any run whose trainable weights all take weight decay) with Trainer(deepspeed=...) and the "
    "Trainer's default optimizer: ValueError: zip() argument 2 is longer than argument 1 in "
    "torch/optim/lr_scheduler.py _update_lr at the first optimizer step, on every rank, ZeRO-2 and ZeRO-3 "
    "(not with offload_optimizer)",
    why="Before 5.1 the Trainer builds the learning-rate scheduler from its two-group optimizer before DeepSpeed's "
    "engine removes the empty no-decay group from that optimizer; torch 2.10+ refuses the scheduler's extra "
    "learning rate. The shim removes the empty groups when the optimizer is built for DeepSpeed, as the engine "
    "would, so the scheduler matches the groups the engine trains.",
    requires={"transformers": ">=4.30,<5.1.0", "deepspeed": ">=0.9.0", "torch": ">=2.10"},
    fixed_in={"transformers": "5.1.0"},
    refs=(
        "https://github.com/huggingface/transformers/pull/43711",
        "https://github.com/huggingface/transformers/pull/43780",
        "https://github.com/huggingface/transformers/pull/43692",
        "https://github.com/deepspeedai/DeepSpeed/pull/4277",
        "https://github.com/huggingface/trl/pull/4951",
        "https://github.com/hiyouga/LlamaFactory/issues/10144",
        "https://github.com/modelscope/ms-swift/issues/8299",
    ),
    backports=("https://github.com/huggingface/transformers/pull/43711",),
    follow_ups=(
        FollowUp(
            ref="https://github.com/huggingface/transformers/pull/43780",
            what="5.2.0: #43711's reordered prepare skipped accelerator.prepare under DeepSpeed unless the scheduler "
            "was a DummyScheduler; the model and optimizer are prepared again",
            carried=False,
            reason="the shim does not reorder the training loop: prepare runs as before",
        ),
    ),
    targets=(Target("transformers.trainer", "Trainer.create_optimizer"),),
    modules=("transformers.trainer",),
)


def _under_deepspeed(trainer) -> bool:
    return bool(getattr(trainer, "is_deepspeed_enabled", False))


def drop_empty_groups(optimizer) -> int:
    """Remove the parameter groups without parameters from ``optimizer`` in place (DeepSpeed's own expression,
    ``DeepSpeedEngine._configure_optimizer``); the number removed."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        return 0
    kept = [group for group in groups if len(group["params"]) != 0]
    removed = len(groups) - len(kept)
    if removed:
        groups[:] = kept
    return removed


def _create_optimizer(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if not _under_deepspeed(instance):
        return result
    optimizer = getattr(instance, "optimizer", None)
    if optimizer is None:
        optimizer = result
    removed = drop_empty_groups(optimizer)
    if removed:
        acted(SPEC.id, "empty parameter groups removed before the scheduler")
        log.info("%s: removed %d empty parameter group(s) from the optimizer built for DeepSpeed (the engine "
                 "removes them; the scheduler is built next)", SPEC.id, removed)
    return result


def install(patcher, options) -> None:
    trainer = sys.modules["transformers.trainer"]
    patcher.wrap(trainer.Trainer, "create_optimizer", _create_optimizer)
