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
touched). The same for every PreTrainedModel inside it whose input embeddings
are another module and which trains behind them, as 5.0.0 hooks them all: BART's
encoder and decoder (each embeds with its own module sharing the weight of
``shared``, which ``get_input_embeddings()`` returns and no forward calls), a
VLM's vision tower. Models whose input embeddings cannot be determined are left
alone.

Applies to transformers >=4.30,<5.0. Fallback: if the method is missing the
shim is skipped with a reason; nothing else is patched.

Follow-ups: #42558 (5.0: a sub-model whose get_input_embeddings is not
implemented is skipped instead of raising, a regression of #41993) — carried.
https://github.com/modelscope/ms-swift/pull/10214 (5.2: the hooks #41993 puts on
every sub-model make a fully frozen vision tower keep its autograd graph) — carried:
a sub-model is hooked only when it has trainable parameters. Until ftshims 0.2.0
this shim carried #43203 without #41993: it hooked only ``get_input_embeddings()``,
so LoRA in BART (and the other encoder-decoders that embed with their own modules)
still failed with "does not require grad", and LoRA in a LLaVA vision tower got no
gradient, silently, while the text LoRA trained. gradient_checkpointing_enable and
enable_input_require_grads read in 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: later
changes are every_n_layers (5.16) and the rename to activation_checkpointing_enable
(5.24), neither at the fix.
"""

from __future__ import annotations

import logging
import sys

from .._util import acted
from ..spec import FollowUp, Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="lora_reentrant_checkpointing",
    since="0.2.0",
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
        "https://github.com/huggingface/transformers/pull/41993",
        "https://github.com/huggingface/transformers/pull/42558",
        "https://github.com/modelscope/ms-swift/pull/10214",
    ),
    backports=(
        "https://github.com/huggingface/transformers/pull/43203",
        "https://github.com/huggingface/transformers/pull/41993",
    ),
    follow_ups=(
        FollowUp("https://github.com/huggingface/transformers/pull/42558", "5.0: a sub-model whose "
                 "get_input_embeddings is not implemented is skipped instead of raising, a regression of #41993",
                 carried=True),
        FollowUp("https://github.com/modelscope/ms-swift/pull/10214", "5.2: the hooks #41993 puts on every "
                 "sub-model make a fully frozen vision tower keep its autograd graph", carried=True),
    ),
    follow_ups_checked="gradient_checkpointing_enable and enable_input_require_grads read in 5.0.0, 5.9.0, 5.16.1, "
    "5.24.0 and 5.25.0: later changes are every_n_layers (5.16) and the rename to activation_checkpointing_enable "
    "(5.24), neither at the fix.",
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


def _input_embeddings(model):
    """``model.get_input_embeddings()``, or None when the model has none it can name."""
    try:
        return model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None  # e.g. a vision sub-model without the getter: skipped, as 5.0 does (#42558)


def _needs_input_grads(model) -> bool:
    if getattr(model, "_require_grads_hook", None) is not None:
        return False  # the hook is already installed
    if not any(p.requires_grad for p in model.parameters()):
        return False  # nothing to train: leave inference setups (and frozen towers, ms-swift#10214) alone
    embeddings = _input_embeddings(model)
    if embeddings is None:
        return False
    return not any(p.requires_grad for p in embeddings.parameters())


def _models_to_hook(model, pretrained_model):
    """The model, then every PreTrainedModel inside it whose input embeddings are another module (BART's encoder and
    decoder each embed with their own module sharing the weight; a VLM's vision tower has its own), as 5.0.0's
    enable_input_require_grads hooks them (#41993); each only when it trains behind frozen embeddings."""
    seen = set()
    for sub in [model] + [m for m in model.modules() if m is not model and isinstance(m, pretrained_model)]:
        embeddings = _input_embeddings(sub)
        if embeddings is None or id(embeddings) in seen:
            continue
        seen.add(id(embeddings))
        if _needs_input_grads(sub):
            yield sub


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
    if _use_reentrant(args, kwargs):
        pretrained_model = sys.modules["transformers.modeling_utils"].PreTrainedModel
        for sub in list(_models_to_hook(model, pretrained_model)):
            sub.enable_input_require_grads()  # the installed version's own hook (a forward hook; weights untouched)
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
