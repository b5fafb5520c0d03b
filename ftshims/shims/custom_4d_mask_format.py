"""A custom 4D attention mask in the wrong form is silently misused: convert it to the form the model reads.

Why: a custom 4D mask ``[batch, 1, query, key]`` (block masks for packing,
tree attention, prefix-LM) comes in three forms: *additive* (0 / ``finfo.min``,
added to the scores), *binary* (float 1 = attend, 0 = masked) and *bool*
(True = attend). Each transformers version reads exactly one of them per code
path, without checking, and what it does with the others is silent:

* >=4.44 (and the 4.53+ ``create_causal_mask``): the mask is added to the scores
  as-is, so a binary mask becomes a bias of 0/1: nothing is masked, not even
  the future (non-causal); a bool mask is added as 0/1 under eager (ignored)
  and only works under sdpa.
* 4.41–4.43 (``_update_causal_mask``): binary and bool masks raise
  ``ValueError: Custom 4D attention mask should be passed in inverted form``.
* 4.37–4.41 families on ``_prepare_4d_causal_attention_mask`` (mistral, qwen2,
  mixtral, phi, ... until 4.42) compute ``1 - mask``: they want binary; an
  additive mask masks everything, a bool one raises under eager; under sdpa
  4.40–4.41 accept no 4D mask at all (``too many values to unpack``).
* 4.38 llama/gemma and 4.39–4.40 gemma/cohere ignore a 4D mask entirely in
  ``_update_causal_mask``; 4.39–4.40 llama reads it as binary (``mask == 0`` is
  masked), so an additive mask is inverted.

The fix: wrap the decoder base model's ``forward`` (the families in
``_packing.FAMILIES``). A 4D mask in a form this model mishandles (bool,
binary or additive, told apart by dtype and values) is converted to the
additive form in the model's dtype. Where the version's mask code would not
take an additive mask as-is (the 4.37–4.41 ``_prepare_4d_causal_attention_mask``
helpers, 4.38–4.40 ``_update_causal_mask``) that code is wrapped to pass the
converted mask through unchanged. Masks already in a form read correctly are
passed on untouched (the same object), as are masks of other value ranges.

Applies to transformers >=4.37 (unfixed upstream: no version validates the
form). Below 4.37 no custom 4D mask is accepted at all. Eager and sdpa only.
"""

from __future__ import annotations

from .._util import acted, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

SPEC = ShimSpec(
    id="custom_4d_mask_format",
    since="0.1.0",
    title="Custom 4D attention masks in the wrong form are silently misused",
    symptom="a binary (0/1) or bool 4D attention mask is ignored or applied non-causally (>=4.44), raises "
    "'Custom 4D attention mask should be passed in inverted form' (4.41–4.43), or an additive one masks everything "
    "(4.37–4.41 on _prepare_4d_causal_attention_mask)",
    why='A custom 4D mask comes as additive, binary or bool; each transformers version reads exactly one form per code path without checking, and misreads the others silently (a masked key attended, or every key masked). The shim converts a 4D mask to the form the installed version reads.',
    requires={"transformers": ">=4.37"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/27539",
        "https://github.com/huggingface/transformers/issues/29525",
        "https://github.com/huggingface/transformers/pull/30348",
        "https://github.com/huggingface/transformers/issues/32195",
    ),
    targets=(
        Target("transformers.models.llama.modeling_llama", "LlamaModel.forward", params=("attention_mask",)),
        Target("transformers.models.llama.modeling_llama", "LlamaModel._update_causal_mask", when=">=4.38,<4.41"),
    ),
    modules=("transformers",),
)


def misread(model_class, attn: str, form: str) -> bool:
    """Whether the installed mask code of this model mishandles a 4D mask in ``form`` (so we convert it)."""
    if _packing.needs_passthrough(model_class):
        return True  # 4.37–4.41 helpers / 4.38–4.40 _update_causal_mask: converted and passed through
    if form == _packing.ADDITIVE:
        return False
    if form == _packing.BOOL:
        return _packing.bool_misread(model_class)[attn]
    return True


def _forward(wrapped, instance, call, family):
    config = instance.config
    attn = getattr(config, "_attn_implementation", None)
    if attn not in _packing.EAGER_LIKE:
        return wrapped(**call)
    mask = call.get("attention_mask")
    if mask is None or getattr(mask, "ndim", None) != 4:
        return wrapped(**call)
    if compiling():
        # Inside a trace only the dtype can decide (telling binary from additive floats reads
        # the values): bool masks are converted where misread; float masks pass as they are.
        if not family.traces_4d or not family.bool_misread[attn] or mask.dtype != _torch().bool:
            return wrapped(**call)
        call["attention_mask"] = _packing.to_form(mask, _packing.ADDITIVE, _packing.embed_dtype(instance, call))
        return wrapped(**call)
    if mask is _packing.PASS_THROUGH.get():
        return wrapped(**call)
    form = _packing.read_form(mask)
    if form is None or not misread(type(instance), attn, form):
        return wrapped(**call)
    allowed = _packing.allowed_from(mask, form)
    converted = _packing.to_form(allowed, _packing.ADDITIVE, _packing.embed_dtype(instance, call))
    call["attention_mask"] = converted
    acted(SPEC.id, "4D masks converted")
    with _packing.handing_down(converted):
        return wrapped(**call)


def _torch():
    import torch

    return torch


def install(patcher, options) -> None:
    for model_type in _packing.FAMILIES:
        _packing.install_family(patcher, model_type, _forward)


def probe(form: str = "binary", attn: str = "eager", family: str = "llama") -> Observation:
    """Two examples packed in one row with per-example position_ids and a block-causal 4D mask in
    ``form`` (``"additive"``, ``"binary"``, ``"bool"``): do the packed logits equal each example alone?"""
    if not _packing.family_available(family):
        raise ProbeUnsupported(f"this transformers has no {family} model")
    if _packing.transformers_version().release[:2] < (4, 37):
        raise ProbeUnsupported("transformers <4.37 accepts no custom 4D attention mask")
    import torch

    from .. import tiny

    with tiny.quiet():
        model = _packing.tiny_decoder(family, attn)
        examples = _packing.example_pair()
        batch = _packing.packed_batch(examples, mask="none")
        segment_ids, real = _packing.segments(batch["position_ids"])
        allowed = _packing.allowed_pairs(segment_ids, real)
        batch["attention_mask"] = _packing.to_form(allowed, form, torch.float32)
        try:
            gap = _packing.segment_logit_gap(model, examples, batch, use_cache=False)
        except (ValueError, RuntimeError) as exc:
            return Observation(True, f"the {form} 4D mask was rejected: {type(exc).__name__}: {exc}")
    if gap > 1e-4:
        return Observation(True, f"the {form} 4D mask was misread: max logit difference {gap:.3g}")
    return Observation(False, f"the {form} 4D mask was applied: max logit difference {gap:.2g}")
