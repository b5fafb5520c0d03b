"""A checkpoint's untied LM head is tied to the input embeddings by a later ``tie_weights()`` (T5 v1.1, mT5, ...).

Why: from transformers 5.0 the configs of T5, mT5, UMT5, LongT5, Pop2Piano and UDOP force
``tie_word_embeddings = True`` (T5 keeps the checkpoint's ``False`` only as ``scale_decoder_outputs``), so every
T5 v1.1, mT5, UMT5, LongT5, Flan-T5 and ByT5 checkpoint, whose ``lm_head`` is a separate trained matrix, meets a
config that says "tie". ``from_pretrained`` handles it: when both tied keys are in the checkpoint with different
values it does not tie them and drops the pair from ``model.all_tied_weights_keys`` ("both are present in the
checkpoints with different values, so we will NOT tie them"). But any later ``tie_weights()`` recomputes the pairs
from the config, which still says "tie", and replaces the trained ``lm_head`` by the input embedding matrix,
silently: ``resize_token_embeddings`` (the usual step after adding tokens) calls it, and so does accelerate's FSDP2
``fsdp2_prepare_model``. The model then trains from a corrupted output layer (max |Δlogit| 38 on a tiny mT5; the
same checkpoint resized on 4.57 keeps its logits exactly).

When: transformers >=5.0.0 (the forced flag, the declined pair and the recomputing ``tie_weights`` are in every 5.x
release read, 5.0.0-5.25.0, for T5 and mT5; UMT5 and LongT5 force it from a later 5.x: 5.1.0 keeps their False,
5.16.1 forces it; unfixed in 5.25.0). The shim wraps ``PreTrainedModel.tie_weights``. During
``from_pretrained`` (``missing_keys`` given) it notes which pairs the loader declined to tie for that model (a weak
reference: nothing is written on the model). On any later call it ties every pair except those, as long as they are
still two distinct parameters: a head loaded untied stays untied, and ``resize_token_embeddings`` resizes it on its
own (its ``_resize_token_embeddings`` already resizes the output embeddings separately), which is what 4.x did.
Everything else is the call as it was: models loaded tied, models built from a config (T5 built in 5.x from
``T5Config(tie_word_embeddings=False)`` is tied from the start, upstream's choice), pairs a user asked for through
the config, and every model when ``apply()`` came after its ``from_pretrained`` (the shim cannot know what the
loader declined then, and stays out).

Upstream: no report found; PR #42270 (5.0) made ``tie_weights()`` recompute the pairs from the config, PR #42612 (closed
unmerged) proposed keeping apart pairs a checkpoint holds with different values; #8706 / PR #8880 taught 4.x to resize
the separate T5 v1.1 head.

Fallback: a changed ``tie_weights`` signature (no ``missing_keys`` / ``recompute_mapping``) or a model without
``all_tied_weights_keys`` / ``get_expanded_tied_weights_keys`` leaves the call untouched. Not fixed: 5.0.0's other T5
v1.1 defect (wrong logits straight after loading, gone in 5.1.0).
"""

from __future__ import annotations

import sys
import weakref

from .._util import acted, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

PARAMS = ("missing_keys", "recompute_mapping")

SPEC = ShimSpec(
    id="untied_head_retied_after_load",
    since="0.3.0",
    title="tie_weights() (resize_token_embeddings, FSDP2 prepare) ties a checkpoint's untied LM head to the input "
    "embeddings: T5 v1.1, mT5, UMT5, LongT5, Flan-T5, ByT5 on transformers 5.x",
    symptom="after resize_token_embeddings (or model.tie_weights(), accelerate's FSDP2 prepare) a T5 v1.1 / mT5 / "
    "UMT5 / LongT5 model loaded with its own lm_head has lm_head tied to the input embeddings: its logits change "
    "(max 38 on a tiny mT5) and training starts from a corrupted output layer, silently",
    why="5.x T5-family configs force tie_word_embeddings=True; from_pretrained declines to tie an untied checkpoint's "
    "head, but a later tie_weights() recomputes the pairs from the config and ties it. The shim keeps the pairs "
    "from_pretrained declined untied.",
    requires={"transformers": ">=5.0.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/pull/42270",
        "https://github.com/huggingface/transformers/pull/42612",
        "https://github.com/huggingface/transformers/issues/8706",
        "https://github.com/huggingface/transformers/pull/8880",
    ),
    targets=(Target("transformers.modeling_utils", "PreTrainedModel.tie_weights", params=PARAMS),),
    modules=("transformers.modeling_utils",),
)

# model -> {target parameter name: source parameter name} that from_pretrained declined to tie
_DECLINED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def declined_pairs(model) -> dict:
    """The pairs ``from_pretrained`` found in the checkpoint with different values and left untied (empty if none
    or not seen)."""
    return dict(_DECLINED.get(model, {}))


def _distinct(model, target: str, source: str) -> bool:
    try:
        return model.get_parameter(target) is not model.get_parameter(source)
    except AttributeError:
        return False


def _wrapper(bind):
    def tie_weights(wrapped, instance, args, kwargs):
        call = bind(args, kwargs)
        tied = getattr(instance, "all_tied_weights_keys", None)
        if call is None or not isinstance(tied, dict):
            return wrapped(*args, **kwargs)
        if call.get("missing_keys") is not None:  # from_pretrained: note what the loader declines to tie
            before = dict(tied)
            result = wrapped(*args, **kwargs)
            after = getattr(instance, "all_tied_weights_keys", {})
            declined = {target: source for target, source in before.items() if target not in after}
            if declined:
                _DECLINED[instance] = declined
            else:
                _DECLINED.pop(instance, None)
            return result
        declined = _DECLINED.get(instance)
        if not declined:
            return wrapped(*args, **kwargs)
        if call.get("recompute_mapping", True):
            mapping = instance.get_expanded_tied_weights_keys(all_submodels=True)
        else:
            mapping = dict(tied)
        keep_apart = [target for target in mapping if target in declined and _distinct(instance, target, mapping[target])]
        if not keep_apart:
            return wrapped(*args, **kwargs)
        # tie_weights(recompute_mapping=False) ties exactly the pairs of all_tied_weights_keys: hand it the mapping
        # without the declined pairs for this one call, then put the model's own dict back.
        instance.all_tied_weights_keys = {t: s for t, s in mapping.items() if t not in keep_apart}
        try:
            result = wrapped(missing_keys=None, recompute_mapping=False)
        finally:
            instance.all_tied_weights_keys = tied
        acted(SPEC.id, "untied checkpoint heads kept untied", len(keep_apart))
        return result

    return tie_weights


def install(patcher, options) -> None:
    from ..patching import require_params

    cls = sys.modules["transformers.modeling_utils"].PreTrainedModel
    require_params(cls.tie_weights, PARAMS, "transformers.modeling_utils.PreTrainedModel.tie_weights")
    patcher.wrap(cls, "tie_weights", _wrapper(method_binder(cls.tie_weights)))


# ---------------------------------------------------------------------------
# Reproduction

VOCAB = 64


def untied_checkpoint(directory, family: str = "mt5"):
    """Write a T5 v1.1 / mT5-style checkpoint the way 4.x and the Hub have them: ``tie_word_embeddings: false`` in
    config.json and an ``lm_head.weight`` that differs from ``shared.weight`` (a "pretrained" head). Returns the
    directory."""
    import json
    import os

    import torch
    import transformers
    from safetensors.torch import save_file

    from .. import tiny

    common = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    config_class, model_class = {"t5": ("T5Config", "T5ForConditionalGeneration"),
                                 "mt5": ("MT5Config", "MT5ForConditionalGeneration"),
                                 "umt5": ("UMT5Config", "UMT5ForConditionalGeneration")}[family]
    if not hasattr(transformers, model_class):
        raise ProbeUnsupported(f"no {model_class} in this transformers")
    torch.manual_seed(0)
    with tiny.quiet():
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**common))
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    state["lm_head.weight"] = torch.randn(state["shared.weight"].shape, generator=generator)  # the trained head
    for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        # the shared matrix, as separate copies: 5.1's UMT5 does not tie them to shared (a missing key would load
        # as random values there)
        state[name] = state["shared.weight"].clone()
    os.makedirs(directory, exist_ok=True)
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    path = os.path.join(directory, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    config["tie_word_embeddings"] = False  # what the released checkpoints say (5.x configs would write True)
    with open(path, "w") as handle:
        json.dump(config, handle)
    return directory


def load(directory):
    import transformers

    from .. import tiny

    with tiny.quiet():
        return transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()


def logits(model):
    import torch

    ids = torch.randint(3, VOCAB - 2, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids, decoder_input_ids=ids).logits[..., :VOCAB]


def head_is_tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def probe(family: str = "mt5", step: str = "resize") -> Observation:
    """Load an untied T5-family checkpoint, then ``resize_token_embeddings(+8)`` (``step="resize"``) or
    ``tie_weights()``: are the logits over the original vocabulary those of the loaded model?"""
    import tempfile

    from .. import tiny

    with tempfile.TemporaryDirectory() as directory:
        model = load(untied_checkpoint(directory, family))
    loaded = logits(model)
    with tiny.quiet():
        if step == "resize":
            model.resize_token_embeddings(VOCAB + 8)
        else:
            model.tie_weights()
    gap = float((logits(model) - loaded).abs().max())
    tied = head_is_tied(model)
    detail = f"{family} loaded untied, then {step}: max |dlogit| {gap:.3g}{', head tied to the embeddings' if tied else ''}"
    return Observation(gap > 0 or tied, detail)
