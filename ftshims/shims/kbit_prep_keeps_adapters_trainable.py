"""``prepare_model_for_kbit_training`` given a model with adapters freezes the adapters too.

Why: PEFT's ``prepare_model_for_kbit_training`` starts by setting
``requires_grad = False`` on *every* parameter; it is meant to run on the bare
quantized model, before ``get_peft_model``. Called on a ``PeftModel`` (or a
model with adapters loaded through transformers' ``add_adapter``), it freezes
the LoRA weights as well and training silently updates nothing. Users hit it
directly, and TRL 0.20.0–0.23.0 ``SFTTrainer`` does it for them whenever it is
handed a quantized ``PeftModel`` without a ``peft_config`` (trl#3926, fixed in
TRL 0.23.1/0.24.0 by PR #4081). PEFT documents the freezing (peft#2299, PR #2305)
but has not changed it (0.21.2 is the newest release as of this shim).

The fix: wrap ``peft.utils.other.prepare_model_for_kbit_training`` and every
alias of it (``peft``, ``peft.utils``, ``trl.models.utils`` and any other module
that did ``from peft import prepare_model_for_kbit_training``). When the model
already carries adapters, the parameters that were trainable before the call
are made trainable again after it, with a warning that says to prepare the
model before adding adapters. The rest of the preparation (fp32 casts, input
grads, checkpointing) is left as upstream does it.

Applies to peft >=0.4 (every release that has the function; no fixed release
yet). Fallback: if the function is missing the shim is skipped.
"""

from __future__ import annotations

import logging
import sys

from .._util import acted
from ..spec import Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="kbit_prep_keeps_adapters_trainable",
    since="0.1.0",
    title="prepare_model_for_kbit_training freezes LoRA adapters of a PeftModel",
    symptom="0 trainable parameters after prepare_model_for_kbit_training(peft_model) or SFTTrainer(quantized PeftModel)",
    why="peft's prepare_model_for_kbit_training freezes every parameter; called on a PeftModel (as TRL 0.20-0.23.0 SFTTrainer does for a quantized PeftModel), it freezes the LoRA weights too and training updates nothing. The shim restores the adapters' requires_grad.",
    requires={"peft": ">=0.4"},
    fixed_in={},  # unfixed in peft; TRL stopped reaching it in 0.23.1 (PR #4081)
    refs=(
        "https://github.com/huggingface/trl/issues/3926",
        "https://github.com/huggingface/trl/pull/4081",
        "https://github.com/huggingface/peft/issues/2299",
        "https://github.com/huggingface/transformers/issues/26098",
    ),
    targets=(Target("peft.utils.other", "prepare_model_for_kbit_training", params=("model",)),),
    modules=("peft.utils.other",),
)

log = logging.getLogger("ftshims")


def has_adapters(model) -> bool:
    peft_model = sys.modules.get("peft.peft_model")
    if peft_model is not None and isinstance(model, peft_model.PeftModel):
        return True
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def _prepare_model_for_kbit_training(wrapped, instance, args, kwargs):
    model = args[0] if args else kwargs.get("model")
    trainable = [p for p in model.parameters() if p.requires_grad] if has_adapters(model) else []
    result = wrapped(*args, **kwargs)
    refrozen = [p for p in trainable if not p.requires_grad]
    for p in refrozen:
        p.requires_grad_(True)
    if refrozen:
        acted(SPEC.id, "adapter parameters made trainable again", len(refrozen))
        log.warning(
            "prepare_model_for_kbit_training was called on a model that already has adapters and froze "
            "them; %d adapter parameter(s) were made trainable again. Prepare the base model before get_peft_model.",
            len(refrozen),
        )
    return result


def install(patcher, options) -> None:
    other = sys.modules["peft.utils.other"]
    original = other.prepare_model_for_kbit_training
    patcher.wrap_aliases(original, _prepare_model_for_kbit_training)


def probe() -> Observation:
    """Tiny Llama + LoRA, then prepare_model_for_kbit_training: are the LoRA weights still trainable?"""
    from .. import tiny

    model = tiny.lora(tiny.tiny_llama())
    from peft import prepare_model_for_kbit_training

    with tiny.quiet():
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    lora = tiny.lora_parameters(model)
    frozen = [name for name, p in lora.items() if not p.requires_grad]
    if frozen:
        return Observation(True, f"{len(frozen)} of {len(lora)} LoRA parameters frozen")
    return Observation(False, f"all {len(lora)} LoRA parameters trainable")
