"""``Trainer`` divides a PEFT prompt-tuned causal LM's summed loss by one label too few per row (transformers >=5.10.1).

Why: since transformers 5.10.1 (PR #46204) ``Trainer._get_num_items_in_batch`` counts ``labels[..., 1:]`` whenever
the model's ``loss_type`` maps to ``ForCausalLMLoss`` (``Trainer._loss_shifts_labels``, read from the base model of
a PeftModel): position 0 is never a target of a shifted causal loss. PEFT prompt tuning, p-tuning and multitask
prompt tuning break that premise: ``PeftModelForCausalLM.forward`` prepends ``num_virtual_tokens`` labels of -100 to
the batch's labels, so the shifted loss scores every label of the batch (the last virtual position predicts label
0). The Trainer then divides the summed loss by one label per row too few, and loss and gradients come out too
large by scored/(scored - rows): x1.143 on two 8-label rows (14 counted for 16 scored, 5.25.0); x1/(1 - 1/L) in
general, so short rows (classification-style prompts, short completions) are hit hardest. TRL's ``SFTTrainer`` uses
the same count. 4.57-5.10.0 count all labels (right for these methods; ftshims' ``num_items_in_batch_overcount``
leaves them so).

When: transformers >=5.10.1 with peft installed (unfixed in 5.25.0), for a trainer whose ``_loss_shifts_labels`` is
true and whose model's active adapter is prompt tuning, p-tuning or multitask prompt tuning (peft 0.4.0-0.21.2
prepend the ignored labels in that branch; prefix tuning and LoRA do not, and keep upstream's count). The shim wraps
``Trainer._get_num_items_in_batch`` and hands it shallow copies of the batches whose ``labels`` carry one extra
-100 column in front, so that its ``labels[..., 1:]`` are the labels the loss scores; the original still counts,
gathers across devices and divides for DataParallel as installed, and the batches used for training are not
modified. Batches with ``shift_labels`` (counted as given), without tensor labels, and every other model pass
through unchanged.
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from .num_items_in_batch_overcount import prepends_ignored_labels

SPEC = ShimSpec(
    id="peft_prompt_learning_num_items_undercount",
    since="0.3.0",
    title="Trainer counts labels[..., 1:] for PEFT prompt tuning / p-tuning, whose loss scores every label",
    symptom="prompt tuning / p-tuning / multitask prompt tuning under Trainer or TRL SFTTrainer on transformers "
    ">=5.10.1: loss and gradients too large by scored/(scored - rows) (x1.143 on two 8-label rows)",
    why="Since 5.10.1 the Trainer counts num_items_in_batch over labels[..., 1:] for causal LMs, but PEFT prompt "
    "learning prepends ignored labels for its virtual tokens, so the shifted loss scores every label. The shim "
    "makes the Trainer count all of them.",
    requires={"transformers": ">=5.10.1", "peft": ">=0.4.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/46204",
        "https://github.com/huggingface/transformers/pull/46903",
    ),
    targets=(Target("transformers.trainer", "Trainer._get_num_items_in_batch", params=("batch_samples", "device")),),
    modules=("transformers.trainer",),
)


def _counts_shifted(trainer) -> bool:
    return getattr(trainer, "_loss_shifts_labels", None) is True


def _with_leading_ignored_column(batch):
    """A shallow copy of ``batch`` whose labels start with one -100 column (``labels[..., 1:]`` of it are the batch's
    labels), or None when the batch has no tensor labels or brings its own ``shift_labels``."""
    import torch

    labels = batch.get("labels") if hasattr(batch, "get") else None
    if not torch.is_tensor(labels) or labels.dim() < 1 or "shift_labels" in batch:
        return None
    copy = dict(batch)
    copy["labels"] = torch.nn.functional.pad(labels, (1, 0), value=-100)
    return copy


def _get_num_items_in_batch(wrapped, instance, args, kwargs):
    batch_samples = args[0] if args else kwargs.get("batch_samples")
    if (not batch_samples or not isinstance(batch_samples, list) or not _counts_shifted(instance)
            or not prepends_ignored_labels(getattr(instance, "model", None))):
        return wrapped(*args, **kwargs)
    counted = [_with_leading_ignored_column(batch) for batch in batch_samples]
    if any(batch is None for batch in counted):
        return wrapped(*args, **kwargs)
    acted(SPEC.id, "prompt-learning batches counted over every label", len(counted))
    if args:
        return wrapped(counted, *args[1:], **kwargs)
    return wrapped(**dict(kwargs, batch_samples=counted))


def install(patcher, options) -> None:
    trainer = sys.modules["transformers.trainer"]
    patcher.wrap(trainer.Trainer, "_get_num_items_in_batch", _get_num_items_in_batch)


# ---------------------------------------------------------------------------
# Reproduction

def prompt_model(method: str = "prompt_tuning"):
    """A tiny Llama under PEFT ``method`` (prompt_tuning, p_tuning, prefix_tuning or lora), dropout off."""
    import peft

    from .. import tiny

    configs = {
        "prompt_tuning": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "p_tuning": lambda: peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4,
                                                     encoder_hidden_size=16),
        "prefix_tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "lora": lambda: peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj", "v_proj"]),
    }
    with tiny.quiet():
        return peft.get_peft_model(tiny.tiny_llama(), configs[method]()).eval()


def batch():
    import torch

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def probe(method: str = "prompt_tuning") -> Observation:
    """Trainer on a tiny prompt-tuned Llama: does ``compute_loss`` with the Trainer's own ``num_items_in_batch``
    equal the model's own mean loss (which scores every label)?"""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny
    from .num_items_in_batch_overcount import _training_args

    if not hasattr(Trainer, "_get_num_items_in_batch"):
        raise ProbeUnsupported("this Trainer has no _get_num_items_in_batch (before 4.57)")
    model = prompt_model(method)
    inputs = batch()
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        trainer = Trainer(model=model, args=_training_args(TrainingArguments, out))
        num = trainer._get_num_items_in_batch([inputs], torch.device("cpu"))
        with torch.no_grad():
            loss = float(trainer.compute_loss(model, dict(inputs), num_items_in_batch=num))
            mean = float(model(**inputs).loss)
            summed = float(model(**inputs, num_items_in_batch=torch.tensor(1)).loss)
    scored = round(summed / mean)
    detail = (f"{method}: num_items_in_batch={int(num)} for {scored} labels the loss scores; Trainer loss {loss:.5f} "
              f"vs the model's mean {mean:.5f} (x{loss / mean:.3f})")
    return Observation(int(num) != scored or abs(loss - mean) > 1e-5 * max(1.0, abs(mean)), detail)
