"""``Trainer`` label smoothing scores a PEFT causal LM's logits against unshifted labels.

Why: with ``label_smoothing_factor > 0`` the Trainer pops the labels and computes the loss itself with its
``LabelSmoother``. Since 4.21 (PR #17987) it passes ``shift_labels=True`` only when the model's class name is in
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. For a PEFT model the name it reads is not the causal LM's: 4.21-4.31 read
``unwrap_model(model)._get_name()`` ("PeftModelForCausalLM"), 4.32-4.35 read
``unwrap_model(model.base_model)._get_name()`` for a ``PeftModel`` (the tuner: "LoraModel", "IA3Model", ...).
So the logits at position t are scored against the token at t: the adapter learns to copy the current token,
the loss falls fast, no warning, and the trained model generates repetition (transformers#27161, Qwen#834).
4.36.0 (PR #27162) reads ``unwrap_model(model).base_model.model._get_name()`` for a ``PeftModel``.

The fix: wrap ``Trainer.compute_loss`` and, exactly in the case 4.36 fixed (the trainer has a label smoother,
the inputs carry ``labels``, the model unwrapped through ``.module`` like upstream's ``unwrap_model`` is a peft
``PeftModel`` and the class name of its ``base_model.model`` is in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
mark that trainer's smoother in a thread-local for the duration of the call. A wrapper on
``LabelSmoother.__call__`` then calls the marked smoother with ``shift_labels=True``. Nothing on the trainer is
mutated, so other threads and other trainers see no change; nested calls save and restore the mark.
Forcing ``shift_labels=True`` is idempotent: where upstream already shifts, the result is the same.

Applies to transformers >=4.21.0,<4.36.0 with peft installed (without peft there is no PeftModel). Before 4.21
no model's labels were shifted for the smoother at all (4.20.1 ``self.label_smoother(outputs, labels)``), a
different bug. Fallback, unchanged: non-PEFT models, PEFT models of other heads (sequence classification,
seq2seq: ``base_model.model`` not a registered causal LM), prompt-learning PEFT models (their ``base_model`` is
the transformer itself, so ``base_model.model`` is the headless backbone; 4.36+ does not shift them either),
causal LMs whose class is not registered (remote code), no label smoothing, a custom ``label_smoother`` that
is not a ``LabelSmoother``, and subclasses that override ``compute_loss`` without calling it.
"""

from __future__ import annotations

import sys
import threading

from .._util import acted
from ..spec import Observation, ShimSpec, Target, TargetMissing

SPEC = ShimSpec(
    id="label_smoothing_peft_unshifted",
    title="Trainer label smoothing on a PEFT causal LM scores logits against unshifted labels",
    symptom="label_smoothing_factor>0 with a LoRA (PEFT) causal LM: the smoothed loss compares the logits at "
    "position t with the token at t, so the adapter learns to copy the current token (fast-falling loss, "
    "repetitive generations), silently",
    why="transformers 4.21-4.35 shift the labels for the label smoother only when the model's class name is a "
    "registered causal LM, and for a PEFT model they read the wrapper's or the tuner's name instead. The shim "
    "makes the smoother shift the labels for a PEFT-wrapped registered causal LM, as 4.36 does.",
    requires={"transformers": ">=4.21.0,<4.36.0", "peft": ">=0"},
    fixed_in={"transformers": "4.36.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/27161",
        "https://github.com/huggingface/transformers/pull/27162",
        "https://github.com/huggingface/transformers/pull/25044",
        "https://github.com/huggingface/transformers/pull/17987",
    ),
    targets=(
        Target("transformers.trainer", "Trainer.compute_loss", params=("model", "inputs")),
        Target("transformers.trainer_pt_utils", "LabelSmoother.__call__",
               params=("model_output", "labels", "shift_labels")),
    ),
    modules=("transformers.trainer", "transformers.trainer_pt_utils"),
)

# The smoother that must shift, per thread: set by the compute_loss wrapper for the length of one call.
_STATE = threading.local()


def _unwrap(model):
    """Follow ``.module`` like transformers' ``unwrap_model`` (DDP, DeepSpeed engines)."""
    seen = 0
    while hasattr(model, "module") and seen < 16:  # bounded: a self-referencing .module must not hang training
        model = model.module
        seen += 1
    return model


def is_peft_registered_causal_lm(model) -> bool:
    """True when ``model`` (unwrapped) is a ``PeftModel`` whose ``base_model.model`` is a registered causal LM:
    the model 4.36's ``compute_loss`` shifts and 4.21-4.35's does not."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported; never import it here
    peft_model_cls = getattr(peft, "PeftModel", None) if peft is not None else None
    if peft_model_cls is None:
        return False
    model = _unwrap(model)
    if not isinstance(model, peft_model_cls):
        return False
    inner = getattr(getattr(model, "base_model", None), "model", None)
    get_name = getattr(inner, "_get_name", None)
    if not callable(get_name):
        return False
    names = getattr(sys.modules.get("transformers.trainer"), "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", None)
    if names is None:
        return False
    return get_name() in names.values()


def _compute_loss(wrapped, instance, args, kwargs):
    smoother = getattr(instance, "label_smoother", None)
    if smoother is None:
        return wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    try:
        has_labels = "labels" in inputs
    except TypeError:  # inputs that are not a mapping: upstream decides (and raises) as before
        has_labels = False
    if not has_labels or not is_peft_registered_causal_lm(model):
        return wrapped(*args, **kwargs)
    previous = getattr(_STATE, "smoother", None)
    _STATE.smoother = smoother
    try:
        return wrapped(*args, **kwargs)
    finally:
        _STATE.smoother = previous


def _label_smoother_call(wrapped, instance, args, kwargs):
    if instance is None or getattr(_STATE, "smoother", None) is not instance:
        return wrapped(*args, **kwargs)
    # (model_output, labels, shift_labels=False): set shift_labels=True wherever it was passed
    if len(args) >= 3:
        args = tuple(args[:2]) + (True,) + tuple(args[3:])
    else:
        kwargs = dict(kwargs, shift_labels=True)
    acted(SPEC.id, "label-smoothed losses computed on shifted labels")
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    import inspect

    trainer = sys.modules["transformers.trainer"]
    pt_utils = sys.modules["transformers.trainer_pt_utils"]
    smoother_cls = getattr(pt_utils, "LabelSmoother", None)
    if smoother_cls is None or "__call__" not in vars(smoother_cls):
        raise TargetMissing("transformers.trainer_pt_utils.LabelSmoother.__call__ is missing")
    if "shift_labels" not in inspect.signature(smoother_cls.__call__).parameters:
        raise TargetMissing("LabelSmoother.__call__ takes no shift_labels")
    if not hasattr(trainer, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        raise TargetMissing("transformers.trainer has no MODEL_FOR_CAUSAL_LM_MAPPING_NAMES to compare with")
    if getattr(trainer, "LabelSmoother", smoother_cls) is not smoother_cls:
        raise TargetMissing("transformers.trainer.LabelSmoother is not trainer_pt_utils.LabelSmoother")
    patcher.wrap(smoother_cls, "__call__", _label_smoother_call)
    patcher.wrap(trainer.Trainer, "compute_loss", _compute_loss)


# ---------------------------------------------------------------------------
# Reproduction

EPSILON = 0.1


def _data_parallel(inner):
    """A real distributed container that runs on CPU: ``DataParallel`` without devices calls ``.module``
    directly. (A home-made ``.module`` class would not do: 4.46+ unwrap only the containers accelerate knows.)"""
    import torch

    return torch.nn.DataParallel(inner)


def probe(model: str = "peft_causal") -> Observation:
    """``Trainer(label_smoothing_factor=0.1).compute_loss`` on a tiny Llama, as ``model``:

    * ``peft_causal``: LoRA ``PeftModelForCausalLM`` (the bug);
    * ``wrapped_peft_causal``: the same inside a ``DataParallel`` container (4.36 unwraps it first too);
    * ``plain_causal``: the bare ``LlamaForCausalLM`` (shifted on every version: the healthy control).

    Bug: the loss differs (beyond 1e-5) from ``LabelSmoother(0.1)(outputs, labels, shift_labels=True)``.
    """
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny

    base = tiny.tiny_llama()
    if model == "plain_causal":
        inner = base
    elif model in ("peft_causal", "wrapped_peft_causal"):
        inner = tiny.lora(base)
    else:
        raise ValueError(f"unknown model scenario {model!r}")
    inner.eval()
    # what compute_loss receives: the model itself, or (like Trainer.model_wrapped under DDP/DP) its container
    net = _data_parallel(inner) if model == "wrapped_peft_causal" else inner
    batch = tiny.batch()
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        args = training_args(TrainingArguments, out, label_smoothing_factor=EPSILON)
        trainer = Trainer(model=inner, args=args)
        with torch.no_grad():
            loss = float(trainer.compute_loss(net, dict(batch)))
            outputs = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    shifted, unshifted = reference_losses(outputs.logits, batch["labels"])
    detail = (f"{model}: compute_loss {loss:.6f}; smoothed loss on shifted labels {shifted:.6f}, "
              f"on unshifted labels {unshifted:.6f}")
    return Observation(abs(loss - shifted) > 1e-5, detail)


def reference_losses(logits, labels):
    """The label-smoothed loss (epsilon 0.1) on shifted and on unshifted labels, by the formula."""
    import torch

    def smoothed(lg, lb):
        log_probs = -torch.nn.functional.log_softmax(lg.float(), dim=-1)
        mask = lb.eq(-100)
        lb = lb.clamp(min=0).unsqueeze(-1)
        nll = log_probs.gather(-1, lb).squeeze(-1).masked_fill(mask, 0.0)
        smooth = log_probs.sum(-1).masked_fill(mask, 0.0)
        active = (~mask).sum()
        return float((1 - EPSILON) * nll.sum() / active + EPSILON * smooth.sum() / (active * lg.shape[-1]))

    return smoothed(logits[..., :-1, :], labels[..., 1:]), smoothed(logits, labels)


def training_args(TrainingArguments, out, **extra):
    import inspect

    params = inspect.signature(TrainingArguments.__init__).parameters
    kwargs = dict(output_dir=out, report_to=[], per_device_train_batch_size=2, **extra)
    if "use_cpu" in params:
        kwargs["use_cpu"] = True
    elif "no_cuda" in params:
        kwargs["no_cuda"] = True
    return TrainingArguments(**kwargs)
