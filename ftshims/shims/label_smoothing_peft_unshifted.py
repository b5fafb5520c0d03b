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
that override ``compute_loss`` without calling it, and logits whose length matches neither the labels nor the
labels plus the adapter's virtual tokens.

Prompt tuning, p-tuning and multitask prompt tuning (since ftshims 0.2.0): these methods prepend
``num_virtual_tokens`` prompt embeddings to the sequence, so the logits the Trainer hands its smoother are longer
than the labels and upstream's smoother fails with a shape error on every version (``masked_fill_``: "The size of
tensor a (T + V) must match the size of tensor b (T)"), shifted or not. PEFT's own loss
(``PeftModelForCausalLM.forward``, peft 0.4.0-0.21.2) prepends ``num_virtual_tokens`` labels of -100 and lets the
causal LM shift: the last virtual position predicts the first label, position ``V + t - 1`` the label ``t``. The
shim does the same for the smoother: when the logits are exactly ``num_virtual_tokens`` longer than the labels,
it prepends that many ignored labels (``LabelSmoother.ignore_index``) and shifts, so the smoothed loss scores
the logits that belong to the labels, the same pairs as PEFT's own loss (its NLL part equals PEFT's loss).
Other prompt-learning methods (CPT, with its own prefix labels and loss) pass through.

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
    since="0.2.0",
    title="Trainer label smoothing on a PEFT causal LM scores logits against unshifted labels "
    "(LoRA fixed in 4.36; prefix tuning unfixed)",
    symptom="label_smoothing_factor>0 with a PEFT causal LM (LoRA-style on transformers <4.36; prefix tuning on "
    "<4.32 and on every release from 4.36): the smoothed loss compares the logits at position t with the token "
    "at t, so the adapter learns to copy the current token (fast-falling loss, repetitive generations), silently; "
    "prompt tuning / p-tuning: the smoother fails with a shape error on every version",
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


# peft types whose PeftModelForCausalLM.forward prepends num_virtual_tokens prompt embeddings to the sequence and
# pads the labels with as many -100 (peft 0.4.0, 0.7.1, 0.13.2, 0.17.1, 0.21.2: the else-branch after prefix
# tuning / CPT): their logits carry those positions.
PREPENDING = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING")


def virtual_tokens(model) -> int:
    """How many prompt positions ``model`` (a PeftModel, unwrapped) prepends to its logits: its active config's
    ``num_virtual_tokens`` for the ``PREPENDING`` methods, else 0 (also when it cannot tell)."""
    try:
        config = _unwrap(model).active_peft_config
    except (AttributeError, KeyError, TypeError):
        return 0
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    count = getattr(config, "num_virtual_tokens", None)
    if str(kind) not in PREPENDING or not isinstance(count, int) or count <= 0:
        return 0
    return count


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
    previous = getattr(_STATE, "smoother", None), getattr(_STATE, "prefix", 0)
    _STATE.smoother, _STATE.prefix = smoother, virtual_tokens(model)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _STATE.smoother, _STATE.prefix = previous


def _extra_positions(args, kwargs):
    """How many more positions the logits (read as ``LabelSmoother`` reads them) have than the labels: 0 for one
    per label, the virtual-token count for prompt tuning; None when they are not tensors of matching batch shape."""
    output = args[0] if args else kwargs.get("model_output")
    labels = args[1] if len(args) > 1 else kwargs.get("labels")
    try:
        logits = output["logits"] if isinstance(output, dict) else output[0]
        if logits.dim() != labels.dim() + 1 or tuple(logits.shape[:-2]) != tuple(labels.shape[:-1]):
            return None
        return int(logits.shape[-2]) - int(labels.shape[-1])
    except (AttributeError, IndexError, KeyError, TypeError):  # not tensors as expected: upstream decides
        return None


def _label_smoother_call(wrapped, instance, args, kwargs):
    if instance is None or getattr(_STATE, "smoother", None) is not instance:
        return wrapped(*args, **kwargs)
    extra = _extra_positions(args, kwargs)
    prefix = getattr(_STATE, "prefix", 0)
    if extra == prefix and prefix > 0:
        # PEFT's own loss: as many ignored labels as virtual tokens in front, then the causal shift
        import torch

        labels = args[1] if len(args) > 1 else kwargs["labels"]
        ignored = labels.new_full((*labels.shape[:-1], prefix), getattr(instance, "ignore_index", -100))
        labels = torch.cat((ignored, labels), dim=-1)
        if len(args) > 1:
            args = (args[0], labels) + tuple(args[2:])
        else:
            kwargs = dict(kwargs, labels=labels)
        action = "label-smoothed losses computed past the virtual-token prefix, on shifted labels"
    elif extra == 0:
        action = "label-smoothed losses computed on shifted labels"
    else:
        return wrapped(*args, **kwargs)
    # (model_output, labels, shift_labels=False): set shift_labels=True wherever it was passed
    if len(args) >= 3:
        args = tuple(args[:2]) + (True,) + tuple(args[3:])
    else:
        kwargs = dict(kwargs, shift_labels=True)
    acted(SPEC.id, action)
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
    * ``plain_causal``: the bare ``LlamaForCausalLM`` (shifted on every version: the healthy control);
    * ``prompt_causal`` / ``ptuning_causal``: prompt tuning / p-tuning (3 virtual tokens prepended to the
      sequence): upstream's smoother fails with a shape error on every version.

    Bug: ``compute_loss`` raises, or the loss differs (beyond 1e-5) from
    ``LabelSmoother(0.1)(outputs, labels, shift_labels=True)`` (with the labels behind as many ignored labels as
    the adapter prepends virtual tokens, as PEFT's own loss puts them).
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
    elif model in ("prompt_causal", "ptuning_causal"):
        inner = prompt_tuned(base, "P_TUNING" if model == "ptuning_causal" else "PROMPT_TUNING")
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
            outputs = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            own = net(**batch).loss  # PEFT's / the model's own (unsmoothed) loss
            try:
                loss = float(trainer.compute_loss(net, dict(batch)))
            except RuntimeError as exc:  # prompt tuning: the logits carry the virtual tokens, the labels do not
                loss, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    prefix = virtual_tokens(inner)
    shifted, unshifted = reference_losses(outputs.logits, batch["labels"], prefix)
    nll, _ = reference_losses(outputs.logits, batch["labels"], prefix, epsilon=0.0)
    where = f" ({prefix} virtual tokens; NLL part {nll:.6f}, the model's own loss {float(own):.6f})" if prefix else ""
    reference = f"smoothed loss on shifted labels {shifted:.6f}, on unshifted labels {unshifted:.6f}{where}"
    if loss is None:
        return Observation(True, f"{model}: compute_loss raised {error}; {reference}")
    return Observation(abs(loss - shifted) > 1e-5, f"{model}: compute_loss {loss:.6f}; {reference}")


def prefix_tuned(model, num_virtual_tokens: int = 3):
    """Wrap ``model`` with prefix tuning (a prompt-learning method: no virtual tokens in the logits)."""
    from peft import PrefixTuningConfig, get_peft_model

    from .. import tiny

    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens)
    with tiny.quiet():
        return get_peft_model(model, config)


def prompt_tuned(model, peft_type: str = "PROMPT_TUNING", num_virtual_tokens: int = 3):
    """Wrap ``model`` with prompt tuning or p-tuning (``num_virtual_tokens`` embeddings prepended to the sequence)."""
    from peft import PromptEncoderConfig, PromptTuningConfig, get_peft_model

    from .. import tiny

    config_class = PromptEncoderConfig if peft_type == "P_TUNING" else PromptTuningConfig
    extra = {"encoder_hidden_size": 32} if peft_type == "P_TUNING" else {}
    config = config_class(task_type="CAUSAL_LM", num_virtual_tokens=num_virtual_tokens, **extra)
    with tiny.quiet():
        return get_peft_model(model, config)


def reference_losses(logits, labels, prefix: int = 0, epsilon: float = EPSILON):
    """The label-smoothed loss (``epsilon``) on shifted and on unshifted labels, by the formula; ``prefix`` ignored
    labels (-100) go in front first, as PEFT's prompt tuning pads them for its virtual tokens."""
    import torch

    if prefix:
        labels = torch.cat((labels.new_full((*labels.shape[:-1], prefix), -100), labels), dim=-1)

    def smoothed(lg, lb):
        log_probs = -torch.nn.functional.log_softmax(lg.float(), dim=-1)
        mask = lb.eq(-100)
        lb = lb.clamp(min=0).unsqueeze(-1)
        nll = log_probs.gather(-1, lb).squeeze(-1).masked_fill(mask, 0.0)
        smooth = log_probs.sum(-1).masked_fill(mask, 0.0)
        active = (~mask).sum()
        return float((1 - epsilon) * nll.sum() / active + epsilon * smooth.sum() / (active * lg.shape[-1]))

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
