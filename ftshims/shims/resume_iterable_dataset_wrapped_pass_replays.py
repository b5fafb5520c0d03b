"""A resume of a run that went past one pass of an IterableDataset replays and skips examples.

Why: with a training dataset that has no length (a ``torch.utils.data.IterableDataset``, a streaming
``datasets.IterableDataset``) and ``max_steps`` larger than one pass, the ``Trainer`` takes one "epoch" to be
``max_steps`` updates; when the data runs out it starts the next epoch, a new pass. A resume computes
``epochs_trained = global_step // max_steps = 0`` and skips ``global_step x gradient_accumulation_steps`` batches
of a fresh pass: the skip runs off the end of the data, the next pass starts at its first example, and the
resumed run trains examples the uninterrupted run did not (10 examples, batch 1, 16 steps, resumed at 12:
examples 0, 1, 2, 3 at steps 13-16 instead of 2, 3, 4, 5; losses and weights differ). transformers 4.57.6 and
5.25.0 (both run, dossier-wave5 lead 4). Older releases (4.30.2 and 4.34.1 run) lose the rest of the run
instead: the skip empties the resumed pass and the Trainer stops at once with "not a single sample in your
epoch_iterator" (huggingface/transformers#26413), a warning, having trained none of steps 13-16. PR #33544 (count
the passes) is open, never merged.

The guard: wrap ``Trainer._load_optimizer_and_scheduler`` (called on every resume before the first step). When
the training dataset has no length, ``max_steps`` is set, the data skip is on (``ignore_data_skip=False``) and
the checkpoint's ``trainer_state.json`` says the run had started a second pass (its ``epoch`` is >= 1: the
Trainer's epoch counts passes for such a dataset), raise :class:`ftshims.checkpoint.ResumeNotExact` naming the
checkpoint, the passes and what to do (``ignore_data_skip=True`` resumes with the data from its beginning,
knowingly). A checkpoint inside the first pass (epoch < 1) resumes exactly upstream and goes through; so do
datasets with a length, and runs without ``max_steps``.

Applies to transformers >= 4.30 (every pinned stack, 4.30.2 to 5.25.0, runs the test, whose probe asserts the bug
there; releases before 4.30 were not checked and stay out); not fixed in 5.25.0. Where the installed transformers
cannot resume any checkpoint under the installed torch (before ~4.40 with torch >= 2.6: ``rng_state.pth`` and
``weights_only``), the in-first-pass probe is unsupported. Fallback: a missing or changed target skips the shim; the
``Trainer``'s attributes it reads (``train_dataset``, ``args``) are read with defaults, and when it cannot tell
(no ``trainer_state.json``, an unreadable one) it stays out.
"""

from __future__ import annotations

import os

from .._util import acted
from ..spec import Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="resume_iterable_dataset_wrapped_pass_replays",
    since="0.3.0",
    title="Trainer resume past one pass of a dataset without length replays and skips examples",
    symptom="IterableDataset + max_steps past one pass, resumed after the data wrapped: the resumed run trains "
    "examples from the start of a pass instead of where the uninterrupted run was (replayed and skipped examples)",
    why="Without a length the Trainer counts max_steps updates as one epoch, so a resume skips global_step batches "
    "of one fresh pass, runs off its end and restarts the data. The guard raises a clear error before the first "
    "step (set ignore_data_skip=True to restart the data knowingly).",
    requires={"transformers": ">=4.30.0"},
    fixed_in={},
    effect="guards",
    refs=(
        "https://github.com/huggingface/transformers/issues/26413",
        "https://github.com/huggingface/transformers/pull/33544",
    ),
    targets=(Target("transformers.trainer", "Trainer._load_optimizer_and_scheduler", params=("checkpoint",)),),
    modules=("transformers.trainer",),
)


def _has_length(dataset) -> bool:
    try:
        return len(dataset) is not None
    except (TypeError, NotImplementedError, AttributeError):
        return False


def refusal(trainer, checkpoint: str):
    """The :class:`ResumeNotExact` when resuming ``trainer`` from ``checkpoint`` would skip into a new pass of a
    dataset without length, else None."""
    from ..checkpoint import ResumeNotExact
    from ..checkpoint.layout import trainer_state

    args = getattr(trainer, "args", None)
    dataset = getattr(trainer, "train_dataset", None)
    if args is None or dataset is None or _has_length(dataset):
        return None
    if getattr(args, "ignore_data_skip", False) or not getattr(args, "max_steps", 0) or args.max_steps <= 0:
        return None
    state = trainer_state(checkpoint)
    if not isinstance(state, dict) or "_error" in state:
        return None
    epoch, step = state.get("epoch"), state.get("global_step")
    if not isinstance(epoch, (int, float)) or not isinstance(step, int) or epoch < 1 or step <= 0:
        return None
    passes = int(epoch)
    return ResumeNotExact(
        f"ftshims: refusing to resume from {checkpoint}: the training dataset has no length "
        f"({type(dataset).__name__}) and the run had gone through it {passes} time{'s' if passes != 1 else ''} "
        f"(trainer_state.json: epoch {epoch:g}, global step {step}). The Trainer would skip {step} update steps' "
        f"batches from the start of one fresh pass, run off its end and start the data again from the first "
        f"example: examples replayed and skipped, unlike the uninterrupted run (huggingface/transformers#26413). "
        f"Set ignore_data_skip=True to resume with the data from its beginning (knowingly), or give the dataset a "
        f"length; ftshims.apply(exclude=['{SPEC.id}']) turns this guard off."
    )


def _load_optimizer_and_scheduler(wrapped, instance, args, kwargs):
    checkpoint = args[0] if args else kwargs.get("checkpoint")
    if checkpoint is not None and os.path.isdir(str(checkpoint)):
        error = refusal(instance, str(checkpoint))
        if error is not None:
            acted(SPEC.id, "resumes refused")
            raise error
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    patcher.wrap_method("transformers.trainer", "Trainer._load_optimizer_and_scheduler", _load_optimizer_and_scheduler)


# ---------------------------------------------------------------------------
# Reproduction


def _run(out, resume=None, passes=10, steps=16, save=12):
    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny

    g = torch.Generator().manual_seed(1)
    data = torch.randint(3, 128, (passes, 8), generator=g)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for row in data:
                yield {"input_ids": row, "labels": row.clone()}

    seen = []
    model = tiny.tiny_llama()
    firsts = [int(r[0]) * 1000 + int(r[1]) for r in data]

    def note(module, args, kwargs):
        ids = kwargs["input_ids"][0]
        seen.append(firsts.index(int(ids[0]) * 1000 + int(ids[1])))

    model.register_forward_pre_hook(note, with_kwargs=True)
    args = TrainingArguments(out, per_device_train_batch_size=1, max_steps=steps, learning_rate=1e-3, save_steps=save,
                             save_strategy="steps", report_to=[], seed=0, disable_tqdm=True, **tiny.on_cpu(),
                             logging_strategy="no")
    with tiny.quiet():
        Trainer(model=model, args=args, train_dataset=Stream()).train(resume_from_checkpoint=resume)
    return seen


def probe(save: int = 12) -> Observation:
    """10 examples, batch 1, 16 steps; checkpoint at ``save`` (12: in the second pass; 8: inside the first), then a
    new Trainer resumed from it. The bug: the examples of the resumed steps are not the uninterrupted run's."""
    import tempfile

    from .. import tiny
    from ..checkpoint import ResumeNotExact

    with tempfile.TemporaryDirectory() as out:
        full = _run(out, save=save)
        try:
            with tiny.resumable():
                resumed = _run(out + "/resumed", resume=f"{out}/checkpoint-{save}", save=save)
        except ResumeNotExact as exc:
            return Observation(False, f"checkpoint-{save}: resume refused before the first step: {str(exc)[:140]}...")
    want = full[save:]
    return Observation(resumed != want, f"checkpoint-{save}: examples of steps {save + 1}-{len(full)}: resumed "
                                        f"{resumed}, uninterrupted {want}")
