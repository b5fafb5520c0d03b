"""LoRA gets no gradient under reentrant gradient checkpointing when input embeddings are frozen.

Why: with ``torch.utils.checkpoint(use_reentrant=True)`` a checkpointed block
only builds a graph for its parameters if one of its *inputs* requires grad.
In a PEFT model the embeddings are frozen, so the hidden states entering the
first block do not require grad; the LoRA weights inside the blocks then get no
gradient at all. Depending on the head, training either fails with
``element 0 of tensors does not require grad and does not have a grad_fn`` or
runs with every LoRA ``.grad`` left ``None`` (peft#742, transformers#26334,
#28335). transformers 4.38–4.57 pass ``use_reentrant=True`` explicitly (4.30–4.37
inherit torch's reentrant default); only models with PEFT loaded through
``add_adapter`` got the input-grad hook. ``Trainer`` calls
``gradient_checkpointing_enable()`` *after* the user's ``get_peft_model``, the
order that breaks. transformers 5.0 switched the default to
``use_reentrant=False`` and installs the hook itself (PR #43203).

What the popular story gets wrong: no transformers version flips parameters'
``requires_grad`` in ``gradient_checkpointing_enable`` (only module flags are
set). The shim still snapshots the flags across the call and restores any that
changed, so that guarantee holds whatever the model's own override does.

The fix: wrap ``PreTrainedModel.gradient_checkpointing_enable``. After the
original runs, if checkpointing may be reentrant (``use_reentrant`` not
explicitly ``False``) and the model has trainable parameters but frozen input
embeddings, call the model's own ``enable_input_require_grads()`` (a forward
hook that marks the embedding *output* as requiring grad; weights are never
touched). Models whose input embeddings cannot be determined are left alone.

Applies to transformers >=4.30,<5.0. Fallback: if the method is missing the
shim is skipped with a reason; nothing else is patched.
"""

from __future__ import annotations

import logging
import sys

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="lora_reentrant_checkpointing",
    since="0.1.0",
    title="LoRA gets no gradient under reentrant gradient checkpointing",
    symptom="`element 0 of tensors does not require grad` or all-None LoRA grads after gradient_checkpointing_enable()",
    why='Under reentrant gradient checkpointing a block builds a graph only if an input requires grad; with frozen embeddings the LoRA weights inside get no gradient (an error, or silently no training). The shim makes the checkpointed inputs require grad.',
    requires={"transformers": ">=4.30,<5.0"},
    fixed_in={"transformers": "5.0.0"},
    refs=(
        "https://github.com/huggingface/peft/issues/742",
        "https://github.com/huggingface/transformers/issues/26334",
        "https://github.com/huggingface/transformers/issues/28335",
        "https://github.com/huggingface/transformers/pull/43203",
    ),
    targets=(
        Target("transformers.modeling_utils", "PreTrainedModel.gradient_checkpointing_enable"),
        Target("transformers.modeling_utils", "PreTrainedModel.enable_input_require_grads"),
    ),
    modules=("transformers.modeling_utils",),
)

log = logging.getLogger("ftshims")


def _use_reentrant(args, kwargs) -> bool:
    """False only when the caller explicitly asked for non-reentrant checkpointing."""
    gc_kwargs = kwargs.get("gradient_checkpointing_kwargs", args[0] if args else None)
    if isinstance(gc_kwargs, dict) and "use_reentrant" in gc_kwargs:
        return bool(gc_kwargs["use_reentrant"])
    return True


def _needs_input_grads(model) -> bool:
    if getattr(model, "_require_grads_hook", None) is not None:
        return False  # the hook is already installed
    if not any(p.requires_grad for p in model.parameters()):
        return False  # nothing to train: leave inference setups alone
    try:
        embeddings = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return False
    if embeddings is None:
        return False
    return not any(p.requires_grad for p in embeddings.parameters())


def _gradient_checkpointing_enable(wrapped, instance, args, kwargs):
    model = instance
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    result = wrapped(*args, **kwargs)
    changed = [name for name, p in model.named_parameters() if name in flags and p.requires_grad != flags[name]]
    if changed:
        parameters = dict(model.named_parameters())
        for name in changed:
            parameters[name].requires_grad_(flags[name])
        acted(SPEC.id, "requires_grad flags restored", len(changed))
        log.warning("gradient_checkpointing_enable changed requires_grad of %d parameter(s); restored", len(changed))
    if _use_reentrant(args, kwargs) and _needs_input_grads(model):
        model.enable_input_require_grads()
        acted(SPEC.id, "input-grad hooks installed")
    return result


def install(patcher, options) -> None:
    modeling_utils = sys.modules["transformers.modeling_utils"]
    patcher.wrap(modeling_utils.PreTrainedModel, "gradient_checkpointing_enable", _gradient_checkpointing_enable)


def probe(order: str = "peft_first", use_reentrant=None, attn: str = "eager") -> Observation:
    """Tiny Llama + LoRA + checkpointing, one forward/backward: do all LoRA weights get a gradient?

    ``order="peft_first"`` is Trainer's order (``get_peft_model`` then
    ``gradient_checkpointing_enable``); ``"checkpointing_first"`` the reverse.
    ``use_reentrant=None`` leaves transformers' default.
    """
    from .. import tiny

    import inspect

    from transformers.modeling_utils import PreTrainedModel

    if use_reentrant is not None:
        params = inspect.signature(PreTrainedModel.gradient_checkpointing_enable).parameters
        if "gradient_checkpointing_kwargs" not in params:
            raise ProbeUnsupported("this transformers has no gradient_checkpointing_kwargs (use_reentrant not settable)")
    model = tiny.tiny_llama(attn=attn)
    gc_kwargs = {} if use_reentrant is None else {"gradient_checkpointing_kwargs": {"use_reentrant": use_reentrant}}
    with tiny.quiet():
        if order == "peft_first":
            model = tiny.lora(model)
            model.gradient_checkpointing_enable(**gc_kwargs)
        elif order == "checkpointing_first":
            model.gradient_checkpointing_enable(**gc_kwargs)
            model = tiny.lora(model)
        else:
            raise ValueError(f"order must be 'peft_first' or 'checkpointing_first', not {order!r}")
        model.train()
        loss = model(**tiny.batch()).loss
        try:
            loss.backward()
        except RuntimeError as exc:
            if "does not require grad" in str(exc):
                return Observation(True, f"backward failed: {exc}")
            raise
    lora = tiny.lora_parameters(model)
    # lora_B starts at zero, so lora_A's first gradient is zero: only None means "no gradient".
    without = sorted(name for name, p in lora.items() if p.grad is None)
    if without:
        return Observation(True, f"{len(without)} of {len(lora)} LoRA parameters got no gradient")
    return Observation(False, f"all {len(lora)} LoRA parameters got a gradient")
