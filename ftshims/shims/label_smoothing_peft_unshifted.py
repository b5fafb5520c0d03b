"""``Trainer`` label smoothing scores a PEFT causal LM's logits against unshifted labels.

Why: with ``label_smoothing_factor > 0`` the Trainer pops the labels and computes the loss itself with its
``LabelSmoother``. Since 4.21 (PR #17987) it passes ``shift_labels=True`` only when a class name it reads is in
``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. For a PEFT model the name it reads is often not the causal LM's:

* 4.21-4.31 read ``unwrap_model(model)._get_name()``: "PeftModelForCausalLM", never shifted;
* 4.32-4.35 (PR #25044) read ``unwrap_model(model.base_model)._get_name()`` for a ``PeftModel``: the tuner
  ("LoraModel", "IA3Model", ...) for LoRA-style methods, not shifted; the causal LM itself for prompt-learning
  methods (their ``base_model`` is the transformer), shifted;
* 4.36.0 (PR #27162) and every later release read (5.24.0 included) read
  ``unwrapped_model.base_model.model._get_name()`` for a ``PeftModel``: the causal LM for LoRA-style methods
  (fixed), but for prompt-learning methods (prefix tuning) the headless backbone ("LlamaModel"), not shifted:
  a regression of the prompt-learning case, unfixed in every release read.

So the logits at position t are scored against the token at t: the adapter learns to copy the current token,
the loss falls fast, no warning, and the trained model generates repetition (transformers#27161, Qwen#834).

The fix, one predicate for every version: the model, unwrapped through ``.module`` like upstream's
``unwrap_model`` (and through ``torch.compile``'s ``_orig_mod``), is a peft ``PeftModel`` and the causal LM inside
it (``base_model`` for a prompt-learning config, ``base_model.model`` otherwise: the tuner, e.g. ``LoraModel`` or
``PolyModel``, holds it there) has a class name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Then the shim wraps
``Trainer.compute_loss`` and, when the trainer has a label smoother, no ``compute_loss_func`` (4.46+) and the
inputs carry ``labels``, marks that trainer's smoother in a thread-local for the duration of the call. A wrapper
on ``LabelSmoother.__call__`` then calls the marked smoother with ``shift_labels=True`` (other arguments, such as
5.x's ``num_items_in_batch``, pass unchanged), provided the logits have one position per label. Nothing on the
trainer is mutated, so other threads and other trainers see no change; nested calls save and restore the mark.
Forcing ``shift_labels=True`` where upstream already shifts (LoRA on 4.36+, prefix tuning on 4.32-4.35) gives the
same result, so the predicate need not mirror each version's lookup.

Applies to transformers >=4.21.0 with peft installed (without peft there is no PeftModel). Before 4.21 no
model's labels were shifted for the smoother at all (4.20.1 ``self.label_smoother(outputs, labels)``), a
different bug. Fallback, unchanged: non-PEFT models, PEFT models of other heads (sequence classification,
seq2seq: no registered causal LM inside), causal LMs whose class is not registered (remote code), no label
smoothing, a ``compute_loss_func``, a custom ``label_smoother`` that is not a ``LabelSmoother``, subclasses
that override ``compute_loss`` without calling it, and logits longer than the labels: prompt tuning and
p-tuning prepend virtual tokens to the sequence, so label smoothing fails there with a shape error, shifted
or not (a separate upstream limitation this shim leaves as it is).

Follow-ups: none. The backport is #27162 (LoRA-style adapters on 4.21-4.35); Trainer.compute_loss read in
4.36.0, 4.46.3, 4.57.6, 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: the name #27162 reads for a PeftModel
(base_model.model) is unchanged, and with it the prompt-learning case it broke, which this shim fixes too;
5.15 passes num_items_in_batch to the LabelSmoother, which the shim passes on unchanged.
"""

from __future__ import annotations

import sys
import threading

from .._util import acted
from ..spec import Observation, ShimSpec, Target, TargetMissing

SPEC = ShimSpec(
    id="label_smoothing_peft_unshifted",
    since="0.1.0",
    title="Trainer label smoothing on a PEFT causal LM scores logits against unshifted labels "
    "(LoRA fixed in 4.36; prefix tuning unfixed)",
    symptom="label_smoothing_factor>0 with a PEFT causal LM (LoRA-style on transformers <4.36; prefix tuning on "
    "<4.32 and on every release from 4.36): the smoothed loss compares the logits at position t with the token "
    "at t, so the adapter learns to copy the current token (fast-falling loss, repetitive generations), silently",
    why="transformers shift the labels for the label smoother only when a class name they read is a registered "
    "causal LM, and for a PEFT model they read the wrong one: the wrapper's or the tuner's before 4.36 (the "
    "LoRA-style case, fixed in 4.36 by PR #27162), and since 4.36 base_model.model, which for prompt-learning "
    "methods is the headless backbone (not fixed in any release read, 5.24.0 included). The shim makes the "
    "smoother shift the labels whenever the causal LM inside the PeftModel is registered.",
    requires={"transformers": ">=4.21.0", "peft": ">=0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/27161",
        "https://github.com/huggingface/transformers/pull/27162",
        "https://github.com/huggingface/transformers/pull/25044",
        "https://github.com/huggingface/transformers/pull/17987",
    ),
    backports=("https://github.com/huggingface/transformers/pull/27162",),
    follow_ups_checked="Trainer.compute_loss read in 4.36.0, 4.46.3, 4.57.6, 5.0.0, 5.9.0, 5.16.1, 5.24.0 and "
    "5.25.0: the name #27162 reads for a PeftModel (base_model.model) is unchanged, and with it the prompt-learning "
    "case it broke, which this shim fixes too; 5.15 passes num_items_in_batch to the LabelSmoother, which the shim "
    "passes on unchanged.",
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
    """Follow ``.module`` like transformers' ``unwrap_model`` (DDP, DeepSpeed engines), and a ``torch.compile``
    wrapper's ``_orig_mod`` like accelerate's ``unwrap_model`` (4.46+ use it)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded whenever torch.compile was used
    compiled_cls = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    for _ in range(16):  # bounded: a self-referencing .module must not hang training
        if hasattr(model, "module"):
            model = model.module
        elif compiled_cls is not None and isinstance(model, compiled_cls):
            model = model._orig_mod
        else:
            break
    return model


def _is_prompt_learning(config) -> bool | None:
    """peft 0.6.2, 0.7.1, 0.10.0, 0.13.2, 0.17.1 and 0.21.2 (read) expose ``PeftConfig.is_prompt_learning``;
    0.4.0 has only the ``PromptLearningConfig`` base class. None when neither tells."""
    flag = getattr(config, "is_prompt_learning", None)
    if isinstance(flag, bool):
        return flag
    prompt_cls = getattr(sys.modules.get("peft"), "PromptLearningConfig", None)
    if isinstance(prompt_cls, type):
        return isinstance(config, prompt_cls)
    return None


def is_peft_registered_causal_lm(model) -> bool:
    """True when ``model`` (unwrapped) is a ``PeftModel`` whose causal LM (``base_model`` for prompt-learning
    configs, ``base_model.model`` otherwise) has a class name in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported; never import it here
    peft_model_cls = getattr(peft, "PeftModel", None) if peft is not None else None
    if peft_model_cls is None:
        return False
    model = _unwrap(model)
    if not isinstance(model, peft_model_cls):
        return False
    try:
        config = model.active_peft_config
    except (AttributeError, KeyError, TypeError):  # no single active adapter config: cannot tell, pass through
        return False
    prompt_learning = _is_prompt_learning(config)
    if prompt_learning is None:
        return False
    inner = getattr(model, "base_model", None)
    if not prompt_learning:
        inner = getattr(inner, "model", None)
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
    if not has_labels or getattr(instance, "compute_loss_func", None) is not None:
        return wrapped(*args, **kwargs)  # 4.46+: a compute_loss_func takes the labels instead of the smoother
    if not is_peft_registered_causal_lm(model):
        return wrapped(*args, **kwargs)
    previous = getattr(_STATE, "smoother", None)
    _STATE.smoother = smoother
    try:
        return wrapped(*args, **kwargs)
    finally:
        _STATE.smoother = previous


def _one_logit_per_label(args, kwargs) -> bool:
    """The logits (read as ``LabelSmoother`` reads them) have one position per label. Prompt tuning and
    p-tuning prepend virtual tokens, so their logits are longer and no shift aligns them: pass through."""
    output = args[0] if args else kwargs.get("model_output")
    labels = args[1] if len(args) > 1 else kwargs.get("labels")
    try:
        logits = output["logits"] if isinstance(output, dict) else output[0]
        return tuple(logits.shape[:-1]) == tuple(labels.shape)
    except (AttributeError, IndexError, KeyError, TypeError):  # not tensors as expected: upstream decides
        return False


def _label_smoother_call(wrapped, instance, args, kwargs):
    if instance is None or getattr(_STATE, "smoother", None) is not instance:
        return wrapped(*args, **kwargs)
    if not _one_logit_per_label(args, kwargs):
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
    """``Trainer(label_smoothing_factor=0.1).compute_loss`` on a tiny Llama (multi-head attention: old peft
    builds prefix-tuning caches with one head per attention head and fails on grouped-query attention), as
    ``model``:

    * ``peft_causal``: LoRA ``PeftModelForCausalLM`` (the bug before 4.36);
    * ``wrapped_peft_causal``: the same inside a ``DataParallel`` container (4.36 unwraps it first too);
    * ``prefix_causal``: prefix tuning (``base_model`` is the causal LM itself): the bug before 4.32 and
      again from 4.36;
    * ``plain_causal``: the bare ``LlamaForCausalLM`` (shifted on every version: the healthy control).

    Bug: the loss differs (beyond 1e-5) from ``LabelSmoother(0.1)(outputs, labels, shift_labels=True)``.
    """
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny

    base = tiny.tiny_llama(num_key_value_heads=tiny.TINY_LLAMA["num_attention_heads"])
    if model == "plain_causal":
        inner = base
    elif model in ("peft_causal", "wrapped_peft_causal"):
        inner = tiny.lora(base)
    elif model == "prefix_causal":
        inner = prefix_tuned(base)
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


def prefix_tuned(model, num_virtual_tokens: int = 3):
    """Wrap ``model`` with prefix tuning (a prompt-learning method: no virtual tokens in the logits)."""
    from peft import PrefixTuningConfig, get_peft_model

    from .. import tiny

    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens)
    with tiny.quiet():
        return get_peft_model(model, config)


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
