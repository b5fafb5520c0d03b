"""A model whose generation config is invalid trains, then every checkpoint save raises.

Why: ``PreTrainedModel.save_pretrained`` saves the model's ``generation_config``, and
``GenerationConfig.save_pretrained`` validates it strictly and raises ``ValueError`` (from transformers 4.37;
4.36.2 warned and skipped the file). Some hub checkpoints ship exactly such a config (sampling flags with
``do_sample=False``, e.g. ``temperature`` 1e-6 with greedy decoding: QwenLM/Qwen3-ASR#210); ``from_pretrained``
loads it with at most a warning, the ``Trainer`` accepts it, training runs, and the first checkpoint save raises
``ValueError: GenerationConfig is invalid`` (after 5 steps in the reproduction; in a real run the first
``save_steps`` boundary, hours in; with ``save_strategy="no"`` the final ``save_model``, after all the training).
transformers PR #29675 added an early check for ``Seq2SeqTrainer``'s ``generation_config`` argument only; the plain
``Trainer`` and TRL's trainers never check the model's own. Reproduced on 4.57.6 and 5.25.0 (dossier-wave5 lead 16;
earlier reports of the crash: huggingface/transformers#29988, hiyouga/LlamaFactory#2767).

The guard: wrap ``Trainer.train``. Before anything trains, when the model the ``Trainer`` will save is a
``PreTrainedModel`` that can generate, its generation config is saved into a temporary directory, the very call
each checkpoint will make; if that raises, ``train()`` raises now (:class:`InvalidGenerationConfig`, a
``ValueError``) with transformers' own reason and the fix (set ``do_sample=True``, or reset the sampling flags
greedy decoding ignores). A valid config, a ``PeftModel`` (its adapter save writes no generation config) and
models that cannot generate go to the original unchanged; nothing of the model is modified.

Applies to transformers >= 4.37.0 (4.37.2 read: raises; 4.36.2 read: warns and skips the file; 4.37.0 and 4.37.1
not read), unfixed in 5.25.0. 4.37-4.46 raise from the warnings ``validate()`` emits, as their save records them:
a process whose filters ignore UserWarning saves there, and the check (the same save, the process's filters kept)
then finds nothing and stays out; 4.52 and later raise from ``validate(strict=True)`` whatever the filters. Fallback: a changed ``train`` signature skips the shim (target check).
"""

from __future__ import annotations

import contextlib
import logging

from .._util import acted, warn_once
from ..spec import Observation, ShimSpec, Target

log = logging.getLogger("ftshims")
_WARNED: set = set()

SPEC = ShimSpec(
    id="trainer_invalid_generation_config_crash_at_first_save",
    since="0.3.0",
    title="Trainer trains a model with an invalid generation config, then every checkpoint save raises",
    symptom="a model whose generation_config has sampling flags with do_sample=False (as some hub checkpoints ship) "
    "trains normally; the first checkpoint save (or the final save_model) raises ValueError: GenerationConfig is invalid",
    why="save_pretrained validates the generation config strictly and raises; nothing checks it before training. "
    "The guard makes the same check when train() starts and raises there, with the fix.",
    requires={"transformers": ">=4.37.0"},
    fixed_in={},
    effect="guards",
    refs=(
        "https://github.com/huggingface/transformers/pull/29675",
        "https://github.com/huggingface/transformers/issues/29988",
        "https://github.com/QwenLM/Qwen3-ASR/issues/210",
    ),
    targets=(Target("transformers.trainer", "Trainer.train", params=("resume_from_checkpoint",)),),
    modules=("transformers.trainer",),
)


class InvalidGenerationConfig(ValueError):
    """Raised by ``Trainer.train()`` under ftshims when every save of the model would raise."""


def saved_model(trainer):
    """The ``PreTrainedModel`` whose ``save_pretrained`` the Trainer's saves call (with a generation config), or None."""
    import sys

    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    model = getattr(trainer, "model", None)
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    if unwrap is not None and model is not None and not isinstance(model, pretrained or ()):
        model = unwrap(model)
    if pretrained is None or not isinstance(model, pretrained):
        return None  # a PeftModel saves its adapter (no generation config), a plain module its state dict
    can_generate = getattr(model, "can_generate", None)
    if getattr(model, "generation_config", None) is None or not callable(can_generate) or not can_generate():
        return None
    return model


def problem(model):
    """transformers' own error for saving ``model.generation_config``, or None when it saves."""
    import copy
    import tempfile
    import warnings

    try:
        config = copy.deepcopy(model.generation_config)
        # record=True, the process's own filters kept: 4.37-4.46 raise from the warnings validate() emits that their
        # save records (the filters decide whether it sees them: a process ignoring UserWarning saves), 4.52+ from
        # validate(strict=True) whatever the filters. Recorded warnings are not shown: the check stays silent.
        with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings(record=True):
            try:
                config.save_pretrained(scratch)
            except ValueError as exc:  # what the checkpoint save raises
                return exc
    except Exception:  # the check itself could not run (a config that does not copy, no temporary directory):
        return None  # it cannot tell, so it stays out; the save will say what it says
    return None


def saves_checkpoints(trainer) -> bool:
    """Whether ``train()`` itself will save checkpoints (``save_strategy`` other than ``"no"``)."""
    strategy = getattr(getattr(trainer, "args", None), "save_strategy", None)
    return str(getattr(strategy, "value", strategy)) != "no"


def _train(wrapped, instance, args, kwargs):
    model = saved_model(instance)
    error = problem(model) if model is not None else None
    if error is not None and not saves_checkpoints(instance):
        acted(SPEC.id, "trainings without checkpoint saves let through")
        warn_once(_WARNED, type(model).__name__, lambda: log.warning(
            "ftshims: %s.generation_config is invalid: this run saves no checkpoint (save_strategy='no') and trains "
            "unchanged, but a later save_model()/save_pretrained() will raise: %s", type(model).__name__,
            " ".join(str(error).split())[:300]))
        return wrapped(*args, **kwargs)
    if error is not None:
        acted(SPEC.id, "trainings refused")
        reason = " ".join(str(error).split())
        raise InvalidGenerationConfig(
            f"ftshims: {type(model).__name__}.generation_config is invalid, so every checkpoint save (and the final "
            f"save_model) would raise after training has run: {reason[:400]}. Fix it before training, e.g. "
            f"model.generation_config.do_sample = True, or reset the sampling flags that greedy decoding ignores "
            f"(model.generation_config.temperature = None, top_p = None, top_k = None); "
            f"ftshims.apply(exclude=['{SPEC.id}']) turns this check off."
        ) from error
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    patcher.wrap_method("transformers.trainer", "Trainer.train", _train)


# ---------------------------------------------------------------------------
# Reproduction


@contextlib.contextmanager
def user_warnings_default():
    """UserWarning under Python's default filter, as in a user's process (inside ``tiny.quiet()``, which ignores
    every warning: there 4.37-4.46's save would not see validate()'s warnings and would not raise)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("default", category=UserWarning)
        yield


def probe(invalid: bool = True) -> Observation:
    """A tiny Llama whose generation config has ``temperature`` 1e-6 with ``do_sample=False`` (``invalid``), a
    Trainer saving at step 5 of 6. The bug: training ran steps and then the save raised."""
    import tempfile

    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from .. import tiny

    model = tiny.tiny_llama()
    if invalid:
        model.generation_config.do_sample = False
        model.generation_config.temperature = 1e-6
    steps = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": r, "labels": r.clone()} for r in torch.randint(3, 128, (12, 8), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(out, per_device_train_batch_size=2, max_steps=6, save_steps=5, report_to=[],
                                 disable_tqdm=True, logging_strategy="no", **tiny.on_cpu())
        try:
            with tiny.quiet(), user_warnings_default():
                Trainer(model=model, args=args, train_dataset=rows, callbacks=[Steps()]).train()
        except InvalidGenerationConfig as exc:
            return Observation(bool(steps), f"invalid={invalid}: refused before training, after {len(steps)} steps: "
                                            f"{str(exc)[:120]}...")
        except ValueError as exc:
            return Observation(True, f"invalid={invalid}: {len(steps)} steps trained, then the save raised: "
                                     f"{' '.join(str(exc).split())[:110]}")
    return Observation(False, f"invalid={invalid}: {len(steps)} steps trained and saved")
