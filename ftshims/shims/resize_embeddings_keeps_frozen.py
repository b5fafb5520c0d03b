"""``resize_token_embeddings`` makes frozen embeddings trainable again.

Why: before transformers 4.36 ``_get_resized_embeddings`` and
``_get_resized_lm_head`` build fresh ``nn.Embedding`` / ``nn.Linear`` modules and
copy the old *values* into them, but not the old ``requires_grad`` flag: every
new parameter starts trainable. Adding tokens to a model whose embeddings you
froze (the usual LoRA recipe: add special tokens, resize, then train adapters)
silently trains the whole embedding matrix and the LM head, and a later
``get_peft_model`` or optimizer built from ``requires_grad`` picks them up
(transformers#26861, fixed in 4.36.0 by PR #26865).

The fix: wrap ``PreTrainedModel.resize_token_embeddings``; snapshot the
``requires_grad`` flags of the input and output embedding parameters before
the call and give the new parameters the same flags after it.

Applies to transformers >=4.30,<4.36 (reproduced on 4.30.2 and 4.34.1; the same
code, without the flag copy, is in the 4.20–4.35 sources). Fallback: if the
method is missing the shim is skipped; models without output embeddings only
get their input embeddings' flags restored.

Follow-ups: none. PreTrainedModel._get_resized_embeddings and _get_resized_lm_head
read in 4.36.0, 4.40.0, 4.49.0, 4.53.3, 4.57.6, 5.0.0, 5.9.0, 5.16.1, 5.24.0 and
5.25.0: the requires_grad copy #26865 added is unchanged; no revert or regression
report against it found. (Upstream copies the weight's flag onto the whole new
module; the shim restores each parameter's own flag, the same for the usual
weight-only embeddings.)
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="resize_embeddings_keeps_frozen",
    since="0.1.0",
    title="resize_token_embeddings makes frozen embeddings trainable",
    symptom="after resize_token_embeddings, frozen input/output embeddings have requires_grad=True again",
    why='Before transformers 4.36 resize_token_embeddings builds fresh embedding and LM-head parameters that start trainable, so frozen embeddings silently train after adding tokens. The shim carries requires_grad over.',
    requires={"transformers": ">=4.30,<4.36"},
    fixed_in={"transformers": "4.36.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/26861",
        "https://github.com/huggingface/transformers/pull/26865",
    ),
    backports=("https://github.com/huggingface/transformers/pull/26865",),
    follow_ups_checked="PreTrainedModel._get_resized_embeddings and _get_resized_lm_head read in 4.36.0, 4.40.0, "
    "4.49.0, 4.53.3, 4.57.6, 5.0.0, 5.9.0, 5.16.1, 5.24.0 and 5.25.0: the requires_grad copy #26865 added is "
    "unchanged; no revert or regression report against it found.",
    targets=(Target("transformers.modeling_utils", "PreTrainedModel.resize_token_embeddings"),),
    modules=("transformers.modeling_utils",),
)


def _embedding_modules(model):
    """(name, module) pairs for the input and output embeddings that exist."""
    modules = []
    for name, getter in (("input", "get_input_embeddings"), ("output", "get_output_embeddings")):
        try:
            module = getattr(model, getter)()
        except (NotImplementedError, AttributeError):
            module = None
        if module is not None:
            modules.append((name, module))
    return modules


def _flags(model):
    return {
        (which, pname): p.requires_grad
        for which, module in _embedding_modules(model)
        for pname, p in module.named_parameters(recurse=False)
    }


def restore_flags(model, before, shim_id: str, action: str) -> None:
    """Give the embedding parameters the ``requires_grad`` flags ``_flags`` recorded (shared with the ZeRO-3 shim)."""
    for which, module in _embedding_modules(model):
        for pname, p in module.named_parameters(recurse=False):
            flag = before.get((which, pname))
            if flag is not None and p.requires_grad != flag:
                p.requires_grad_(flag)
                acted(shim_id, action)


def _resize_token_embeddings(wrapped, instance, args, kwargs):
    before = _flags(instance)
    result = wrapped(*args, **kwargs)
    restore_flags(instance, before, SPEC.id, "requires_grad flags kept after resize")
    return result


def install(patcher, options) -> None:
    modeling_utils = sys.modules["transformers.modeling_utils"]
    patcher.wrap(modeling_utils.PreTrainedModel, "resize_token_embeddings", _resize_token_embeddings)


def probe(tie_word_embeddings: bool = False) -> Observation:
    """Freeze both embeddings of a tiny Llama, add 8 tokens: are they still frozen?"""
    from .. import tiny

    model = tiny.tiny_llama(tie_word_embeddings=tie_word_embeddings)
    for _, module in _embedding_modules(model):
        module.requires_grad_(False)
    with tiny.quiet():
        model.resize_token_embeddings(model.config.vocab_size + 8)
    thawed = sorted(f"{which}.{pname}" for (which, pname), flag in _flags(model).items() if flag)
    if model.get_input_embeddings().weight.shape[0] != model.config.vocab_size:
        return Observation(True, "resize did not take effect")
    if thawed:
        return Observation(True, f"frozen embeddings became trainable: {', '.join(thawed)}")
    return Observation(False, "embeddings stayed frozen")
