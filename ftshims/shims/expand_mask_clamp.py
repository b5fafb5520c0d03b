"""fp16 attention turns fully-masked (left-padding) rows into NaN that spreads over the whole sequence.

Why: with left padding, the query rows of the padding tokens are *fully
masked*: every key is either padding or in the future. transformers marks
masked positions with ``torch.finfo(dtype).min`` (-65504 in fp16) and eager
attention computes ``scores + mask`` in the model's dtype. In fp16 any score
below about -16 makes that sum overflow to ``-inf``; a fully-masked row then
becomes a row of ``-inf`` and its softmax is ``NaN``. One layer later the
padding positions are keys of every real query: their attention weight is
exactly 0, but ``0 * NaN`` is NaN, so the NaN spreads to every position of the
sequence (transformers#25311, #25065, #27179). From 4.31 to 4.35 the padding
and causal masks were even *added* (``min + min = -inf`` directly; 4.36 switched
to ``masked_fill``, PR #27114). Measured on the pinned stacks (tiny models whose
q/k projections force scores of about -280, 3 of 8 tokens left-padded, fp16,
CPU, eager): NaN on Llama 4.34.1-5.24.0, Mistral 4.34.1-5.24.0, BART 4.30.2-5.24.0,
OPT and GPT-2 4.53.3-5.24.0. Not on Llama 4.30.2 (it still clamped the
*scores*, PR #24561, removed in 4.31.0), OPT <= 4.46.3 (clamps the scores),
GPT-2 <= 4.46.3 (its causal mask leaves future tokens finite), GPT-J (fp32
attention), and never in bf16 or fp32, where ``min + score`` rounds back to
``min``. CPU SDPA never produced it (its kernels add the mask in fp32).

Why the naive fix is not enough: the popular recipe "clamp ``_expand_mask`` at
``finfo.min``" only removes the ``-inf`` that 4.31-4.35 produced by adding two
masks, and from 4.36 on the masks never go below ``finfo.min`` at all, so the
clamp is a no-op. The overflow happens *after* the mask is built, when the
(negative) attention score is added to ``finfo.min`` in fp16: a clamped row of
``finfo.min`` still becomes a row of ``-inf`` and still softmaxes to NaN
(``tests/shims/test_expand_mask_clamp.py::test_naive_clamp_is_not_enough``).
What cures it is to give every fully-masked row something finite to attend to.

The fix, at mask level: every additive fp16 mask transformers builds is
clamped at ``finfo.min`` (so the combined mask never goes below it) and its
fully-masked rows are set to 0 ("attend anywhere"; the outputs of those rows
belong to padding tokens and are ignored by the loss and by every real token,
whose weights on padding keys stay exactly 0). For the boolean masks SDPA gets
from ``masking_utils`` (>= 4.53) the same rows are set to all-True, the boolean
form of the same fix (it is what transformers' own ``_unmask_unattended`` /
``allow_torch_fix`` did for the SDPA kernels). Only fp16 is touched: masks for
bf16 and fp32 are returned as the very same object, so healthy numbers do not
move (bit-identical outputs, tested).

Where, era by era (each hook is installed when its module is imported, and
only if the object exists; nothing is chosen by version string alone):

* <= 4.34: ``<Model>._prepare_decoder_attention_mask`` on every class of every
  ``transformers.models.*.modeling_*`` module that defines it (about 25
  decoders: Llama, Mistral, BART, OPT, ...). It is the method that *adds* the
  module-level ``_make_causal_mask`` and ``_expand_mask`` (each copied into ~60
  modeling files and looked up as module globals at call time); neither helper
  alone ever goes below ``finfo.min`` or produces a fully-masked row, so the
  method that combines them is where the fix belongs.
* 4.35 - 5.23: ``AttentionMaskConverter.to_4d`` in ``modeling_attn_mask_utils``.
  The ``_prepare_4d_causal_attention_mask[_for_sdpa]`` helpers are imported by
  name into the models (patching them would miss those copies), but they all
  call ``to_4d`` through the class, which is where it is looked up.
  ``to_causal_4d`` is not wrapped: a purely causal mask always keeps the
  diagonal, so it has no fully-masked row.
* 4.38 - 4.57: ``<Model>._update_causal_mask`` on every class that defines it
  (Llama-family models from 4.38, OPT/GPT-2/BART... in 4.53-4.57); a tuple
  result (OPT 4.46) is repaired element-wise.
* >= 4.53: the ``"eager"`` and ``"sdpa"`` entries of
  ``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS`` (the global registry behind
  ``create_causal_mask``, the sliding-window, chunked and bidirectional masks).
  5.24 removed ``modeling_attn_mask_utils``: that hook then simply never fires.

Applies to transformers >= 4.30 (the project's floor: BART reproduces on 4.30.2,
so the bug predates it) with no upper bound (unfixed in 5.24.0). Fallback: a
model module without these methods is left alone; 4D masks passed in by the
user through ``masking_utils`` are returned untouched upstream and therefore
not repaired; flash-attention and flex masks are never touched.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Iterator

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="expand_mask_clamp",
    since="0.1.0",
    title="fp16 NaN from fully-masked (left-padding) attention rows",
    symptom="NaN logits/loss in fp16 with left padding (eager attention); `finfo.min + score` overflows to -inf",
    why="With left padding, padding query rows are fully masked; in fp16 eager attention scores + finfo.min overflow to -inf, the row's softmax is NaN, and the NaN spreads to every position one layer later. The shim keeps fully masked rows finite.",
    requires={"transformers": ">=4.30"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/25311",
        "https://github.com/huggingface/transformers/issues/25065",
        "https://github.com/huggingface/transformers/issues/27179",
        "https://github.com/huggingface/transformers/pull/24561",
        "https://github.com/huggingface/transformers/pull/27114",
        "https://github.com/pytorch/pytorch/issues/110213",
    ),
    targets=(
        Target(
            "transformers.models.llama.modeling_llama", "LlamaModel._prepare_decoder_attention_mask", when=">=4.30,<4.35"
        ),
        Target(
            "transformers.models.bart.modeling_bart", "BartDecoder._prepare_decoder_attention_mask", when=">=4.30,<4.35"
        ),
        Target(
            "transformers.modeling_attn_mask_utils",
            "AttentionMaskConverter.to_4d",
            params=("attention_mask_2d", "query_length", "dtype"),
            when=">=4.35,<5.24",
        ),
        Target("transformers.models.llama.modeling_llama", "LlamaModel._update_causal_mask", when=">=4.38,<4.53"),
        Target("transformers.models.opt.modeling_opt", "OPTDecoder._update_causal_mask", when=">=4.46,<5.0"),
        Target("transformers.masking_utils", "AttentionMaskInterface._global_mapping", when=">=4.53"),
    ),
    modules=("transformers",),
)

# Methods of model classes whose result is the final additive 4D mask.
_MODEL_METHODS = ("_prepare_decoder_attention_mask", "_update_causal_mask")
_REGISTRY_KEYS = ("eager", "sdpa")


# ---------------------------------------------------------------------------
# The repair itself


_FP16_MIN_BITS = -1025  # torch.finfo(torch.float16).min (0xFBFF) read as int16


def repair_mask(mask: Any, dtype: Any = None) -> Any:
    """The mask with fully-masked rows opened up; the same object when nothing applies.

    * 4D float16 additive mask: clamped at ``finfo(float16).min`` and every row
      whose entries are all at that minimum set to 0.
    * 4D boolean mask (True = attend) when the compute ``dtype`` is float16:
      every all-False row set to all-True.
    * Anything else (bf16/fp32 masks, None, 2D masks, BlockMask...) is returned
      as is.
    """
    import torch

    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return mask
    if mask.dtype == torch.bool:
        if dtype != torch.float16:
            return mask
        acted(SPEC.id, "fp16 masks made NaN-safe")
        return mask | ~mask.any(dim=-1, keepdim=True)
    if mask.dtype != torch.float16:
        return mask
    acted(SPEC.id, "fp16 masks made NaN-safe")
    lowest = torch.finfo(torch.float16).min
    # An out-of-place copy (the mask may be the caller's own 4D tensor); -inf (4.31-4.35 sums) becomes finfo.min.
    repaired = mask.clamp(min=lowest)
    # A row is fully masked when every entry is now exactly finfo.min: min == max == its bit pattern. Integer
    # reductions on the int16 view are exact and several times cheaper than fp16 compares on CPU.
    bits = repaired.view(torch.int16)
    fully_masked = (bits.amax(dim=-1, keepdim=True) == _FP16_MIN_BITS) & (
        bits.amin(dim=-1, keepdim=True) == _FP16_MIN_BITS
    )
    return repaired.mul_(~fully_masked)  # finfo.min * 0 -> (-)0: attend anywhere; no inf left to make NaN


def _repair_result(result: Any, dtype: Any = None) -> Any:
    if type(result) is tuple:  # OPT 4.46: (causal_4d_mask, attention_mask_2d)
        return tuple(repair_mask(item, dtype) for item in result)
    return repair_mask(result, dtype)


def _repair_output(wrapped, instance, args, kwargs):
    return _repair_result(wrapped(*args, **kwargs))


def _repair_registry_output(wrapped, instance, args, kwargs):
    # masking_utils passes the compute dtype as a keyword (``dtype=`` "additional kwarg for eager").
    return _repair_result(wrapped(*args, **kwargs), kwargs.get("dtype"))


# ---------------------------------------------------------------------------
# Installation


def _modeling_module_names(transformers) -> Iterator[str]:
    """Every ``transformers.models.<name>[.<sub>].modeling_<x>`` module on disk (PyTorch only)."""
    for base in getattr(transformers, "__path__", ()):
        root = os.path.join(base, "models")
        if not os.path.isdir(root):
            continue
        stack = [(root, "transformers.models", 0)]
        while stack:
            path, prefix, depth = stack.pop()
            with os.scandir(path) as entries:
                for entry in entries:
                    name = entry.name
                    if entry.is_dir():
                        if depth < 2 and not name.startswith(("_", ".")):
                            stack.append((entry.path, f"{prefix}.{name}", depth + 1))
                    elif (
                        name.startswith("modeling_")
                        and name.endswith(".py")
                        and not name.startswith(("modeling_tf_", "modeling_flax_"))
                    ):
                        yield f"{prefix}.{name[:-3]}"


def _patch_model_module(patcher, module) -> None:
    for obj in list(vars(module).values()):
        if not isinstance(obj, type) or obj.__module__ != module.__name__:
            continue
        for method in _MODEL_METHODS:
            if callable(vars(obj).get(method)):
                patcher.wrap(obj, method, _repair_output)


def _patch_converter(patcher, module) -> None:
    from ..patching import require_params
    from ..spec import TargetMissing

    converter = getattr(module, "AttentionMaskConverter", None)
    if converter is None or not callable(vars(converter).get("to_4d")):
        raise TargetMissing("modeling_attn_mask_utils.AttentionMaskConverter.to_4d not found")
    require_params(converter.to_4d, ("attention_mask_2d", "query_length", "dtype"), "AttentionMaskConverter.to_4d")
    patcher.wrap(converter, "to_4d", _repair_output)


def _patch_registry(patcher, module) -> None:
    from ..spec import TargetMissing

    registry = getattr(module, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    mapping = getattr(type(registry), "_global_mapping", None) if registry is not None else None
    if not isinstance(mapping, dict) or not all(key in mapping for key in _REGISTRY_KEYS):
        raise TargetMissing("masking_utils.ALL_MASK_ATTENTION_FUNCTIONS has no 'eager'/'sdpa' entries")
    for key in _REGISTRY_KEYS:
        patcher.wrap_item(mapping, key, _repair_registry_output)


def install(patcher, options) -> None:
    transformers = sys.modules["transformers"]
    patcher.when_imported("transformers.modeling_attn_mask_utils", lambda m: _patch_converter(patcher, m))
    patcher.when_imported("transformers.masking_utils", lambda m: _patch_registry(patcher, m))
    for name in _modeling_module_names(transformers):
        patcher.when_imported(name, lambda m: _patch_model_module(patcher, m))


# ---------------------------------------------------------------------------
# Probe: tiny models whose q/k projections force large negative scores.

# family -> (config class, config fields, how q/k are produced)
FAMILIES: Dict[str, tuple] = {
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4), "qk"),
    "mistral": (
        "MistralConfig",
        dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, sliding_window=4096, pad_token_id=0),
        "qk",
    ),
    "bart": (
        "BartConfig",
        dict(vocab_size=128, d_model=32, decoder_ffn_dim=64, encoder_ffn_dim=64, decoder_layers=2, encoder_layers=2,
             decoder_attention_heads=4, encoder_attention_heads=4, max_position_embeddings=64, pad_token_id=1),
        "qk",
    ),
    "opt": (
        "OPTConfig",
        dict(vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1),
        "qk",
    ),
    "gpt2": ("GPT2Config", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0), "c_attn"),
}
HEAD_DIM = 8
SCORE_BIAS = 20.0  # q = +20, k = -20 on two dims of every head: scores of -800 / sqrt(8), about -280
PAD = 3  # left-padded tokens out of SEQ
SEQ = 8


def _qk_hook(sign: float):
    def hook(module, inputs, output):
        out = output.new_zeros(output.shape)
        heads = out.view(*out.shape[:-1], -1, HEAD_DIM)
        # the lowest-frequency rotary pair (dims d/2-1 and d-1), so RoPE barely rotates it
        heads[..., HEAD_DIM // 2 - 1] = sign * SCORE_BIAS
        heads[..., HEAD_DIM - 1] = sign * SCORE_BIAS
        return out

    return hook


def _fused_qkv_hook(module, inputs, output):
    out = output.clone()
    width = out.shape[-1] // 3
    for part, sign in ((0, 1.0), (1, -1.0)):
        block = out[..., part * width : (part + 1) * width]
        block.zero_()
        heads = block.view(*block.shape[:-1], -1, HEAD_DIM)
        heads[..., HEAD_DIM // 2 - 1] = sign * SCORE_BIAS
        heads[..., HEAD_DIM - 1] = sign * SCORE_BIAS
    return out


def build(family: str = "llama", attn: str = "eager", dtype: str = "float16", forced: bool = True, seed: int = 0):
    """A tiny causal LM of ``family`` in ``dtype``; with ``forced`` its attention scores are about -280.

    Raises ProbeUnsupported when the family or the attention implementation
    does not exist in the installed transformers.
    """
    import torch
    import transformers

    from .. import tiny

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, not {family!r}")
    config_class, fields, kind = FAMILIES[family]
    if not hasattr(transformers, config_class):
        raise ProbeUnsupported(f"transformers {transformers.__version__} has no {config_class}")
    try:
        with tiny.quiet():
            model = tiny.causal_lm(config_class, attn=attn, seed=seed, **fields)
    except ValueError as exc:  # "does not support an attention implementation through ..."
        raise ProbeUnsupported(f"{family}: attn_implementation={attn!r} not available ({exc})") from exc
    actual = getattr(model.config, "_attn_implementation", None) or "eager"
    if actual != attn:
        raise ProbeUnsupported(f"{family}: attn_implementation={attn!r} not available (got {actual!r})")
    if forced:
        hooked = 0
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if kind == "qk" and "encoder_attn" not in name and leaf in ("q_proj", "k_proj"):
                module.register_forward_hook(_qk_hook(1.0 if leaf == "q_proj" else -1.0))
                hooked += 1
            elif kind == "c_attn" and leaf == "c_attn":
                module.register_forward_hook(_fused_qkv_hook)
                hooked += 1
        if not hooked:
            raise ProbeUnsupported(f"{family}: no q/k projection found to force the scores")
    return model.to(getattr(torch, dtype)).eval()


def padded_batch(family: str = "llama"):
    """``(input_ids, attention_mask, position_ids)`` of one sequence of SEQ tokens, the first PAD of them padding."""
    import torch

    pad_id = FAMILIES[family][1].get("pad_token_id", 0) if family != "llama" else 0
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, SEQ), generator=generator)
    ids[:, :PAD] = pad_id
    mask = torch.ones_like(ids)
    mask[:, :PAD] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def forward(model, input_ids, attention_mask=None, position_ids=None):
    """Logits of one forward pass; ``position_ids`` is passed only to models that take it."""
    import inspect

    import torch

    kwargs = {"input_ids": input_ids}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None and "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = position_ids
    with torch.no_grad():
        return model(**kwargs).logits


def probe(family: str = "auto", attn: str = "eager", dtype: str = "float16", forced: bool = True) -> Observation:
    """Left-padded forward pass of a tiny ``family`` model: are there NaN logits?

    ``family="auto"`` is Llama, except on transformers 4.30 where Llama still
    clamped its scores and BART (same bug, unclamped) shows it instead.
    """
    import torch

    from .. import tiny
    from ..versions import in_range, installed_version

    if family == "auto":
        family = "llama" if in_range(installed_version("transformers"), ">=4.31") else "bart"
    model = build(family, attn=attn, dtype=dtype, forced=forced)
    ids, mask, position_ids = padded_batch(family)
    with tiny.quiet():
        logits = forward(model, ids, mask, position_ids)
    nan_positions = torch.isnan(logits).any(dim=-1)[0].nonzero().flatten().tolist()
    if nan_positions:
        return Observation(
            True, f"{family}/{attn}/{dtype}: NaN logits at positions {nan_positions} of {SEQ} ({PAD} left-padded)"
        )
    return Observation(False, f"{family}/{attn}/{dtype}: all {SEQ} positions finite ({PAD} left-padded)")
