"""Resuming from a ``save_only_model`` checkpoint silently restarts the learning-rate schedule and AdamW's moments.

Why: ``TrainingArguments(save_only_model=True)`` (transformers >= 4.36) writes the weights and
``trainer_state.json`` but no ``optimizer.pt``, ``scheduler.pt`` or RNG state. ``train(resume_from_checkpoint=...)``
still accepts such a checkpoint: it restores the weights, the global step and the data position, and
``Trainer._load_optimizer_and_scheduler`` returns without a word when the two files are missing. The run goes on
with a fresh optimizer and a fresh scheduler at step 0: warmup starts again in the middle of the run (linear,
warmup 2, 8 steps, resumed at 4: learning rates 0, 5e-4, 1e-3, 8.3e-4 for steps 5-8 instead of 6.7e-4 ... 1.7e-4;
losses and weights differ). The argument's help text says such checkpoints cannot be resumed; nothing enforces
it. Reproduced on transformers 4.57.6 and 5.25.0 (dossier-wave5 lead 3); no upstream report found.

The guard: wrap ``Trainer._load_optimizer_and_scheduler``. When the checkpoint has a ``trainer_state.json`` with
a global step > 0 but lacks the optimizer or the scheduler state (what ``save_only_model`` writes), raise
:class:`ftshims.checkpoint.ResumeNotExact` before any step, naming the checkpoint, what it lacks and what to do
(resume from a checkpoint saved without ``save_only_model``; or load the weights with ``from_pretrained`` and
start a new run, knowingly). A resume cannot be made exact here: the optimizer's moments were never saved.
Full checkpoints, a fresh run (no checkpoint) and DeepSpeed (whose own loader already refuses a checkpoint
without ``global_step*``) go to the original unchanged.

Applies to transformers >= 4.36 (``save_only_model`` appears in 4.36.0; 4.35.0 read: absent); unfixed in 5.25.0.
Fallback: without the method (a changed target) the shim is skipped; ``ftshims.apply(exclude=[...])`` turns the
guard off for a deliberate weights-only resume.
"""

from __future__ import annotations

import os

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="resume_save_only_model_restarts_lr_schedule",
    since="0.3.0",
    title="Trainer resumes from a save_only_model checkpoint with a fresh optimizer and scheduler",
    symptom="train(resume_from_checkpoint=...) from a save_only_model=True checkpoint raises nothing; warmup and "
    "decay restart at step 0 in the middle of the run and AdamW's moments are reset: a silently different run",
    why="save_only_model checkpoints hold no optimizer, scheduler or RNG state, and _load_optimizer_and_scheduler "
    "skips loading without a word. The guard raises a clear error before the first step instead: such a resume "
    "cannot be exact.",
    requires={"transformers": ">=4.36.0"},
    fixed_in={},
    effect="guards",
    refs=(
        # the option's own documentation: "you won't be able to resume training from checkpoint"; no upstream
        # report of the silent resume found (issues searched: save_only_model resume optimizer scheduler)
        "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments.save_only_model",
    ),
    targets=(Target("transformers.trainer", "Trainer._load_optimizer_and_scheduler", params=("checkpoint",)),),
    modules=("transformers.trainer",),
)


def refusal(checkpoint: str):
    """The :class:`ResumeNotExact` for ``checkpoint`` when a resume from it would restart the optimizer and the
    schedule, else None."""
    from ..checkpoint import ResumeNotExact
    from ..checkpoint.layout import describe

    found = describe(checkpoint)
    step = found["global_step"]
    if not found["trainer_checkpoint"] or not isinstance(step, int) or step <= 0 or found["deepspeed"]:
        return None
    lacks = [what for what, there in (("optimizer.pt", found["optimizer"]), ("scheduler.pt", found["scheduler"]))
             if not there]
    if not lacks:
        return None
    kind = "a save_only_model=True checkpoint" if found["save_only_model"] else "a checkpoint without them"
    return ResumeNotExact(
        f"ftshims: refusing to resume from {checkpoint}: it has no {' and no '.join(lacks)} ({kind}). The Trainer "
        f"would go on from step {step} with a fresh optimizer (AdamW's moments reset) and a learning-rate schedule "
        f"restarted at step 0 (warmup again), silently unlike the uninterrupted run. Resume from a checkpoint saved "
        f"without save_only_model, or load these weights with from_pretrained and start a new run; to resume "
        f"anyway, ftshims.apply(exclude=['{SPEC.id}'])."
    )


def _load_optimizer_and_scheduler(wrapped, instance, args, kwargs):
    checkpoint = args[0] if args else kwargs.get("checkpoint")
    if checkpoint is not None and not getattr(instance, "is_deepspeed_enabled", False) and os.path.isdir(str(checkpoint)):
        error = refusal(str(checkpoint))
        if error is not None:
            acted(SPEC.id, "resumes refused")
            raise error
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    patcher.wrap_method("transformers.trainer", "Trainer._load_optimizer_and_scheduler", _load_optimizer_and_scheduler)


# ---------------------------------------------------------------------------
# Reproduction


def _run(out, save_only_model, resume=None):
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from .. import tiny

    lrs = {}

    class LearningRates(TrainerCallback):
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            lrs[state.global_step + 1] = float(optimizer.param_groups[0]["lr"])

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (16, 8), generator=g)
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    extra = tiny.on_cpu()
    args = TrainingArguments(out, per_device_train_batch_size=2, max_steps=8, learning_rate=1e-3, warmup_steps=2,
                             lr_scheduler_type="linear", save_steps=4, save_strategy="steps", report_to=[], seed=0,
                             save_only_model=save_only_model, disable_tqdm=True, logging_strategy="no", **extra)
    with tiny.quiet():
        trainer = Trainer(model=tiny.tiny_llama(), args=args, train_dataset=rows, callbacks=[LearningRates()])
        trainer.train(resume_from_checkpoint=resume)
    return lrs, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def probe(save_only_model: bool = True) -> Observation:
    """A tiny Llama, 8 steps (linear schedule, warmup 2), checkpoint at step 4 (``save_only_model`` or not), then a
    new Trainer resumed from it. The bug: the resume goes on without an error, and its learning rates or final
    weights differ from the uninterrupted run's."""
    import tempfile

    from packaging.version import Version

    from .. import tiny
    from ..checkpoint import ResumeNotExact
    from ..versions import installed_version

    if Version(installed_version("transformers") or "0") < Version("4.36.0"):
        raise ProbeUnsupported("transformers < 4.36 has no save_only_model")
    with tempfile.TemporaryDirectory() as out:
        full_lrs, full_weights = _run(out, save_only_model)
        try:
            with tiny.resumable():
                resumed_lrs, resumed_weights = _run(out + "/resumed", save_only_model, resume=out + "/checkpoint-4")
        except ResumeNotExact as exc:
            return Observation(False, f"save_only_model={save_only_model}: resume refused before the first step: "
                                      f"{str(exc)[:150]}...")
    late = {s: resumed_lrs.get(s) for s in range(5, 9)}
    same_lr = all(full_lrs.get(s) == v for s, v in late.items())
    gap = float((full_weights - resumed_weights).abs().max())
    detail = (f"save_only_model={save_only_model}: lr steps 5-8 resumed {[f'{v:.2e}' for v in late.values()]}, "
              f"uninterrupted {[f'{full_lrs[s]:.2e}' for s in range(5, 9)]}; max |weight diff| {gap:.3g}")
    return Observation(not same_lr or gap != 0.0, detail)
